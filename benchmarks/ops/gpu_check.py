"""Verify every registered GPU op against the fp32 PyTorch reference; exit non-zero on any failure.

For each case (op, mode, variant) x dtype (fp32, bf16) x layout (dense: B=2, odd T, initial state in and
final state out; varlen: B=1 packed with cu_seqlens, odd lengths, one state per sequence):
fresh random inputs (seed printed), the CUDA caching allocator poisoned with NaN before the GPU call
(unwritten outputs show up as NaN), forward outputs, final states and the gradients of every float
input (including the initial state) compared with the PyTorch `*_recurrent` ground truth run in fp32 on
the same (rounded) inputs. Error: ||gpu - ref|| / ||ref|| (norm-wise, METHOD.md), NaN fails.
Tolerances: fp32 3e-3 (fla runs fp32 dots in tf32 on Hopper), bf16 3e-2.

Groups of cases run as parallel subprocesses (`--jobs`): Triton compilation is CPU-bound and each group
compiles different kernels, so this cuts wall time; results are gathered into one table.

    python -m benchmarks.ops.gpu_check [--jobs 6] [--out gpu_check.jsonl] [--budget 540] [--only gla,delta]

Every finished case is appended to `--out` at once (a run stopped by a time limit keeps what it finished);
groups still running after `--budget` seconds are stopped and reported as not finished.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
import zlib

import torch
import torch.nn.functional as F

TOL = {torch.float32: 3e-3, torch.bfloat16: 3e-2}
H, K, V = 16, 128, 128
DENSE_T, VAR_LENS = 157, (37, 100, 63)


def poison():
    """Fill free cached device memory with NaN so that outputs the kernels forget to write are NaN."""
    free = torch.cuda.mem_get_info()[0]
    n = min(int(free * 0.3), 4 << 30) // 4
    t = torch.empty(n, dtype=torch.float32, device="cuda").fill_(float("nan"))
    del t


def rel(a, b):
    a, b = a.float(), b.float()
    if not torch.isfinite(a).all():
        return float("nan")
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


# ---- input builders: return (args, kwargs, names of differentiable inputs) ----------------------

def layout(varlen):
    if varlen:
        cu = torch.tensor([0, *torch.tensor(VAR_LENS).cumsum(0).tolist()], device="cuda")
        return 1, int(cu[-1]), cu, len(VAR_LENS)
    return 2, DENSE_T, None, 2


def build(case, varlen):
    B, T, cu, N = layout(varlen)
    r = lambda *s: torch.randn(*s, device="cuda")  # noqa: E731
    unit = lambda *s: F.normalize(r(*s), dim=-1)  # noqa: E731
    kw = dict(cu_seqlens=cu)
    if case.startswith("gla"):
        gate = case.split("/")[1]
        g = {"none": None, "scalar": F.logsigmoid(r(B, T, H)) / 4,
             "vector": F.logsigmoid(r(B, T, H, K)) / 8}[gate]
        x = dict(q=r(B, T, H, K), k=r(B, T, H, K) * K ** -0.5, v=r(B, T, H, V), g=g)
        x["initial_state"] = r(N, H, K, V) * 0.1
        return x, dict(kw, output_final_state=True)
    if case.startswith("delta"):  # unit q, k and beta in (0, 1): the contraction regime the mixers use
        kind = case.split("/")[1]
        x = dict(q=unit(B, T, H, K), k=unit(B, T, H, K), v=r(B, T, H, V), beta=torch.rand(B, T, H, device="cuda"),
                 g=None if kind == "deltanet" else -torch.rand(B, T, H, device="cuda") * 0.3)
        if kind == "qdelta":
            x["p"] = x["k"] + 0.4 * x["q"]
        x["initial_state"] = r(N, H, K, V) * 0.1
        return x, dict(kw, output_final_state=True)
    if case == "ccq":
        C0 = r(N, H, K, K) * 0.1
        x = dict(q=r(B, T, H, K), k=unit(B, T, H, K))
        state = ((C0 + C0.transpose(-1, -2)) / 2, r(N, H, K) * 0.05, torch.randint(1, 50, (N,), device="cuda"))
        extra = dict(kw, initial_state=state, output_final_state=True)
        if not varlen:
            extra["mask"] = torch.rand(B, T, device="cuda") > 0.1
        return x, extra
    if case == "log_linear":
        L = max(T - 1, 1).bit_length() + 2
        x = dict(q=r(B, T, H, 64), k=r(B, T, H, 64) * 0.125, v=r(B, T, H, V),
                 g=-torch.rand(B, T, H, device="cuda") * 0.2, level_scales=torch.rand(B, T, H, L, device="cuda"))
        return x, dict(kw)
    raise ValueError(case)


OPS = {"gla": ("gla", "chunk"), "ccq": ("ccq", "chunk"), "log_linear": ("log_linear", "chunk"),
       "delta": ("delta", "chunk")}


def op_of(case):
    name = case.split("/")[0]
    if name == "gla_pieces":   # our pieces GLA (`ops/gla/triton_bwd.py`), SSE's varlen call; not in dispatch
        return "gla", "pieces"
    if name.endswith("@rec"):
        return name[:-4], "recurrent"
    return OPS[name]


def ref_call(case, x, kw):
    from hybridize.ops.common import dispatch
    op, _ = op_of(case)
    return dispatch.torch_impl(op, "recurrent")(**x, **kw)


def gpu_call(case, x, kw):
    from hybridize.ops.common import dispatch
    op, mode = op_of(case)
    if mode == "pieces":
        from hybridize.ops.gla.triton_bwd import gla_triton
        return gla_triton(**x, **kw)
    return dispatch.run(op, mode, **x, **kw)


def flatten_outputs(out):
    o, st = out
    items = [("o", o)]
    if isinstance(st, tuple):
        items += [(f"state{i}", s) for i, s in enumerate(st) if s.is_floating_point()]
    elif st is not None:
        items.append(("state", st))
    return items


def check_one(case, dtype, varlen, grad=True):
    x, kw = build(case, varlen)
    cast = {n: (t.to(dtype) if (t is not None and n not in ("initial_state", "g", "beta")) else t)
            for n, t in x.items()}
    ref_in = {n: (None if t is None else t.detach().double().float().requires_grad_(grad)) for n, t in cast.items()}
    kw_ref = kw
    gpu_in = {n: (None if t is None else t.detach().clone().requires_grad_(grad)) for n, t in cast.items()}
    out_ref = flatten_outputs(ref_call(case, ref_in, kw_ref))
    poison()
    out_gpu = flatten_outputs(gpu_call(case, gpu_in, kw))
    errs = {name: rel(a, b) for (name, a), (_, b) in zip(out_gpu, out_ref)}
    if grad:
        cot = [torch.randn_like(b.float()) for _, b in out_ref]
        sum(((b.float() * c).sum() for (_, b), c in zip(out_ref, cot)), torch.zeros((), device="cuda")).backward()
        poison()
        sum(((a.float() * c).sum() for (_, a), c in zip(out_gpu, cot)), torch.zeros((), device="cuda")).backward()
        for n, t in gpu_in.items():
            if t is None:
                continue
            if ref_in[n].grad is None:
                continue
            errs[f"d{n}"] = float("nan") if t.grad is None else rel(t.grad, ref_in[n].grad)
    worst = max(errs.values(), key=lambda e: math.inf if math.isnan(e) else e)
    ok = not math.isnan(worst) and worst < TOL[dtype]
    return dict(case=case, dtype=str(dtype).split(".")[-1], layout="varlen" if varlen else "dense",
                worst=worst, ok=ok, errs=errs)


def sse_decode_check():
    from hybridize.ops.sse.triton_decode import sse_decode_step, sse_decode_step_reference
    rows = []
    for backbone in ("gla", "delta", "qdelta"):
        B, P, S = 3, 16, 1
        state = torch.randn(B, P, H, K, V, device="cuda")
        index = torch.randint(0, P, (B, S), device="cuda")
        index[-1, 0] = -1
        q, k, p = (F.normalize(torch.randn(B, S, H, K, device="cuda"), dim=-1) for _ in range(3))
        v = torch.randn(B, S, H, V, device="cuda")
        g = F.logsigmoid(torch.randn(B, S, H, K, device="cuda")) if backbone == "gla" else -torch.rand(B, S, H, device="cuda")
        beta = None if backbone == "gla" else torch.rand(B, S, H, device="cuda")
        pp = p if backbone == "qdelta" else None
        ref_state = state.clone()
        o_ref = sse_decode_step_reference(ref_state, index, q, k, v, g=g, beta=beta, p=pp)
        out_state = state.clone()
        poison()
        o = sse_decode_step(out_state, index, q, k, v, g=g, beta=beta, p=pp)
        torch.cuda.synchronize()
        errs = dict(o=rel(o, o_ref), state=rel(out_state, ref_state))
        sel = torch.zeros(B, P, dtype=torch.bool, device="cuda")
        for b in range(B):
            if index[b, 0] >= 0:
                sel[b, index[b, 0]] = True
        errs["untouched_bitexact"] = 0.0 if torch.equal(out_state[~sel], state[~sel]) else float("nan")
        worst = max(errs.values(), key=lambda e: math.inf if math.isnan(e) else e)
        rows.append(dict(case=f"sse_decode/{backbone}", dtype="float32", layout="decode", worst=worst,
                         ok=not math.isnan(worst) and worst < 1e-5, errs=errs))
    return rows


def guard_probe():
    """Does fla's own #640 guard fire here? (informational: tells whether our dqkwg is needed)"""
    from hybridize.ops.common.options import use_kernel_options
    try:
        with use_kernel_options(fla_dqkwg="fla"):
            row = check_one("delta/gdn", torch.bfloat16, False)
        note = "fla gated dqkwg ran (guard did not fire)"
    except RuntimeError as e:
        row, note = None, f"fla guard fired: {str(e)[:80]}"
    out = dict(case="probe/fla_dqkwg", dtype="bfloat16", layout="dense", worst=0.0, ok=True, errs={}, note=note)
    if row is not None:
        out["errs"], out["worst"] = row["errs"], row["worst"]
    return [out]


