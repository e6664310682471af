"""Where the time of one fast-path decode step goes: kernels (ops) per step per layer type, top ops.

`profile_model(model, args, device)` prefills a batch (one left-padded row), runs the model through
`hybridize.generation.fast.FastGenerator` and profiles N decode steps with `torch.profiler`. Only the decode
loop is profiled (`FastGenerator._decode` is wrapped for the profiled call), never the prefill.

Two profiles:
- "graphs" (CUDA only, what rollouts time): the decode steps replay the captured CUDA graph; reported:
  kernels (+ memcpy/memset) per step and device time per step, top kernels, and the timeline (`timeline`:
  the device's idle time per step and the kernels that started after it). Graph replays cannot be
  attributed to layers (one launch), so
- "eager" (CPU and CUDA): the same steps run eagerly in the graph's static mode (mixer states copied back
  into the held tensors, decode attention = the graph's), each layer's attention slot inside a profiler
  scope; per decode step: kernels per layer type (SSE / other mixer layer, softmax layer, MLP + norms +
  embedding + head + sampling = "other"), the SSE layer split into its pieces (features, routing, the
  recurrent state step, output, state write-back), top ops by count and by time.

"kernels": on CUDA the device kernels, memcpys and memsets; on CPU (no device) the outermost aten ops that
do work - an op that is not a view / allocation / cast wrapper (`NO_KERNEL`) with no such op above it - the
proxy for what launches a kernel on the GPU (`linear` = one GEMM; ops that launch several kernels on CUDA,
e.g. `repeat_interleave` or `topk`, count once). On CPU the SSE recurrent step by default takes its GPU path
(`SSE.fused_step`, or `ops.sse.reference._recurrent_loop_triton` where the one-kernel step does not apply) with
PyTorch stand-ins for the Triton kernels (`emulated_decode_kernel`), counted as one kernel per call
(`decode_kernel="torch"`: the CPU reference path, gather + recurrent op + scatter); so does the window layer's
decode token (`ops/attn_decode/triton_window_step.py`, two launches on the GPU, one op here). Host syncs
(`aten::_local_scalar_dense`, `aten::item`) inside a step are listed. The decode step's op budget test
(`test_decode_ops.py`) counts with it.

The command line (random-weight models at real shapes): `python -m benchmarks.generation.profile_decode`.
"""
from __future__ import annotations

import sys
import time
from collections import Counter, defaultdict
from contextlib import contextmanager, nullcontext

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from hybridize.generation import fast as fg
from hybridize.generation.fast import FastGenConfig, FastGenerator, _is_mixer_layer
import hybridize.mixers.sse as sse_mod
from hybridize.ops.attn_decode import window_step as window_ops
from hybridize.ops.common.options import current_kernel_options
from hybridize.ops.sse import reference as ks
from hybridize.ops.sse.fused_step import sse_gla_step_reference

#: leaf aten ops that launch no kernel (views, metadata, allocation)
NO_KERNEL = {
    "aten::view", "aten::_unsafe_view", "aten::reshape", "aten::_reshape_alias", "aten::view_as", "aten::t",
    "aten::transpose", "aten::permute", "aten::expand", "aten::expand_as", "aten::unsqueeze", "aten::squeeze",
    "aten::slice", "aten::select", "aten::as_strided", "aten::alias", "aten::detach", "aten::split",
    "aten::chunk", "aten::unbind", "aten::narrow", "aten::empty", "aten::empty_like", "aten::empty_strided",
    "aten::resize_", "aten::lift_fresh", "aten::unflatten", "aten::flatten", "aten::contiguous",
    "aten::numpy_T", "aten::broadcast_to", "aten::result_type", "aten::is_nonzero", "aten::to",
    "aten::_to_copy", "aten::clone", "aten::type_as", "aten::movedim", "aten::set_", "aten::split_with_sizes",
    "aten::_has_compatible_shallow_copy_type", "aten::dim", "aten::size", "aten::stride", "aten::is_same_size",
    "aten::resolve_conj", "aten::resolve_neg", "aten::conj", "aten::_conj", "aten::promote_types",
    "aten::can_cast", "aten::is_floating_point", "aten::_local_scalar_dense", "aten::item",
}
SYNC_OPS = ("aten::_local_scalar_dense", "aten::item")
#: SSE methods / functions shown as pieces of an SSE layer's step (sub-scopes)
SSE_PIECES = ("features", "fused_inputs", "fused_step", "finish")
SSE_FUNCS = ("route", "naive_recurrent_sse")
SCOPE = "pd::"   # prefix of this script's profiler scopes


