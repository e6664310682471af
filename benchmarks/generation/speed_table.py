"""The speed table (issue 24, item 5): context x batch x {prefill tok/s, decode ms/step, peak memory} for a
Transformer ("teacher") and its hybrid at the real models' shapes (random weights: speed does not depend on
them), every path in one process:

- teacher: HF generate warmed by `--hf-warmup` untimed calls, HF generate with the static cache (its compiled
  decode step), and our fast engine (`hybridize.generation.fast`, CUDA graphs) uncompiled (`compile="off"`)
  and compiled (`compile="on"`); the default, `compile="auto"`, runs the first for a job's first
  `compile_after_s` seconds of decode and the second after (benchmarks/generation/compile_auto.py);
- hybrid (`--plan`, `--mixer`): our fast engine uncompiled, and with `compile="on"`.

    python -m benchmarks.generation.speed_table --out $OUT/speed.jsonl                 # measure (resumable)
    python -m benchmarks.generation.speed_table --out $OUT/speed.jsonl --report        # table + plot only
    python -m benchmarks.generation.speed_table --out $OUT/speed.jsonl --code abc1234 --remeasure-engine
        # after a change to our code: every engine row again (HF's kept), resumable across calls
    python -m benchmarks.generation.speed_table --out /root/speed.jsonl --gpus 8       # one worker per GPU
        # (fast, but four workers on one host timed each path 0-19% slower than one process: shards.py)
    python -m benchmarks.generation.speed_table --shapes tiny --lens 64,128 --batches 1,2 --new-tokens 8 \\
        --dtype float32 --out /tmp/speed.jsonl                                           # CPU smoke run

Each path of a cell (shape, context, batch, model) is appended to the JSONL file as it finishes, with the device
and versions; a rerun skips the paths already there, so the grid can be filled over several device calls
(`--budget` seconds: no path starts after it, but one started runs to its end: a batch-32 path at 32k takes minutes,
so leave a margin below a call's limit; on the device machine keep the file outside `$OUT`, e.g.
`--out /root/speed.jsonl`, and copy it and its .md/.png into `$OUT` after each call). A path that runs out of GPU memory is recorded as OOM (HF's two paths
together: they run as one group); a rerun with another `--prefill-tokens` retries it. A path that raises anything else
is recorded as failed, with its error (the report lists it), and the worker goes on; a rerun measures it again. The
report (`<out>.md`, `<out>.png`) puts the paths side by side: prefill tokens/s (B x T / time to the first
token), the median decode step in ms, the peak allocated memory, the decode step over its bytes floor (item 3:
weights + states + softmax-layer keys/values read once per step, at `--hbm-gbs`), the warm-up of every path,
and the hybrid's decode speed-up over the teacher on our own engine (best against best: the faster of
uncompiled and compiled on each side) and over HF's static compiled decode.
"""
from __future__ import annotations

import argparse
import json
from collections import Counter
import platform
import sys
from pathlib import Path

import torch

from benchmarks.generation.rollouts import SHAPES, Budget, bench_model, build_pair
from benchmarks.generation.shards import merge_shards, parse_shard, run_workers, shard_path, shard_todo
from benchmarks.timing import free_memory, md_header
from hybridize.errors import read_jsonl
from hybridize.eval.speed import cache_bytes
from hybridize.generation.fast import rows_per_prefill
from hybridize.ops.common.options import current_kernel_options

TEACHER_PATHS = {"HF generate": "HF warmed", "HF generate (static cache, compiled)": "HF static compiled"}


