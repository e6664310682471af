"""Functional ops (fla-style layout `[B, T, H, D]`), one package per op, laid out like fla's `fla/ops/`.

Each op package (`gla`, `delta`, `log_linear`, `ccq`, `sse`, ...) has a `reference.py` with the op's
`<op>_recurrent` reference (a plain per-token loop: the ground truth) and `<op>_chunk` form
(chunkwise-parallel, for training and prefill), both with `initial_state`, `output_final_state` and
packed `cu_seqlens`; they compute in fp32 and return the input dtype. Next to it: the op's Triton
kernels (imported lazily, only on CUDA or under the Triton interpreter) and a README.md with the op's
math and the paper it follows. `common/` holds what the ops share: packing helpers (`varlen`), the
kernel options (`options`), GPU dispatch (`dispatch`: `dispatch.run(op, mode, ...)`), fla-core's entry
points (`fla_adapter`), the Triton autotune cap (`autotune`) and shared Triton helpers (`triton_utils`).
Each op's GPU wrappers are its `fla.py`; `gpu.py` registers them with dispatch on the first CUDA call.
"""