# ---------------------------------------------------------------------------------------------
# scopes: hooks on the attention slots, wrappers on the SSE pieces
# ---------------------------------------------------------------------------------------------
def layer_kind(layer) -> str:
    if _is_mixer_layer(layer):
        return getattr(layer.self_attn, "name", "mixer")
    return "softmax"


def _scoped(name: str, fn, span=record_function):
    def wrapped(*a, **kw):
        with span(SCOPE + name):
            return fn(*a, **kw)
    return wrapped


@contextmanager
def scopes(model, span=record_function):
    """Every decoder layer's attention (mixer or softmax) runs in scope `pd::<kind>`; SSE mixers' pieces in
    `pd::sse.<piece>`. `span(name)`: the context manager a scope runs in (a profiler range by default; a pair of CUDA
    events in `benchmarks/generation/profile_prefill.py`). Removed on exit."""
    handles, saved_funcs, saved_attrs = [], {}, []
    for layer in model.model.layers:
        mod = layer.self_attn
        name = SCOPE + layer_kind(layer)
        stack: list = []

        def pre(m, args, kwargs, name=name, stack=stack):
            rf = span(name)
            rf.__enter__()
            stack.append(rf)

        def post(m, args, kwargs, out, stack=stack):
            stack.pop().__exit__(None, None, None)

        handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(mod.register_forward_hook(post, with_kwargs=True))
        if isinstance(mod, sse_mod.SSE):
            for piece in (pc for pc in SSE_PIECES if hasattr(mod, pc)):
                setattr(mod, piece, _scoped(f"sse.{piece}", getattr(mod, piece), span))
                saved_attrs.append((mod, piece))
    for fn in SSE_FUNCS:
        saved_funcs[fn] = getattr(sse_mod, fn)
        setattr(sse_mod, fn, _scoped(f"sse.{fn}", saved_funcs[fn], span))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for mod, piece in saved_attrs:
            delattr(mod, piece)
        for fn, f in saved_funcs.items():
            setattr(sse_mod, fn, f)


@contextmanager
def profiled_decode(prof_kwargs: dict, static: bool, holder: dict):
    """Within the block, the next `FastGenerator._decode` runs under `torch.profiler` (prefill excluded);
    with `static`, the mixer cache layers copy states into held tensors as under CUDA graphs, and the state
    write-back runs in scope `pd::sse.state_update` (or `pd::<kind>.state_update`)."""
    saved = vars(fg.FastGenerator)["_decode"]   # the staticmethod object, restored as is
    orig = saved.__func__

    def _decode(sess, *args, **kwargs):
        if static:
            sess.cache.set_static(True)
        undo = []
        for layer, cl in zip(sess.model.model.layers, sess.cache.layers):
            if not isinstance(cl, fg.StaticKV):
                cl.update_state = _scoped(f"{layer_kind(layer)}.state_update", cl.update_state)
                undo.append(cl)
        try:
            with profile(**prof_kwargs) as prof:
                n = orig(sess, *args, **kwargs)
                if sess.device.type == "cuda":
                    torch.cuda.synchronize()
        finally:
            for cl in undo:
                del cl.update_state
        holder["prof"], holder["steps"] = prof, n - args[3]   # args[3] = n_done before the loop
        return n

    fg.FastGenerator._decode = staticmethod(_decode)
    try:
        yield
    finally:
        fg.FastGenerator._decode = saved


# ---------------------------------------------------------------------------------------------
# counting
# ---------------------------------------------------------------------------------------------
# ---------------------------------------------------------------------------------------------
# CPU stand-in for the Triton SSE decode kernel (what the GPU runs), counted as one kernel
# ---------------------------------------------------------------------------------------------
KERNEL = "kernel:"   # scope prefix: every op inside counts as one kernel named after the scope