def args_parser():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="qwen3-1.7b,smollm2-135m", help=f"model shapes: {', '.join(SHAPES)}")
    ap.add_argument("--lens", default="1024,2048,4096,8192,16384,32768", help="prompt lengths (context)")
    ap.add_argument("--batches", default="8,1,32", help="batch sizes, filled in this order (see --budget)")
    ap.add_argument("--new-tokens", type=int, default=32, help="decode steps per timed call")
    ap.add_argument("--plan", default="5:1")
    ap.add_argument("--mixer", default="sse")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--prefill-tokens", type=int, default=0,
                    help="our engine's FastGenConfig.prefill_tokens, teacher and hybrid alike (prefill a few rows at a "
                         "time: fits large batches of long prompts); 0 = one forward, as HF")
    ap.add_argument("--hf-warmup", type=int, default=4, help="untimed HF generate calls before the timed one")
    ap.add_argument("--remeasure-unsynced", action="store_true",
                    help="measure again the engine rows taken before the engine synced the device at the end of its "
                         "prefill (no `prefill_synced`); the report keeps a cell's last row")
    ap.add_argument("--code", default="", help="a label of the code measured (e.g. its commit), kept in each row as "
                                               "`code`; the report lists the labels of its engine rows")
    ap.add_argument("--remeasure-engine", action="store_true",
                    help="measure again every engine row (teacher and hybrid, both compile settings) whose `code` is "
                         "not --code, in this process beside each other: after a change to the engine or the mixers. "
                         "HF's rows are kept (they run none of our code); needs --code")
    ap.add_argument("--budget", type=float, default=540.0, help="seconds; no path starts after it (one started runs to its end)")
    ap.add_argument("--hbm-gbs", type=float, default=0.0,
                    help="memory bandwidth in GB/s for the bytes floor; 0 = the data sheet figure of the GPU by its "
                         f"name ({', '.join(f'{k} {v:.0f}' for k, v in HBM_GBS.items())}), kept in each row (a CPU smoke run: 100)")
    ap.add_argument("--gpus", type=int, default=0,
                    help="fill the table with one worker process per GPU of this host, each taking every N-th cell "
                         "(benchmarks/generation/shards.py); 0 = this process alone")
    ap.add_argument("--shard", default="", help="I/N: be worker I of N (set by --gpus; rows go to <out>.shard<I>.jsonl)")
    ap.add_argument("--out", default="speed_table.jsonl")
    ap.add_argument("--report", action="store_true", help="only write the table and plot from --out")
    return ap


#: HBM bandwidth in GB/s by a word of the GPU's name (SXM data sheets), for the bytes floor
HBM_GBS = {"H100": 3350.0, "H200": 4800.0}


def hbm_gbs(device_name: str, given: float = 0.0) -> float:
    """`given` if set, else the data sheet bandwidth of the named GPU; one clear error for a GPU not listed."""
    if given > 0:
        return given
    for word, gbs in HBM_GBS.items():
        if word in device_name:
            return gbs
    raise SystemExit(f"no memory bandwidth known for {device_name!r}: pass --hbm-gbs (GB/s) for its bytes floor")


HF_PATHS = tuple(TEACHER_PATHS.values())
ENGINE_PATHS = {"off": "engine", "on": "engine compiled"}


def row_paths(r: dict) -> list[str]:
    """The table paths a row stands for: its own, for an OOM row the paths that ran out of memory, and none for a
    failed row (`failed`: its cell stays as it was, and a rerun measures it again)."""
    if r["table_path"] == "failed":
        return []
    return r.get("oom_paths", []) if r["table_path"] == "OOM" else [r["table_path"]]


def unsynced(r: dict) -> bool:
    """An engine row measured before the engine synced the device at the end of its prefill (no `prefill_synced`
    field): the prefill's last queued kernels ran, and were timed, in the decode."""
    return r["table_path"] in ENGINE_PATHS.values() and not r.get("prefill_synced")


def split_invalid(r: dict) -> bool:
    """An unsynced row prefilled in several row groups: the last group's whole forward was timed in the decode,
    so its decode ms and prefill rate are not measurements of either (its rollout total still is)."""
    B = r["batch"]
    return unsynced(r) and rows_per_prefill(B, r["prompt_len"], r.get("prefill_tokens", 0)) < B


