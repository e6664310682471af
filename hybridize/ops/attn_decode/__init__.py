"""Split-KV softmax decode attention for the fast rollout path: `triton_split_kv` (kernel and its
PyTorch reference). See README.md in this folder."""
