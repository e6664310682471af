"""Functional ops (fla-style layout `[B, T, H, D]`), one module per op family.

Each op module offers a `*_recurrent` reference (a plain per-token loop: the ground truth) and a
`*_chunk` form (chunkwise-parallel, for training and prefill), both with `initial_state`,
`output_final_state` and packed `cu_seqlens`. They compute in fp32 and return the input dtype.
GPU dispatch to fla-core / our Triton kernels lives in `hybridize.kernels.dispatch`.
"""
