"""Benchmarks (see benchmarks/README.md); run modules from the repo root: python -m benchmarks.<folder>.<script>."""