# Groups run as parallel processes, the slowest first. CCQ's read tunes its tiles per shape and dtype (about
# 300 s per case from a cold cache), so each of its four cases is a group of its own: `ccq/<dtype>/<layout>`.
GROUPS = {
    **{f"ccq_{dt}_{lay}": [f"ccq/{dt}/{lay}"] for dt in ("float32", "bfloat16") for lay in ("dense", "varlen")},
    "gla_pieces": ["gla_pieces/vector"],
    "gla": ["gla/none", "gla/scalar", "gla/vector", "gla@rec/vector"],
    "deltanet": ["delta/deltanet"],
    "gdn": ["delta/gdn", "delta@rec/gdn"],
    "qdelta": ["delta/qdelta", "delta@rec/qdelta"],
    "log_linear": ["log_linear"],
    "extra": ["sse_decode", "probe"],
}


def case_runs(case: str):
    """(case, dtype, varlen) triples a GROUPS entry stands for: a bare case runs fp32 and bf16, dense and
    varlen; `case/<dtype>/<layout>` runs one of them."""
    parts = case.split("/")
    if len(parts) == 3 and parts[1] in ("float32", "bfloat16"):
        return [(parts[0], getattr(torch, parts[1]), parts[2] == "varlen")]
    return [(case, dt, v) for dt in (torch.float32, torch.bfloat16) for v in (False, True)
            if not (case == "log_linear" and v)]   # fla's log-linear varlen: checked dense only (see RESULTS.md)


