"""Gated linear attention (GLA) op: `reference` (PyTorch recurrent and chunk forms), `triton_fwd` /
`triton_bwd` (our pieces GLA on CUDA, loaded lazily). See README.md in this folder."""
