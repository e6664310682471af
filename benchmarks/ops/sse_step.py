"""One SSE layer's decode step: the one-kernel step (`ops/sse/triton_fused_step.py`) against the separate kernels.

    python -m benchmarks.ops.sse_step --out $OUT/sse_step.json          # Qwen3-1.7B and SmolLM2-135M layer shapes

Per shape and batch, microseconds per decode token of one SSE mixer (random weights, bf16, fp32 states, the fused
projection matmuls through the decode GEMM as in the fast engine), each the mean over a CUDA graph of back-to-back
steps (launch overhead out, as in the engine's graph replays): the whole mixer step with the separate path
(`sse_fused_step=False`: front-end kernels + two decode-kernel calls + sum) and with the fused step (with the output
norm and gate in it, option `sse_step_finish`, and without), then the fused kernel alone at each value-block width
(`--bv`; "auto" is `block_v`'s choice), plain and finishing the heads. The output norm, gate and o_proj are in every
whole-step column. `--scan-bv` / `--scan-warps` also time the kernel alone as the engine launches it
(`SSE.step_inputs`) at each value-block width, warps per program and `--scan-paths` (1: both partitions' updates in
one program, 2: a program each); with `--cold N` over N independent states in
turn, so that they come from memory as in the engine (a single state of the 1.7B shape stays in the H200's L2 up to
batch 8). Prints a markdown table and writes `--out` JSON.
"""
from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch

from benchmarks.timing import graph_time_us, md_table

# (hidden, heads, kv heads, head dim, q/k norm): the SSE layers of the two benchmark shapes
SHAPES = {"qwen3-1.7b": (2048, 16, 8, 128, True), "smollm2-135m": (576, 9, 3, 64, False)}


def build(shape: str, device, dtype):
    from hybridize.mixers.sse import SSE, SSEConfig
    hidden, H, Hk, D, norm = SHAPES[shape]
    cfg = SSEConfig(hidden_size=hidden, num_heads=H, num_kv_heads=Hk, head_dim=D, qk_norm=norm, use_rope=True)
    m = SSE(cfg).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in m.parameters():   # spread the identity-like inits so routing and gates vary
            p.add_(0.02 * torch.randn(p.shape, generator=g))
    return m.to(device=device, dtype=dtype)


def step_fn(m, B: int, device, dtype):
    from hybridize.mixers.sse import SSEState
    c = m.config
    st = SSEState(sparse=torch.zeros(B, c.num_partitions, c.num_heads, c.head_dim, c.head_dim, device=device),
                  shared=torch.zeros(B, c.num_heads, c.head_dim, c.head_dim, device=device))
    st.writable = True
    x = torch.randn(B, 1, c.hidden_size, device=device, dtype=dtype)
    ang = torch.rand(B, 1, c.head_dim, device=device) * 6.28
    pe = (ang.cos().to(dtype), ang.sin().to(dtype))
    return (lambda: m(x, state=st, position_embeddings=pe, output_state=True)), (x, st, pe)


def scan(m, x, st, pe, bvs: str, warps: str, step, cold: int = 0, paths: str = "1") -> dict:
    """{"scan bv=.. w=.. p=..": us} of the step kernel alone on the inputs the engine gives it (`SSE.step_inputs`: the
    kernel options' path, the heads finished), per value-block width, warps per program and programs per partition
    pair (`paths`: 1 both partitions in one program, 2 one each; bv wider than the head skipped). `cold` > 0: the graph steps `cold` independent states and inputs in turn, as the engine's layers do, so
    the states come from memory and not from L2 (0: one state, which at batch 8 of the 1.7B shape, 42 MB, stays in the
    H200's L2 between calls)."""
    copies = [(x, st)] if cold <= 0 else [(torch.randn_like(x), _fresh_state(st)) for _ in range(cold)]
    inputs = [m.step_inputs(xi, si, pe) for xi, si in copies]
    D = inputs[0]["layout"].head_dim
    out = {}
    for bv, w, n in itertools.product((int(b) for b in bvs.split(",")), (int(v) for v in warps.split(",")),
                                      (int(p) for p in paths.split(","))):
        if bv <= D:
            fns = [lambda a=a, bv=bv, w=w, n=n: step(**a, bv=bv, warps=w, paths=n) for a in inputs]
            out[f"scan bv={bv} w={w} p={n}"] = graph_time_us(fns, reps=50)
    return out


