"""Gradient error of our pieces GLA (`ops/gla/triton_bwd.gla_triton`) and fla's chunk_gla at long contexts.

`gpu_check.py` checks every op at 157 tokens; here the sequences are long, where the gates' gradient
dg_t = sum_{t' >= t} (q_t' dq_t' - k_t' dk_t') is a long suffix sum whose terms cancel (scaling a key channel of q
by a and of k by 1/a leaves the output unchanged, so the whole sequence's sum is zero without an initial state), so
rounding in dq or dk shows there first. Both ops get the same bf16 q, k, v (fp32 gates) and the same output
gradient; the reference is the chunked PyTorch form (`ops/gla/reference.chunk_gla`) in float64 on those inputs.
Error: ||x - ref|| / ||ref|| per output and gradient (as gpu_check). CUDA only.

    python -m benchmarks.ops.gla_grad_error [--T 4096,16384] [--gate-scale 16] [--out rows.json]
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

H, K, V = 16, 128, 128


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp(min=1e-300)).item()


def inputs(T: int, gate_scale: float = 16.0, seed: int = 0, heads: int = H, K: int = K, V: int = V,
           device: str = "cuda") -> dict:
    """bf16 q, k (times K^-1/2), v `[1, T, H, D]`, fp32 per-channel log-decays `logsigmoid(x) / gate_scale`, bf16
    output gradient (also the CPU model's inputs, `gla_dg_rounding.py`)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    r = lambda *s: torch.randn(*s, device=device, generator=gen)  # noqa: E731
    return dict(q=r(1, T, heads, K).bfloat16(), k=(r(1, T, heads, K) * K ** -0.5).bfloat16(),
                v=r(1, T, heads, V).bfloat16(), g=F.logsigmoid(r(1, T, heads, K)) / gate_scale,
                do=r(1, T, heads, V).bfloat16())


def grads(fn, x: dict, dtype=None) -> dict:
    """{o, dq, dk, dv, dg} of `fn(q, k, v, g) -> (o, state)` on `x` (cast to `dtype` when given)."""
    leaves = {n: x[n].to(dtype or x[n].dtype).detach().requires_grad_() for n in "qkvg"}
    o, _ = fn(leaves["q"], leaves["k"], leaves["v"], leaves["g"])
    o.backward(x["do"].to(o.dtype))
    return {"o": o.detach(), **{f"d{n}": t.grad for n, t in leaves.items()}}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--T", default="4096,16384", help="sequence lengths, comma-separated")
    ap.add_argument("--gate-scale", type=float, default=16.0,
                    help="log-decays are logsigmoid(randn) / this (larger: slower decay, longer sums)")
    ap.add_argument("--segment-len", type=int, default=None,
                    help="our op's piece length (gla_triton's segment_len; default: its own rule). dg's suffix sums "
                         "run over a whole piece, so shorter pieces cancel over shorter spans")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="", help="write the rows here as JSON too")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("gla_grad_error needs a CUDA GPU (it times nothing; it compares the GPU ops' gradients)")
    from fla.ops.gla import chunk_gla as fla_chunk_gla
    from hybridize.ops.gla.reference import chunk_gla as ref_chunk_gla
    from hybridize.ops.gla.triton_bwd import _dg_anchor, gla_triton
    ops = {"ours (gla_triton)": lambda q, k, v, g: gla_triton(q, k, v, g, segment_len=a.segment_len),
           "fla chunk_gla": lambda q, k, v, g: fla_chunk_gla(q, k, v, g)}
    rows = []
    pieces = "their rule" if a.segment_len is None else a.segment_len or "one per sequence"
    anchor = _dg_anchor()
    print(f"{torch.cuda.get_device_name()}, bf16 q/k/v, fp32 gates logsigmoid(x)/{a.gate_scale:g}, H={H}, K=V={K}, "
          f"our pieces: {pieces}, dg's suffix reset every {anchor or 'no'} tokens in longer pieces")
    print(f"{'T':>6} {'op':<18} " + " ".join(f"{n:>9}" for n in ("o", "dq", "dk", "dv", "dg")))
    for T in (int(t) for t in a.T.split(",")):
        x = inputs(T, a.gate_scale, a.seed)
        ref = grads(lambda q, k, v, g: ref_chunk_gla(q, k, v, g), x, torch.float64)
        for name, fn in ops.items():
            errs = {n: rel(t, ref[n]) for n, t in grads(fn, x).items()}
            rows.append(dict(T=T, op=name, gate_scale=a.gate_scale, segment_len=a.segment_len, anchor=anchor,
                             **errs))
            print(f"{T:>6} {name:<18} " + " ".join(f"{errs[n]:9.2e}" for n in ("o", "dq", "dk", "dv", "dg")))
        del ref
        torch.cuda.empty_cache()
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