def done_paths(path: Path, prefill_tokens: int = 0, remeasure_unsynced: bool = False,
               remeasure_engine: str | None = None) -> set[tuple]:
    """(shape, T, B, model, table path) of every row already measured, an OOM row counting only when it was
    recorded with the same `prefill_tokens` (a rerun with row-group prefill retries the others) and a row whose
    prefill/decode split is invalid (`split_invalid`) not counting, nor, with `remeasure_unsynced`, any
    `unsynced` engine row, nor, with `remeasure_engine` (a code label), any engine row of other code."""
    stale = unsynced if remeasure_unsynced else split_invalid

    def counts(r: dict) -> bool:
        if r["table_path"] == "OOM":
            if r.get("prefill_tokens", 0) != prefill_tokens:
                return False
            engine = set(r.get("oom_paths", [])) <= set(ENGINE_PATHS.values())
        else:
            engine = r["table_path"] in ENGINE_PATHS.values()
        if remeasure_engine is not None and engine and r.get("code") != remeasure_engine:
            return False
        return not stale(r)

    return {(r["shape"], r["prompt_len"], r["batch"], r["model"], p) for r in read_jsonl(path, partial=True)
            if counts(r) for p in row_paths(r)}


def path_groups(model: str) -> list[tuple[tuple[str, ...], dict]]:
    """The paths of one model's cell, as `bench_model` runs them: HF generate's two (one call, the teacher only),
    then our engine once per compile setting."""
    groups = [(HF_PATHS, dict(hf=True, compiles=()))] if model == "teacher" else []
    return groups + [((name,), dict(hf=False, compiles=(c,))) for c, name in ENGINE_PATHS.items()]


