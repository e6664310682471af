"""What every op shares: `varlen` (packing helpers), `options` (kernel options), `registry` (each op's
PyTorch forms and registered GPU kernels), `dispatch` (PyTorch form or GPU kernel), `fla_adapter`
(fla-core's entry points and what the ops' `fla.py` wrappers share), `autotune` (Triton autotune cap),
`triton_utils` (Triton helpers and the pieces table our kernels share, the table of packed documents in one
kernel included)."""
