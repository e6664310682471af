"""Generalised (gated) delta-rule op: DeltaNet, Gated DeltaNet and Q-Delta. `reference` holds the PyTorch
recurrent and chunk forms; `triton_erase` and `fla_dqkwg` are GPU pieces around fla-core's kernels. See README.md."""
