"""GPU-side pieces that fla-core does not provide (imported lazily, only on CUDA).

- `autotune`: caps Triton autotuning to a few preferred configs (kernel option `autotune_top`,
  `HYBRIDIZE_AUTOTUNE_TOP`), so a new shape costs seconds of compilation instead of minutes of tuning.
- `dqkwg`: a batched-PyTorch replacement for fla's gated `chunk_bwd_dqkwg` kernel, which fla refuses
  to run on Hopper with Triton 3.4-3.7.0 (fla issue #640); the rest of fla's backward is kept.
- `sse_decode`: partition-sparse SSE decode step that reads and writes only the selected partitions.
- `sse_route`: SSE varlen row movers (gather with the router-probability multiply, gather-sum back).
- `ccq_read`: CCQ's covariance read (C_t q and mu_t mu_t^T q) in one chunked pass, forward and backward.
- `attn_decode`: split-KV softmax decode attention for the fast rollout path.
- `erase`: Q-Delta's erase direction exp(g) (k + lambda q) for fla's Comba kernels, one pass each way.
- `decode_linear`: a weight-streaming GEMM for a decode step's few rows, and the per-shape timed choice
  between it and cuBLAS (`hybridize.ops.decode_gemm.route` routes a model's linears through it).

Nothing here is imported by `import hybridize`: the modules import triton / fla at their top and are
loaded by `hybridize.kernels.fla_adapter` on the first CUDA call.
"""