def _emulated_sse_decode_step(state, index, q, k, v, g=None, beta=None, p=None, scale=None, wq=None, wk=None):
    """The contract of `hybridize/ops/sse/triton_decode.py` (update the selected partitions of `state`
    in place, return per-slot outputs `[B, S, H, V]` fp32) in PyTorch ops, inside one `kernel:` scope."""
    with record_function(SCOPE + KERNEL + "sse_decode_step"):
        B, P, H, K, V = state.shape
        scale = K ** -0.5 if scale is None else scale
        o = torch.zeros(B, index.shape[1], H, V, dtype=torch.float32, device=q.device)
        rows = torch.arange(B, device=q.device)
        for s in range(index.shape[1]):
            at = lambda x: None if x is None else x[:, s if x.shape[1] > 1 else 0].float()  # noqa: E731
            idx = index[:, s]
            ok = idx >= 0
            st = state[rows, idx.clamp(min=0)]                                   # [B, H, K, V]
            qf, kf, vf = at(q), at(k), at(v)
            if wq is not None:
                qf = qf * wq[:, s, None, None].float()
            if wk is not None:
                kf = kf * wk[:, s, None, None].float()
            if g is not None:
                gf = at(g).exp()
                st = st * (gf[..., None, None] if gf.dim() == 2 else gf[..., None])
            if beta is not None:
                pf = kf if p is None else at(p)
                u = vf - torch.einsum("bhkv,bhk->bhv", st, pf)
                st = st + (at(beta)[..., None] * kf)[..., None] * u[..., None, :]
            else:
                st = st + kf[..., None] * vf[..., None, :]
            state[rows[ok], idx[ok]] = st[ok]
            o[:, s] = torch.einsum("bhkv,bhk->bhv", st, qf) * scale * ok[:, None, None]
        return o


def _one_kernel(name: str, reference):
    """A Triton step's PyTorch reference (`sse_gla_step_reference`, `window_step_reference`) in one `kernel:` scope
    named `name`, standing in for the kernel."""
    def emulated(*args, **kwargs):
        with record_function(SCOPE + KERNEL + name):
            return reference(*args, **kwargs)
    return emulated


@contextmanager
def emulated_decode_kernel():
    """On CPU: the SSE decode step takes its GPU paths with stand-in kernels: the one-kernel step (`SSE.fused_step`,
    when option `sse_fused_step` is on and the mixer qualifies) or the separate path (`_recurrent_loop_triton`); the
    window layer's decode token its Triton step (option `window_step`)."""
    import types

    names = {"hybridize.ops.sse.triton_decode": {"sse_decode_step": _emulated_sse_decode_step},
             "hybridize.ops.sse.triton_fused_step": {
                 "sse_gla_step": _one_kernel("sse_gla_step", sse_gla_step_reference)},
             "hybridize.ops.attn_decode.triton_window_step": {
                 "window_step": _one_kernel("window_step", window_ops.window_step_reference)}}
    saved_mods = {name: sys.modules.get(name) for name in names}
    saved_ok, saved_applies = ks._decode_kernel_ok, ks.fused_step_applies
    saved_window = window_ops.window_step_applies
    for name, attrs in names.items():
        stub = types.ModuleType(name)
        for attr, fn in attrs.items():
            setattr(stub, attr, fn)
        sys.modules[name] = stub
    on_gpu_path = lambda x: not (x.dtype == torch.float64 or torch.is_grad_enabled())  # noqa: E731
    ks._decode_kernel_ok = lambda shared, sparse, routing, state: on_gpu_path(sparse.q)
    ks.fused_step_applies = lambda x: current_kernel_options().sse_fused_step and on_gpu_path(x)
    window_ops.window_step_applies = lambda x: current_kernel_options().window_step and on_gpu_path(x)
    try:
        yield
    finally:
        ks._decode_kernel_ok, ks.fused_step_applies = saved_ok, saved_applies
        window_ops.window_step_applies = saved_window
        for name, mod in saved_mods.items():
            if mod is None:
                del sys.modules[name]
            else:
                sys.modules[name] = mod


def _scope_path(evt) -> list[str]:
    """Names of this script's scopes enclosing `evt`, outermost first."""
    out = []
    p = evt
    while p is not None:
        if p.name.startswith(SCOPE):
            out.append(p.name[len(SCOPE):])
        p = p.cpu_parent
    return out[::-1]


