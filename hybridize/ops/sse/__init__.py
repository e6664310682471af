"""Sparse State Expansion: routing, layouts and recurrent decode in `reference`; Triton plan / row movers /
decode step in `triton_plan`, `triton_route`, `triton_decode` (loaded lazily). See README.md."""