def append_rows(path: str, rows: list[dict]) -> None:
    """Append rows to the JSONL results file under an exclusive lock (groups run as parallel processes), so every
    finished case is on disk at once and a run killed by a time limit keeps what it had."""
    import fcntl

    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write("".join(json.dumps(r) + "\n" for r in rows))
        f.flush()
        fcntl.flock(f, fcntl.LOCK_UN)


def run_group(name, out):
    from hybridize.ops import gpu
    from hybridize.ops.common import dispatch
    assert gpu.activate(), "fla adapter not available (CUDA + fla-core + triton needed)"
    dispatch.set_backend("gpu")

    def done(new_rows):
        for row in new_rows:
            row["group"] = name
            print(json.dumps(row), flush=True)
        append_rows(out, new_rows)

    for case in GROUPS[name]:
        if case == "sse_decode":
            done(sse_decode_check())
            continue
        if case == "probe":
            done(guard_probe())
            continue
        for case, dtype, varlen in case_runs(case):
            t0 = time.time()
            try:
                row = check_one(case, dtype, varlen, grad=not case.startswith("delta@rec"))
            except Exception as e:  # report, do not hide
                row = dict(case=case, dtype=str(dtype).split(".")[-1], layout="varlen" if varlen else "dense",
                           worst=float("nan"), ok=False, errs={}, note=f"{type(e).__name__}: {str(e)[:160]}")
            row["secs"] = round(time.time() - t0, 1)
            done([row])


