"""What every op shares: `varlen` (packing helpers), `options` (kernel options), `dispatch` (PyTorch form or
GPU kernel), `fla_adapter` (fla-core wrappers registered with dispatch), `autotune` (Triton autotune cap)."""
