"""GPU kernel benchmarks for issue 6 (bf16, H=16, head dim 128, batch 1), median of do_bench.

Sections (each row: forward and forward+backward milliseconds):
- gla:     chunk_gla (per-key gate) on T tokens - the baseline for SSE and CCQ-GLA;
- sse:     SSE with N partitions, top-1, shared partition, GLA backbone: varlen and masking layouts
           (`ops.sse.reference.sse_varlen` / `sse_masking`, routing from random logits), N in `--sse-n`
           (default 4,8,16). varlen uses the device-side plan and our Triton row movers
           (`ops/sse/triton_route.py`); `sse_varlen_torchmove_n{N}k1` is the same plan with the
           PyTorch row movers (kernel option `sse_triton=False`), to show what the kernels buy;
- ccq:     the CCQ covariance read alone (`ccq` op, GPU path), next to GLA and GDN: overhead = ccq / backbone;
- delta:   Gated DeltaNet vs Q-Delta (lam: p = k + lambda q formed by the op) through the delta op (fla fwd +
           checked bwd);
- decode:  one-token step latency at context 4k..64k: GLA, GDN, Q-Delta recurrent steps (fla fused
           recurrent); SSE n4k1 + shared as the full layer op `sse.naive_recurrent_sse` (routing included):
           `decode_sse_n4k1` eager on our Triton decode kernel (state updated in place),
           `decode_sse_n4k1_graph` the same step replayed from a CUDA graph, `decode_sse_n4k1_torch`
           the PyTorch gather -> fla fused recurrent -> scatter path; CCQ decode read; softmax
           attention over a bf16 KV cache (SDPA, one query).

    python -m benchmarks.ops.kernels --T 4096,16384 --sections gla,sse --out bench.json [--warm] [--sse-n 4]

`--warm` runs every function once at the smallest T (compilation only; run several in parallel,
one per section) so that the timed pass loads kernels from Triton's disk cache.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F

from benchmarks.timing import bench, graphed

H, D = 16, 128
DT = torch.bfloat16


def fwd_bwd(fn, inputs, leaves=None):
    """(forward-only fn, forward+backward fn, leaves) for `fn(**inputs) -> o`. `leaves`: every tensor the
    gradient reaches (default: the inputs that require it); the forward+backward fn drops their .grad first, as
    `do_bench(grad_to_none=...)` and a training step's zero_grad(set_to_none=True) do, so a profile of repeated
    calls does not time the accumulation of .grad across calls (session 11; before, it did, on both sides)."""
    if leaves is None:
        leaves = [t for t in inputs.values() if isinstance(t, torch.Tensor) and t.requires_grad]

    def f():
        with torch.no_grad():
            fn(**inputs)

    def fb():
        for t in leaves:
            t.grad = None
        o = fn(**inputs)
        o.backward(cot[0])
    cot = [None]
    with torch.enable_grad():
        cot[0] = torch.randn_like(fn(**inputs))
    return f, fb, leaves


def gla_inputs(T):
    r = lambda *s: torch.randn(*s, device="cuda", dtype=DT)  # noqa: E731
    return dict(q=r(1, T, H, D).requires_grad_(), k=(r(1, T, H, D) * D ** -0.5).requires_grad_(),
                v=r(1, T, H, D).requires_grad_(),
                g=(F.logsigmoid(torch.randn(1, T, H, D, device="cuda")) / 16).requires_grad_())


def delta_inputs(T, qdelta=False):
    unit = lambda: F.normalize(torch.randn(1, T, H, D, device="cuda", dtype=DT), dim=-1)  # noqa: E731
    x = dict(q=unit().requires_grad_(), k=unit().requires_grad_(),
             v=torch.randn(1, T, H, D, device="cuda", dtype=DT).requires_grad_(),
             beta=torch.rand(1, T, H, device="cuda").requires_grad_(),
             g=(-torch.rand(1, T, H, device="cuda") * 0.1).requires_grad_())
    if qdelta:
        x["lam"] = torch.full((H,), 0.1, device="cuda").requires_grad_()   # the mixer's lambda: a parameter
    return x


def run_gla(q, k, v, g):
    from hybridize.ops.common import dispatch
    return dispatch.run("gla", "chunk", q, k, v, g)[0]


def run_gla_varlen(q, k, v, g, cu_seqlens):
    from hybridize.ops.common import dispatch
    return dispatch.run("gla", "chunk", q, k, v, g, cu_seqlens=cu_seqlens)[0]


def run_delta(q, k, v, beta, g, lam=None):
    from hybridize.ops.common import dispatch
    # Q-Delta as the mixer calls it: the op forms p = k + lam q (one fused pass with exp(g) on the GPU)
    return dispatch.run("delta", "chunk", q, k, v, beta, g=g, lam=lam)[0]


def run_ccq(q, k):
    from hybridize.ops.common import dispatch
    return dispatch.run("ccq", "chunk", q, k)[0]


def sse_setup(T, N, layout):
    from hybridize.ops.sse import reference as sse
    r = lambda *s: torch.randn(*s, device="cuda", dtype=DT)  # noqa: E731
    g = lambda: (F.logsigmoid(torch.randn(1, T, H, D, device="cuda")) / 16).requires_grad_()  # noqa: E731
    shared = sse.PathInputs(q=r(1, T, H, D).requires_grad_(), k=(r(1, T, H, D) * D ** -0.5).requires_grad_(),
                            v=r(1, T, H, D).requires_grad_(), g=g())
    sparse = sse.PathInputs(q=r(1, T, H, D).requires_grad_(), k=(r(1, T, H, D) * D ** -0.5).requires_grad_(),
                            v=shared.v, g=g())
    logits = torch.randn(1, T, N, device="cuda", requires_grad=True)
    fn = sse.LAYOUTS[layout]
    cu = torch.tensor([0, T], device="cuda")

    def call(logits=logits):
        routing = sse.route(logits, 1)
        return fn("gla", shared, sparse, routing, cu_seqlens=cu)[0]
    return call, dict(logits=logits), [shared.q, shared.k, shared.v, shared.g, sparse.q, sparse.k, sparse.g, logits]


def timed(rows, name, T, f, fb, leaves, extra=None):
    row = dict(name=name, T=T, **(extra or {}))
    try:
        row["fwd_ms"] = bench(f)
        if fb is not None:
            row["fwdbwd_ms"] = bench(fb, grad_to_none=leaves)
    except Exception as e:  # noqa: BLE001 - reported in the table
        row["error"] = f"{type(e).__name__}: {str(e)[:120]}"
    torch.cuda.empty_cache()
    rows.append(row)
    print(json.dumps(row), flush=True)


def section_gla(rows, T, warm):
    x = gla_inputs(T)
    f, fb, leaves = fwd_bwd(run_gla, x)
    timed(rows, "gla", T, f, fb, leaves) if not warm else (f(), fb())


SSE_NS = (4, 8, 16)


def section_sse(rows, T, warm):
    from hybridize.ops.common.options import use_kernel_options
    cases = [("varlen", N, True) for N in SSE_NS] + [("varlen", SSE_NS[0], False), ("masking", SSE_NS[0], True)]
    for layout, N, triton_moves in cases:
        with use_kernel_options(sse_triton=triton_moves):
            call, inp, leaves = sse_setup(T, N, layout)
            f, fb, _ = fwd_bwd(call, inp, leaves)
            if warm:
                f(), fb()
            else:
                tag = layout if triton_moves else f"{layout}_torchmove"
                timed(rows, f"sse_{tag}_n{N}k1", T, f, fb, leaves)


def section_ccq(rows, T, warm):
    x = gla_inputs(T)
    inp = dict(q=x["q"], k=F.normalize(x["k"].detach().float(), dim=-1).to(DT).requires_grad_())
    f, fb, leaves = fwd_bwd(run_ccq, inp)
    timed(rows, "ccq_read", T, f, fb, leaves) if not warm else (f(), fb())


def section_delta(rows, T, warm):
    for name, qd in (("gdn", False), ("qdelta", True)):
        x = delta_inputs(T, qd)
        f, fb, leaves = fwd_bwd(run_delta, x)
        timed(rows, name, T, f, fb, leaves) if not warm else (f(), fb())


def sse_decode_setup(N=4):
    """Inputs of one SSE n{N}k1 decode step (B = 1, shared partition, GLA backbone) and the step."""
    from hybridize.ops.sse import reference as sse
    unit = lambda *s: F.normalize(torch.randn(*s, device="cuda", dtype=DT), dim=-1)  # noqa: E731
    gate = lambda: F.logsigmoid(torch.randn(1, 1, H, D, device="cuda")) / 16  # noqa: E731
    v = torch.randn(1, 1, H, D, device="cuda", dtype=DT)
    shared = sse.PathInputs(q=unit(1, 1, H, D), k=unit(1, 1, H, D), v=v, g=gate())
    sparse = sse.PathInputs(q=unit(1, 1, H, D), k=unit(1, 1, H, D), v=v, g=gate())
    logits = torch.randn(1, 1, N, device="cuda")
    state = (torch.randn(1, H, D, D, device="cuda") * 0.01, torch.randn(1, N, H, D, D, device="cuda") * 0.01)

    def step():
        return sse.naive_recurrent_sse("gla", shared, sparse, sse.route(logits, 1), initial_state=state,
                                       output_final_state=True, inplace=True)[0]
    return step


def sse_decode_torch(step):
    from hybridize.ops.common.options import use_kernel_options

    def run():
        with use_kernel_options(sse_triton=False):
            return step()
    return run


def section_decode(rows, T, warm):
    from hybridize.ops.common import dispatch
    unit = lambda *s: F.normalize(torch.randn(*s, device="cuda", dtype=DT), dim=-1)  # noqa: E731
    q, k, p = unit(1, 1, H, D), unit(1, 1, H, D), unit(1, 1, H, D)
    v = torch.randn(1, 1, H, D, device="cuda", dtype=DT)
    S = torch.randn(1, H, D, D, device="cuda") * 0.01
    gv = F.logsigmoid(torch.randn(1, 1, H, D, device="cuda")) / 16
    gs, beta = -torch.rand(1, 1, H, device="cuda") * 0.1, torch.rand(1, 1, H, device="cuda")
    sse_step = sse_decode_setup(4)
    ccq_state = (torch.eye(D, device="cuda").expand(1, H, D, D).contiguous() / D,
                 torch.zeros(1, H, D, device="cuda"), torch.tensor([T], device="cuda"))
    kc = torch.randn(1, H, T, D, device="cuda", dtype=DT)
    vc = torch.randn(1, H, T, D, device="cuda", dtype=DT)
    qa = torch.randn(1, H, 1, D, device="cuda", dtype=DT)
    fns = {
        "decode_gla": lambda: dispatch.run("gla", "recurrent", q, k, v, gv, initial_state=S, output_final_state=True),
        "decode_gdn": lambda: dispatch.run("delta", "recurrent", q, k, v, beta, g=gs, initial_state=S,
                                           output_final_state=True),
        "decode_qdelta": lambda: dispatch.run("delta", "recurrent", q, k, v, beta, g=gs, p=k + 0.1 * q,
                                              initial_state=S, output_final_state=True),
        "decode_sse_n4k1": sse_step,
        "decode_sse_n4k1_graph": None,                    # captured below, after the eager step compiled
        "decode_sse_n4k1_torch": sse_decode_torch(sse_step),
        "decode_ccq_read": lambda: dispatch.run("ccq", "recurrent", q, k, initial_state=ccq_state,
                                                output_final_state=True),
        "decode_softmax_kv": lambda: F.scaled_dot_product_attention(qa, kc, vc),
    }
    with torch.no_grad():
        for name, fn in fns.items():
            if fn is None:
                try:
                    fn = graphed(sse_step)
                except Exception as e:  # noqa: BLE001 - reported in the table
                    rows.append(dict(name=name, T=T, error=f"{type(e).__name__}: {str(e)[:120]}"))
                    print(json.dumps(rows[-1]), flush=True)
                    continue
            if warm:
                fn()
            else:
                timed(rows, name, T, fn, None, None)


SECTIONS = dict(gla=section_gla, sse=section_sse, ccq=section_ccq, delta=section_delta, decode=section_decode)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", default="4096,16384,32768,65536")
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--out", default=None)
    ap.add_argument("--warm", action="store_true")
    ap.add_argument("--deadline", type=float, default=1e9, help="seconds; skip what would start later")
    ap.add_argument("--sse-n", default="4,8,16", help="partition counts of the sse section (first: masking too)")
    a = ap.parse_args()
    global SSE_NS
    SSE_NS = tuple(int(n) for n in a.sse_n.split(","))
    if not torch.cuda.is_available():
        print("benchmarks/ops/kernels.py: no CUDA device")
        return 0
    from hybridize.ops import gpu
    from hybridize.ops.common import dispatch
    assert gpu.activate()
    dispatch.set_backend("auto")  # ccq decode has no GPU kernel: PyTorch ops on CUDA tensors
    from hybridize.ops.common.options import current_kernel_options
    Ts = [int(t) for t in a.T.split(",")]
    rows, start = [], time.time()
    print(f"device {torch.cuda.get_device_name()} torch {torch.__version__} "
          f"autotune_top={current_kernel_options().autotune_top}", flush=True)
    for sec in a.sections.split(","):
        for T in (Ts[:1] if a.warm else Ts):
            if time.time() - start > a.deadline:
                rows.append(dict(name=sec, T=T, error="skipped: deadline"))
                continue
            torch.manual_seed(T)
            SECTIONS[sec](rows, T, a.warm)
            if a.out:
                with open(a.out, "w") as f:
                    json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    if not a.warm:
        print(f"\n{'name':22s} {'T':>6s} {'fwd ms':>9s} {'fwd+bwd ms':>11s}")
        for r in rows:
            print(f"{r['name']:22s} {r['T']:6d} {r.get('fwd_ms', float('nan')):9.3f} "
                  f"{r.get('fwdbwd_ms', float('nan')):11.3f} {r.get('error', '')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