def _counted(evt) -> bool:
    """An aten op counted as one kernel: not a view/allocation/cast wrapper (`NO_KERNEL`) and no counted op
    above it. So `aten::linear` counts once (on CUDA one GEMM), `aten::mean` once (not its CPU `sum` +
    `div_`), `aten::to` / `clone` as their `copy_`, a no-op `to` not at all."""
    if not evt.name.startswith("aten::") or evt.name in NO_KERNEL:
        return False
    p = evt.cpu_parent
    while p is not None:
        if p.name.startswith("aten::") and p.name not in NO_KERNEL:
            return False
        p = p.cpu_parent
    return True


def work_items(events, cuda: bool):
    """(name, scope path, time us) of every kernel-like item: on CUDA the device kernels (by the CPU op that
    launched them), on CPU the outermost aten ops that do work."""
    items = []
    for e in events:
        if e.device_type != DeviceType.CPU or e.is_async:
            continue
        if cuda:
            # a kernel listed by this op and by one of its children is the child's (counted there, once)
            inner = Counter((k.name, k.duration) for c in e.cpu_children for k in c.kernels)
            for k in e.kernels:
                if inner[(k.name, k.duration)] > 0:
                    inner[(k.name, k.duration)] -= 1
                elif not k.name.startswith(SCOPE):   # a scope's own GPU-side span (user annotation), not a kernel
                    items.append((k.name, _scope_path(e), k.duration))
            continue
        path = _scope_path(e)
        if e.name.startswith(SCOPE + KERNEL):        # an emulated kernel: one item
            items.append((e.name[len(SCOPE):], path[:-1], e.cpu_time_total))
        elif _counted(e) and not any(p.startswith(KERNEL) for p in path):
            items.append((e.name, path, e.cpu_time_total))
    return items


def host_syncs(events) -> Counter:
    return Counter(tuple(_scope_path(e)) for e in events if e.name in SYNC_OPS)


def _device_events(events):
    """Every device event (kernel, memcpy, memset), graph replays included; not the GPU-side spans of this module's
    scopes (user annotations), which cover kernels already counted."""
    return [e for e in events if e.device_type == DeviceType.CUDA and not e.name.startswith(SCOPE)]


def device_items(events):
    """(name, time us) of `_device_events`."""
    return [(e.name, e.device_time_total) for e in _device_events(events)]


def device_spans(events) -> list[tuple[str, float, float]]:
    """(name, start us, end us) of `_device_events`, in start order: the graph replays' timeline."""
    return sorted(((e.name, e.time_range.start, e.time_range.end) for e in _device_events(events)),
                  key=lambda s: s[1])


def timeline(spans: list[tuple[str, float, float]], steps: int, k: int) -> dict:
    """Where the device sat idle, per decode step, from kernels `(name, start, end)` in start order: the span from
    the first start to the last end; busy (the union of the kernels' intervals); idle (the span less busy: nothing
    ran, e.g. a launch that waited for the kernel before it to finish); overlap (kernel time run alongside an earlier
    kernel: PDL's early launches and its in-kernel waits, which a kernel's own time counts). Idle is charged to the
    kernel that ended it; `top_idle_before` lists the kernels that most often started after a gap."""
    if not spans:
        return {"span_us_per_step": 0.0, "busy_us_per_step": 0.0, "idle_us_per_step": 0.0,
                "overlap_us_per_step": 0.0, "top_idle_before": []}
    busy = overlap = 0.0
    idle = defaultdict(float)
    gaps = Counter()
    reach = spans[0][1]   # the latest end so far
    for name, start, end in spans:
        if start > reach:
            idle[name] += start - reach
            gaps[name] += 1
        overlap += max(0.0, min(end, reach) - start)
        busy += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    span = reach - spans[0][1]
    names = sorted(idle, key=lambda n: -idle[n])[:k]
    return {"span_us_per_step": span / steps, "busy_us_per_step": busy / steps,
            "idle_us_per_step": sum(idle.values()) / steps, "overlap_us_per_step": overlap / steps,
            "top_idle_before": [{"op": n[:90], "gaps_per_step": gaps[n] / steps, "idle_us_per_step": idle[n] / steps}
                                for n in names]}


