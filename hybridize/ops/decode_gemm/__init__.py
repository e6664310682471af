"""Decode GEMM: `x @ W^T (+ b)` for a decode step's few rows. `route` (decode_linear, linears_routed) picks
the Triton kernel of `triton_gemm` or `F.linear`. See README.md in this folder."""