def _fresh_state(st):
    """A state like st with its own random tensors (the step updates states in place)."""
    from hybridize.mixers.sse import SSEState
    new = SSEState(sparse=0.1 * torch.randn_like(st.sparse), shared=0.1 * torch.randn_like(st.shared))
    new.writable = True
    return new


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="qwen3-1.7b,smollm2-135m")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--bv", default="auto,16,32,64", help="value-block widths of the kernel-alone columns")
    ap.add_argument("--scan-bv", default="", help="also time the kernel as the engine launches it (its layout, "
                    "finishing the heads) at each of these value-block widths x --scan-warps, e.g. 16,32,64,128")
    ap.add_argument("--scan-warps", default="1,2,4,8", help="warps per program of the --scan-bv grid")
    ap.add_argument("--scan-paths", default="1", help="programs per partition pair of the --scan-bv grid (1: both "
                    "partitions in one program, 2: a program each), comma-separated")
    ap.add_argument("--cold", type=int, default=0, help="--scan-bv steps this many independent states in turn, so "
                    "they are read from memory as in the engine (0: one state, L2-resident when it fits)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/ops/sse_step.py needs a CUDA device")
    from hybridize.ops.common.options import use_kernel_options
    from hybridize.ops.decode_gemm.route import linears_routed
    from hybridize.ops.sse.fused_step import block_v
    from hybridize.ops.sse.triton_fused_step import sse_gla_step
    device, dtype = torch.device("cuda"), torch.bfloat16
    bvs = args.bv.split(",")
    cols = (["shape", "batch", "separate us", "fused us", "fused unfinished us", "fused / separate"]
            + [f"kernel bv={b} us" for b in bvs] + [f"finishing bv={b} us" for b in bvs])
    rows, out = [], []
    for shape in args.shapes.split(","):
        m = build(shape, device, dtype)
        layout, finishing = m.step_layout(), m.step_layout(finish=True)
        for B in (int(b) for b in args.batches.split(",")):
            fn, (x, st, pe) = step_fn(m, B, device, dtype)
            times = {}
            with torch.no_grad(), linears_routed(m, "auto"):
                for name, fused, finish in (("separate", False, True), ("fused", True, True),
                                            ("fused unfinished", True, False)):
                    with use_kernel_options(sse_fused_step=fused, sse_step_finish=finish):
                        assert m.fused_step_ok(x, st, None, pe) == fused
                        times[name] = graph_time_us([fn], reps=50)
                y, u, wn, _ = m._decode_projections(x)
                gain = m.o_norm.gain()
                for b in bvs:
                    bv = block_v(B, layout.heads, layout.head_dim) if b == "auto" else int(b)
                    times[f"bv={b}"] = graph_time_us(
                        [lambda bv=bv: sse_gla_step(y, u, st.shared, st.sparse, layout, wn, *pe, bv=bv)], reps=50)
                    bv = block_v(B, layout.heads, layout.head_dim, finish=True) if b == "auto" else int(b)
                    times[f"finishing bv={b}"] = graph_time_us(
                        [lambda bv=bv: sse_gla_step(y, u, st.shared, st.sparse, finishing, wn, *pe, bv=bv,
                                                    out_weight=gain)], reps=50)
                if args.scan_bv:
                    times.update(scan(m, x, st, pe, args.scan_bv, args.scan_warps, sse_gla_step, args.cold,
                                      args.scan_paths))
            rec = dict(shape=shape, batch=B, **{k: round(v, 2) for k, v in times.items()})
            out.append(rec)
            rows.append([shape, B, f"{times['separate']:.1f}", f"{times['fused']:.1f}",
                         f"{times['fused unfinished']:.1f}", f"{times['fused'] / times['separate']:.2f}x"]
                        + [f"{times[f'bv={b}']:.1f}" for b in bvs] + [f"{times[f'finishing bv={b}']:.1f}" for b in bvs])
            print(rows[-1], flush=True)
            if args.scan_bv:
                print(f"  {shape} batch {B}, the engine's kernel by (bv, warps), us: "
                      + ", ".join(f"{k[5:]} {v:.1f}" for k, v in times.items() if k.startswith("scan ")), flush=True)
            if args.out:
                Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": out}, indent=1))
    print(f"device: {torch.cuda.get_device_name()} | bf16, fp32 states, one SSE mixer's decode step, CUDA graph")
    print(md_table(cols, rows))


if __name__ == "__main__":
    main()