def summarize_eager(items, steps: int, kinds: Counter) -> dict:
    """Per decode step: kernels and time per layer type (per layer and all layers), SSE pieces per layer."""
    per_kind = defaultdict(lambda: [0, 0.0])
    pieces = defaultdict(lambda: [0, 0.0])
    for name, path, t in items:
        kind = path[0] if path else "other"
        if kind not in kinds:   # e.g. a piece scope outside any layer (cannot happen) -> other
            kind = "other"
        per_kind[kind][0] += 1
        per_kind[kind][1] += t
        if len(path) > 1:
            pieces[path[1]][0] += 1
            pieces[path[1]][1] += t
        elif path and path[0] == "sse":
            pieces["sse.(rest)"][0] += 1
            pieces["sse.(rest)"][1] += t
    rows = []
    for kind in list(kinds) + ["other"]:
        if kind not in per_kind and kind != "other":
            continue
        n, t = per_kind.get(kind, [0, 0.0])
        layers = kinds.get(kind, 1)
        rows.append({"layer_type": kind, "layers": kinds.get(kind, "-"),
                     "kernels_per_layer": n / steps / layers, "kernels_per_step": n / steps,
                     "time_us_per_layer": t / steps / layers, "time_us_per_step": t / steps})
    n_sse = kinds.get("sse", 0)
    piece_rows = [{"piece": p, "kernels_per_layer": n / steps / n_sse, "time_us_per_layer": t / steps / n_sse}
                  for p, (n, t) in sorted(pieces.items()) if n_sse and p.startswith("sse.")]
    return {"by_layer_type": rows, "sse_pieces": piece_rows,
            "total_kernels_per_step": sum(v[0] for v in per_kind.values()) / steps}


def top_ops(items, steps: int, k: int, by: str) -> list[dict]:
    count, time_ = Counter(), defaultdict(float)
    for name, *rest in items:
        t = rest[-1]
        count[name] += 1
        time_[name] += t
    names = sorted(count, key=(lambda n: -count[n]) if by == "count" else (lambda n: -time_[n]))[:k]
    return [{"op": n[:90], "per_step": count[n] / steps, "time_us_per_step": time_[n] / steps} for n in names]


# ---------------------------------------------------------------------------------------------
# runs
# ---------------------------------------------------------------------------------------------
def batch(model, B: int, T: int, device):
    torch.manual_seed(1)
    vocab = model.config.vocab_size
    ids = torch.randint(10, vocab - 10, (B, T), device=device)
    mask = torch.ones_like(ids)
    mask[0, :T // 8] = 0   # one left-padded row, as in rollouts.py
    return ids, mask


def run_profile(model, ids, mask, steps: int, graphs: bool, attention: str, device, emulate: bool = False,
                compile_: str = "off", gemm: str = "auto"):
    """(profile, profiled steps, generator stats) for `steps` decode steps after a warm-up call."""
    cfg = FastGenConfig(fallback=False, attention=attention, compile=compile_, gemm=gemm,
                        **({} if graphs else {"cuda_graphs": "off", "exact_lengths": False}))
    gen = FastGenerator(model, cfg)
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    gen(input_ids=ids, attention_mask=mask, max_new_tokens=8, **kw)   # warm-up (+ graph capture), same bucket
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    holder: dict = {}
    with profiled_decode(dict(activities=acts), static=not graphs, holder=holder):
        if graphs:
            gen(input_ids=ids, attention_mask=mask, max_new_tokens=steps + 1, **kw)
        else:
            with scopes(model), (emulated_decode_kernel() if emulate else nullcontext()):
                gen(input_ids=ids, attention_mask=mask, max_new_tokens=steps + 1, **kw)
    stats = dict(gen.stats)
    # an unprofiled call for the wall time per step
    t0 = time.perf_counter()
    gen(input_ids=ids, attention_mask=mask, max_new_tokens=steps + 1, **kw)
    stats["wall_decode_ms_per_step"] = 1e3 * gen.stats["decode_s"] / max(1, gen.stats["steps"] - 1)
    stats["wall_call_s"] = time.perf_counter() - t0
    return holder["prof"], holder["steps"], stats


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.1f}" if abs(v) >= 10 else f"{v:.3g}"
    return str(v)