def group_failed(name: str, note: str) -> dict:
    return dict(case=f"group:{name}", group=name, dtype="-", layout="-", worst=float("nan"), ok=False, errs={},
                note=note)


def run_groups(names: list[str], jobs: int, out: str, budget: float, env: dict) -> None:
    """Run the groups as subprocesses, `jobs` at a time; each writes its rows to `out` as it finishes them (its
    console output goes to `out`.logs/GROUP.log, not a pipe that could fill). A group still running when
    `budget` seconds have passed is stopped and recorded as not finished."""
    logs = out + ".logs"
    os.makedirs(logs, exist_ok=True)
    deadline = time.time() + budget
    procs, pending = {}, list(names)
    while pending or procs:
        while pending and len(procs) < jobs:
            n = pending.pop(0)
            log = open(os.path.join(logs, f"{n}.log"), "w")
            procs[n] = (subprocess.Popen([sys.executable, __file__, "--group", n, "--out", out], stdout=log,
                                         stderr=subprocess.STDOUT, env=env), log, time.time())
        for n, (p, log, t0) in list(procs.items()):
            late = time.time() > deadline
            if p.poll() is None and not late:
                continue
            if p.poll() is None:
                p.kill()
                p.wait()
                append_rows(out, [group_failed(n, f"not finished within the {budget:.0f} s budget")])
            elif p.returncode != 0:
                log.flush()
                tail = open(log.name).read()[-600:]
                append_rows(out, [group_failed(n, f"exit {p.returncode}: {tail}")])
            log.close()
            print(f"[group {n} done rc={p.returncode} in {time.time() - t0:.0f} s]", flush=True)
            del procs[n]
        if time.time() > deadline:
            for n in pending:
                append_rows(out, [group_failed(n, f"not started within the {budget:.0f} s budget")])
            pending = []
        time.sleep(0.5)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=8)
    ap.add_argument("--group", default=None, help="run one group in-process (used by the parent)")
    ap.add_argument("--only", default=None, help="comma-separated groups")
    ap.add_argument("--out", default="gpu_check.jsonl",
                    help="results, one JSON line per case, written as each case finishes (first line: seed, device)")
    ap.add_argument("--budget", type=float, default=540.0,
                    help="seconds; groups still running then are stopped and reported as not finished")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device; nothing to check")
        return 0
    seed = int(os.environ.get("CHECK_SEED", time.time_ns() % 2**31))
    if a.group:
        torch.manual_seed(seed + zlib.crc32(a.group.encode()) % 1000)  # hash() of a str differs per process
        run_group(a.group, a.out)
        return 0
    print(f"seed {seed}  device {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    names = a.only.split(",") if a.only else list(GROUPS)
    unknown = sorted(set(names) - set(GROUPS))
    if unknown:
        sys.exit(f"unknown group(s) {unknown}; groups: {', '.join(GROUPS)}")
    with open(a.out, "w") as f:
        f.write(json.dumps(dict(seed=seed, device=torch.cuda.get_device_name(), torch=torch.__version__)) + "\n")
    t0 = time.time()
    run_groups(names, a.jobs, a.out, a.budget, dict(os.environ, CHECK_SEED=str(seed)))
    rows = [json.loads(line) for line in open(a.out).read().splitlines()[1:]]
    print(f"\n{'case':22s} {'dtype':9s} {'layout':7s} {'worst rel':>10s}  result  detail")
    for r in rows:
        detail = r.get("note") or " ".join(f"{k}={v:.1e}" for k, v in r["errs"].items())
        print(f"{r['case']:22s} {r['dtype']:9s} {r['layout']:7s} {r['worst']:10.2e}  {'PASS' if r['ok'] else 'FAIL'}    {detail}")
    bad = [r for r in rows if not r["ok"]]
    print(f"\n{len(rows) - len(bad)}/{len(rows)} passed in {time.time() - t0:.0f} s (seed {seed}); rows in {a.out}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