@torch.no_grad()
def step_bytes(model, device) -> dict:
    """What one decode step must read at least, as a function of context T and batch B:
    weights (every distinct parameter once) + B x (per-sequence state + T x per-token cache), the cache measured
    on two short prefills (a softmax layer's keys/values grow with T; a mixer's state does not)."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())   # tied weights come once
    sizes = []
    for T in (16, 32):
        ids = torch.randint(10, 100, (1, T), device=device)
        sizes.append(cache_bytes(model(input_ids=ids, use_cache=True).past_key_values))
    per_token = (sizes[1] - sizes[0]) / 16
    return {"weights": weights, "per_token": per_token, "per_sequence": sizes[0] - 16 * per_token}


def floor_ms(b: dict, T: int, B: int, gbs: float) -> float:
    return 1e3 * (b["weights"] + B * (b["per_sequence"] + T * b["per_token"])) / (gbs * 1e9)


def failed_row(model: str, paths, e: BaseException) -> dict:
    """The row of a path group that raised (not out of memory): which paths, and the error in one line."""
    first = (str(e).strip().splitlines() or [""])[0]
    return {"model": model, "path": "failed", "failed_paths": list(paths),
            "error": f"{type(e).__name__}: {first}"[:200]}


def path_name(model: str, row: dict) -> str:
    """The table's name for a row's path: HF warmed / HF static compiled / engine / engine compiled."""
    if row["path"] in TEACHER_PATHS:
        return TEACHER_PATHS[row["path"]]
    if row["path"] in ("OOM", "failed"):
        return row["path"]
    return "engine compiled" if row.get("compile") == "on" else "engine"


def measure(a) -> None:
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, a.dtype)
    env = {"device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
           "torch": torch.__version__, "dtype": a.dtype,
           "kernel_options": current_kernel_options().to_dict()}   # pdl and the other switches in force
    gbs = hbm_gbs(env["device"], a.hbm_gbs) if device.type == "cuda" else (a.hbm_gbs or 100.0)
    env["hbm_gbs"] = gbs
    if a.remeasure_engine and not a.code:
        raise SystemExit("--remeasure-engine needs --code LABEL (the rows of this code are kept across calls)")
    shard = parse_shard(a.shard)
    if shard is None:
        merge_shards(out)   # rows a cut-short --gpus call left behind
    rows_to = shard_path(out, shard[0]) if shard else out
    env["concurrent_workers"] = shard[1] if shard else 1
    done = set()
    for f in {out, rows_to}:
        done |= done_paths(f, a.prefill_tokens, a.remeasure_unsynced, a.code if a.remeasure_engine else None)
    budget = Budget(a.budget)
    shapes, lens = a.shapes.split(","), [int(t) for t in a.lens.split(",")]
    # batch-major: the first --batches entry fills both shapes at every context before the next batch starts,
    # so a call cut by --budget leaves whole rows of the table rather than one shape only
    todo = [(B, shape, T, m, paths, kw) for B in map(int, a.batches.split(",")) for shape in shapes for T in lens
            for m in ("teacher", "hybrid") for paths, kw in path_groups(m)
            if any((shape, T, B, m, p) not in done for p in paths)]
    if shard:
        todo = shard_todo(todo, *shard)
    built, models, floors = None, {}, {}   # one shape's teacher and hybrid at a time, and their bytes floors
    for B, shape, T, m, paths, kw in todo:
        if budget.left() <= 0:
            print(f"budget spent: {shape} T={T} B={B} {m} {'/'.join(paths)} and later paths not started", flush=True)
            break
        if shape != built:
            models.clear()
            free_memory(device)
            models = dict(zip(("teacher", "hybrid"), build_pair(shape, a.plan, a.mixer, dtype, device)))
            floors = {name: step_bytes(model, device) for name, model in models.items()}
            built = shape
        try:
            rows = bench_model(models[m], m, T, B, a.new_tokens, device, budget,
                               hf_warmup=a.hf_warmup, prefill_tokens=a.prefill_tokens, **kw)
        except torch.cuda.OutOfMemoryError as e:
            rows = [{"model": m, "path": "OOM", "oom_paths": list(paths), "error": str(e)[:160]}]
        except Exception as e:   # one path's crash (e.g. torch's CUDA-graph trees in HF's compiled generate) must not
            # end the worker: record it, drop compiled state, go on with the next cell; a rerun measures it again
            rows = [failed_row(m, paths, e)]
            print(f"failed: {shape} T={T} B={B} {m} {'/'.join(paths)}: {rows[0]['error']}; going on with the next cell",
                  file=sys.stderr, flush=True)
            torch._dynamo.reset()
        free_memory(device)
        with rows_to.open("a") as f:
            for r in rows:
                r.update(shape=shape, prompt_len=T, batch=B, new_tokens=a.new_tokens, plan=a.plan,
                         mixer=a.mixer, table_path=path_name(m, r), prefill_tokens=a.prefill_tokens, code=a.code,
                         **env)
                r["prefill_tok_s"] = B * T / r["prefill_s"] if r.get("prefill_s") else None
                r["floor_ms"] = floor_ms(floors[m], T, B, gbs)
                r["step_bytes"] = floors[m]
                r["of_floor"] = r["decode_ms"] / r["floor_ms"] if r.get("decode_ms") else None
                f.write(json.dumps(r) + "\n")
                print(json.dumps(r), flush=True)
    models.clear()
    free_memory(device)


# ---- report ------------------------------------------------------------------------------------------------

COLUMNS = [("teacher", "HF warmed"), ("teacher", "HF static compiled"), ("teacher", "engine"),
           ("teacher", "engine compiled"), ("hybrid", "engine"), ("hybrid", "engine compiled")]


def cell_rows(rows: list[dict]) -> dict[tuple, dict[tuple, dict]]:
    """(shape, T, B) -> {(model, path): row}; the last row of a (cell, path) wins (a rerun's); an OOM row stands
    for each path it names."""
    cells: dict[tuple, dict[tuple, dict]] = {}
    for r in rows:
        for p in row_paths(r):
            cells.setdefault((r["shape"], r["prompt_len"], r["batch"]), {})[(r["model"], p)] = r
    return cells


def best_engine(paths: dict, model: str):
    """The faster of a model's two engine paths (default, compiled), in ms per decode step; None while either path
    is unmeasured or its decode time invalid (a ratio against one path alone would not be best against best)."""
    if any((model, p) not in paths or split_invalid(paths[(model, p)]) for p in ENGINE_PATHS.values()):
        return None
    return min((paths[(model, p)]["decode_ms"] for p in ENGINE_PATHS.values()
                if paths.get((model, p), {}).get("decode_ms")), default=None)


def best_engine_prefill(paths: dict, model: str):
    """The higher of a model's two engine prefill rates (each engine row times one prefill of the same forward:
    best of two, as the decode columns take the faster path); None while either path is unmeasured or invalid."""
    if any((model, p) not in paths or split_invalid(paths[(model, p)]) for p in ENGINE_PATHS.values()):
        return None
    return max((paths[(model, p)]["prefill_tok_s"] for p in ENGINE_PATHS.values()
                if paths.get((model, p), {}).get("prefill_tok_s")), default=None)


SPLIT_METRICS = ("prefill_tok_s", "decode_ms", "of_floor")   # what the prefill/decode split decides


def cell(r: dict | None, metric: str, spec: str) -> str:
    """One table cell: OOM, '-' (unmeasured), the value, or the value marked * where `split_invalid`."""
    if r is None:
        return "-"
    if r["table_path"] == "OOM":
        return "OOM"
    v = fmt(r.get(metric), spec)
    return f"{v} *" if metric in SPLIT_METRICS and v != "-" and split_invalid(r) else v


def fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def ratio(baseline, hybrid) -> str:
    return f"{baseline / hybrid:.2f}x" if baseline and hybrid else "-"


def _code_note(cells: dict) -> str:
    """The code labels (`--code`) of the engine rows the table shows, with how many of them carry each."""
    labels = Counter(r.get("code") or "unlabelled" for paths in cells.values()
                     for (_, path), r in paths.items() if path in ENGINE_PATHS.values())
    if set(labels) <= {"unlabelled"}:
        return ""
    return " Engine rows by code (`--code`): " + ", ".join(f"{k} {v}" for k, v in sorted(labels.items())) + "."


def engine_codes(paths: dict) -> str:
    """The code labels (`--code`) of a cell's engine rows, both models, e.g. "8db8097" or "37f81b6, da3d309"
    for a cell measured at two commits: a table of rows from several calls says which code each cell timed."""
    return ", ".join(sorted({r.get("code") or "unlabelled" for (_, p), r in paths.items()
                             if p in ENGINE_PATHS.values()})) or "-"


def _workers_note(cells: dict) -> str:
    """How many of the shown rows ran beside other workers (`--gpus`): a GPU each, the host shared."""
    shown = [r for paths in cells.values() for r in paths.values() if r["table_path"] != "OOM"]
    beside = Counter(r["concurrent_workers"] for r in shown if r.get("concurrent_workers", 1) > 1)
    if not beside:
        return ""
    return (" Rows measured beside other workers, a GPU each on one host (`--gpus`; each path can be slower than "
            "alone: 0-19% on 4 x H100, benchmarks/generation/shards.py): " + ", ".join(f"{v} with {k} workers" for k, v in sorted(beside.items())) + ".")


def _failed_note(rows: list[dict], cells: dict) -> str:
    """The paths whose last attempt failed and that no later row measured: cell, paths and the error."""
    last = {}
    for r in rows:
        if r["table_path"] == "failed":
            for p in r.get("failed_paths", []):
                last[(r["shape"], r["prompt_len"], r["batch"], r["model"], p)] = r["error"]
    left = {k: err for k, err in last.items() if (k[3], k[4]) not in cells.get(k[:3], {})}
    if not left:
        return ""
    return " Failed, not measured: " + "; ".join(f"{sh} {T} x {B} {m} {p} ({err})"
                                                  for (sh, T, B, m, p), err in sorted(left.items())) + "."


def markdown(rows: list[dict]) -> str:
    cells = cell_rows(rows)
    shown = [r for paths in cells.values() for r in paths.values()]   # a rerun's row hides the one it replaced
    labelled = any(r.get("code") for r in shown)   # a code column once any shown row carries a --code label
    head = rows[0]
    lines = [f"Device {head['device']}, torch {head['torch']}, {head['dtype']}, {head['new_tokens']} decode steps "
             f"timed per call, hybrid plan {head['plan']} {head['mixer']}; random weights. 'OOM': out of GPU memory."
             + "".join(f" Rows measured with `--prefill-tokens {n}`: our engine prefilled at most {n} tokens per "
                       f"forward (both models; the JSONL's `prefill_tokens`)." for n in sorted(
                           {r.get("prefill_tokens", 0) for r in shown if r["table_path"] != "OOM"} - {0}))
             + (" Engine rows measured before the engine synced the device at the end of its prefill (no "
                "`prefill_synced` in the JSONL) count the prefill's last copies into the static buffers in the "
                "decode: up to a few percent more per step, the teacher (whole KV cache) more than the hybrid."
                if any(unsynced(r) for r in shown) else "")
             + (" Cells marked * were prefilled in several row groups before that fix: the last group's forward "
                "ran in the decode, so their prefill rate and decode time are not valid (no ratio is taken from them)."
                if any(split_invalid(r) for r in shown) else "")
             + _code_note(cells) + _workers_note(cells) + _failed_note(rows, cells),
             ""]
    for metric, title, spec in (("prefill_tok_s", "prefill tokens/s", ",.0f"), ("decode_ms", "decode ms per step", ".2f"),
                                ("peak_gib", "peak memory GiB", ".1f"),
                                ("of_floor", "decode step / bytes floor (weights + states + softmax KV read once "
                                             "per step, at the row's `hbm_gbs`: the GPU's data sheet bandwidth)", ".2f"),
                                ("warmup_s", "warm-up seconds (HF: the untimed calls; engine: the first call at the shape, "
                                             "graph capture and compilation included)", ".1f")):
        heads = ["shape", "context", "batch", *(f"{m}: {p}" for m, p in COLUMNS)]
        if metric == "decode_ms":
            heads += ["hybrid vs teacher (engine, best of each)", "hybrid (best) vs HF static"]
        if metric == "prefill_tok_s":
            heads += ["hybrid vs teacher (engine, best of each's two prefills)"]
        code_column = labelled and metric in ("prefill_tok_s", "decode_ms")
        if code_column:
            heads += ["engine rows' code"]
        lines += [f"**{title}**", "", md_header(heads)]
        for (shape, T, B), paths in sorted(cells.items()):
            vals = [cell(paths.get((m, p)), metric, spec) for m, p in COLUMNS]
            line = f"| {shape} | {T} | {B} | " + " | ".join(vals) + " |"
            if metric == "decode_ms":
                h, t_eng = best_engine(paths, "hybrid"), best_engine(paths, "teacher")
                t_hf = paths.get(("teacher", "HF static compiled"), {}).get("decode_ms")
                line += f" {ratio(t_eng, h)} | {ratio(t_hf, h)} |"
            if metric == "prefill_tok_s":
                line += f" {ratio(best_engine_prefill(paths, 'hybrid'), best_engine_prefill(paths, 'teacher'))} |"
            if code_column:
                line += f" {engine_codes(paths)} |"
            lines.append(line)
        lines.append("")
    return "\n".join(lines)


def plot(rows: list[dict], png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = cell_rows(rows)
    shapes = sorted({s for s, _, _ in cells})
    batches = sorted({b for _, _, b in cells})
    metrics = (("prefill_tok_s", "prefill tokens/s"), ("decode_ms", "decode ms / step"), ("peak_gib", "peak GiB"))
    fig, axes = plt.subplots(len(shapes), len(metrics) + 1, figsize=(5 * (len(metrics) + 1), 3.8 * len(shapes)),
                             squeeze=False)
    styles = ["-", "--", ":", "-."]
    for i, shape in enumerate(shapes):
        for j, (metric, title) in enumerate(metrics):
            ax = axes[i][j]
            for c, (m, p) in enumerate(COLUMNS):
                for k, B in enumerate(batches):
                    pts = sorted((T, paths[(m, p)][metric]) for (s, T, b), paths in cells.items()
                                 if s == shape and b == B and (m, p) in paths and paths[(m, p)].get(metric)
                                 and not (metric in SPLIT_METRICS and split_invalid(paths[(m, p)])))
                    if pts:
                        ax.plot(*zip(*pts), styles[k % 4], marker=".", color=f"C{c}",
                                label=f"{m}: {p}" if k == 0 else None)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("context (tokens)")
            ax.set_title(f"{shape}: {title}")
            if metric in ("prefill_tok_s", "decode_ms"):   # HF's dynamic cache decodes 10-30x slower than the rest
                ax.set_yscale("log")
        speedup_panel(axes[i][-1], shape, cells, batches)
    axes[0][0].legend(fontsize=7, title="line style: batch " + ", ".join(map(str, batches)), title_fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def speedups(cells: dict, shape: str, B: int) -> dict[str, list[tuple[int, float]]]:
    """The hybrid over its teacher on our engine at each context of (shape, batch), best path against best path:
    {"decode": [(T, teacher ms / hybrid ms)], "prefill": [(T, hybrid tok/s / teacher tok/s)]}; cells without a
    ratio (a path unmeasured, out of memory or invalid) are left out."""
    out: dict[str, list[tuple[int, float]]] = {"decode": [], "prefill": []}
    for (s, T, b), paths in sorted(cells.items()):
        if s != shape or b != B:
            continue
        h, t = best_engine(paths, "hybrid"), best_engine(paths, "teacher")
        if h and t:
            out["decode"].append((T, t / h))
        h, t = best_engine_prefill(paths, "hybrid"), best_engine_prefill(paths, "teacher")
        if h and t:
            out["prefill"].append((T, h / t))
    return out


def speedup_panel(ax, shape: str, cells: dict, batches: list[int]) -> None:
    """What the table is for, at a glance: the hybrid's decode and prefill speed over its teacher's (same engine),
    one colour per batch, 1.0 marked."""
    for k, B in enumerate(batches):
        ratios = speedups(cells, shape, B)
        for what, style in (("decode", "-"), ("prefill", "--")):
            pts = ratios[what]
            if pts:
                ax.plot(*zip(*pts), style, marker=".", color=f"C{k}", label=f"{what}, batch {B}")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.set_title(f"{shape}: hybrid / teacher speed, our engine")
    ax.legend(fontsize=7)


def report(out: Path) -> None:
    rows = read_jsonl(out, partial=True)
    if not rows:
        raise SystemExit(f"{out}: no rows to report")
    md = markdown(rows)
    out.with_suffix(".md").write_text(md)
    plot(rows, out.with_suffix(".png"))
    print(md)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    a = args_parser().parse_args(argv)
    if a.gpus < 0 or (a.gpus and a.shard):
        raise SystemExit("--gpus takes the number of workers (0: this process alone) and is not given with --shard")
    if a.gpus and torch.cuda.is_available() and a.gpus > torch.cuda.device_count():
        raise SystemExit(f"--gpus {a.gpus}: this host has {torch.cuda.device_count()} GPUs")
    if a.gpus and not a.report:
        run_workers(argv, a.gpus, Path(a.out))
    elif not a.report:
        measure(a)
    if not a.shard:
        report(Path(a.out))


if __name__ == "__main__":
    main()