def table(rows: list[dict]) -> str:
    """A markdown table of dicts (the first row's keys are the columns)."""
    if not rows:
        return "(none)"
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def profile_model(model, args, device) -> dict:
    """Everything `report` prints, as a dict. `args`: batch, prompt_len, steps, attention, compile, gemm, top,
    graphs (CUDA: also profile the graph replays), decode_kernel ("emulate" | "torch", CPU only)."""
    cuda = device.type == "cuda"
    ids, mask = batch(model, args.batch, args.prompt_len, device)
    kinds = Counter(layer_kind(layer) for layer in model.model.layers)
    out: dict = {"layers": dict(kinds)}
    emulate = not cuda and args.decode_kernel == "emulate"
    prof, steps, stats = run_profile(model, ids, mask, args.steps, False, args.attention, device, emulate,
                                     args.compile, args.gemm)
    ev = prof.events()
    items = work_items(ev, cuda)
    unit = "device kernels" if cuda else "outermost aten ops that do work (CPU proxy for kernels)" + (
        "; SSE decode kernel and window step emulated as one op each (the GPU path; the window step is two launches "
        "there)" if emulate else "; SSE and window steps on their PyTorch paths")
    out["eager"] = {"unit": unit, "steps": steps, **summarize_eager(items, steps, kinds),
                    "top_by_count": top_ops(items, steps, args.top, "count"),
                    "top_by_time": top_ops(items, steps, args.top, "time"),
                    "host_syncs_per_step": {"/".join(k) or "(top)": v / steps for k, v in host_syncs(ev).items()},
                    "graphs": stats["graphs"], "attention": stats["attention"],
                    "wall_decode_ms_per_step": stats["wall_decode_ms_per_step"]}
    if cuda:   # kernels the profiler could not tie to a launching CPU op show as a gap here
        out["eager"]["all_device_events_per_step"] = len(device_items(ev)) / steps
    if cuda and args.graphs:
        prof, steps, stats = run_profile(model, ids, mask, args.steps, True, args.attention, device,
                                         compile_=args.compile, gemm=args.gemm)
        events = prof.events()
        dev = device_items(events)
        out["graphs"] = {"steps": steps, "graphs": stats["graphs"], "attention": stats["attention"],
                         "kernels_per_step": len(dev) / steps,
                         "device_us_per_step": sum(t for _, t in dev) / steps,
                         "wall_decode_ms_per_step": stats["wall_decode_ms_per_step"],
                         "top_by_count": top_ops(dev, steps, args.top, "count"),
                         "top_by_time": top_ops(dev, steps, args.top, "time"),
                         "timeline": timeline(device_spans(events), steps, args.top)}
    return out


def report(res: dict, header: str) -> str:
    e = res["eager"]
    lines = [header, "",
             f"## Eager decode steps in the graph's static mode ({e['steps']} steps; unit: {e['unit']})", "",
             f"graphs used: {e['graphs']}; decode attention: {e['attention']}; "
             f"wall {e['wall_decode_ms_per_step']:.3g} ms/step (eager, unprofiled); "
             f"total {e['total_kernels_per_step']:.1f} kernels/step" + (
                 f" (device events in the trace: {e['all_device_events_per_step']:.1f}/step)"
                 if "all_device_events_per_step" in e else ""), "",
             table(e["by_layer_type"]), "", "SSE layer, per layer and step:", "", table(e["sse_pieces"]), "",
             "Top ops by count:", "", table(e["top_by_count"]), "", "Top ops by time:", "", table(e["top_by_time"]),
             "", f"host syncs per step (by scope): {e['host_syncs_per_step'] or 'none'}"]
    g = res.get("graphs")
    if g:
        lines += ["", f"## CUDA graph replays ({g['steps']} steps)", "",
                  f"graphs used: {g['graphs']}; decode attention: {g['attention']}; "
                  f"{g['kernels_per_step']:.1f} device kernels/step, {g['device_us_per_step'] / 1e3:.3g} ms device "
                  f"time/step; wall {g['wall_decode_ms_per_step']:.3g} ms/step (unprofiled)", "",
                  "Top kernels by count:", "", table(g["top_by_count"]), "", "Top kernels by time:", "",
                  table(g["top_by_time"])]
        t = g.get("timeline")
        if t:
            lines += ["", f"Timeline per step: span {t['span_us_per_step']:.1f} us = busy {t['busy_us_per_step']:.1f} "
                          f"+ idle {t['idle_us_per_step']:.1f}; kernel time run alongside an earlier kernel "
                          f"{t['overlap_us_per_step']:.1f} us", "", "Kernels that started after the device sat idle:",
                      "", table(t["top_idle_before"])]
    elif "graphs" not in res and res["eager"]["graphs"] is False:
        lines += ["", "(no CUDA: graph replays not profiled)"]
    return "\n".join(lines)
