"""`hybridize eval <task>`: math, niah, mqar, ppl, kv-probe, speed.

Every command prints a table and writes its results (JSON/JSONL/CSV, PNG plots) under `--out`
(default `runs/eval/<task>/...`). Models are given as "default" (embedded SmolLM2-135M-Instruct), a
local HF or hybrid checkpoint directory, or `name=path` to choose the label used in tables.
"""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from hybridize.errors import UserError

eval_app = typer.Typer(help="Evaluate a teacher or hybrid model: math, needle-in-a-haystack, MQAR, "
                            "perplexity, the KV-regression probe, speed.", no_args_is_help=True)

MODEL_HELP = "'default' (embedded SmolLM2-135M-Instruct), a local HF/hybrid checkpoint dir, or name=path"
DTYPE_HELP = "float32, bfloat16, float16 or auto"
DEVICE_HELP = "cpu, cuda, cuda:1 or auto"
GEN_HELP = "fast (static buffers + CUDA graphs, same tokens as HF) | hf (model.generate) | auto (fast on CUDA)"


def register(app: typer.Typer) -> None:
    """Add the `eval` command group to the main `hybridize` app."""
    app.add_typer(eval_app, name="eval")


def _named(spec: str) -> tuple[str, str]:
    """'name=path' -> (name, path); 'path' -> (short name, path)."""
    if "=" in spec and not Path(spec).exists():
        name, src = spec.split("=", 1)
        return name, src
    return Path(spec).name or spec, spec


def _load(spec: str, dtype: str, device: str):
    # deferred: the command's modules load when it runs, so `hybridize --help` stays light
    from .common import load_model

    name, src = _named(spec)
    typer.secho(f"loading {src} ...", err=True, fg=typer.colors.BLUE)
    model, tok = load_model(src, dtype=dtype, device=device)
    return name, model, tok


def _out(out: Optional[Path], *parts: str) -> Path:
    # deferred: the command's modules load when it runs, so `hybridize --help` stays light
    from .common import slug

    return out if out is not None else Path("runs/eval").joinpath(*[slug(p) for p in parts])


def _at_least_one(**values: Optional[int]) -> None:
    """One line, before any model loads, for a count or size below 1 (`--trials 0` ended in a reshape error,
    `--samples 0` wrote an empty table with exit 0); None means "the default"."""
    for name, value in values.items():
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def _done(path: Path) -> None:
    typer.secho(f"results written to {path}/", fg=typer.colors.GREEN, err=True)


# ---- math ---------------------------------------------------------------------------------------

@eval_app.command("math")
def math_cmd(
    model: str = typer.Option("default", "--model", "-m", help=MODEL_HELP),
    dataset: str = typer.Option("aime24", "--dataset", "-d",
                                help="aime24, aime25, math500, amc23, olympiadbench, gsm8k, generated arithmetic "
                                     "arith[:train|test][:L3|:L1-3][:n=N][:seed=S] (default the test split, 50 "
                                     "per level; levels 1-6), a JSONL with problem/answer, or 'all' (with "
                                     "--check-checker)"),
    samples: Optional[int] = typer.Option(None, help="completions per problem (avg@k); default 32 for AIME, else 1"),
    greedy: bool = typer.Option(False, help="greedy decoding, one completion per problem"),
    temperature: float = typer.Option(1.0, help="sampling temperature (SSE protocol 1.0)"),
    top_p: float = typer.Option(0.7, help="nucleus p (SSE protocol 0.7)"),
    max_new_tokens: int = typer.Option(4096, help="generation budget per completion"),
    limit: Optional[int] = typer.Option(None, help="evaluate the first N problems only"),
    batch_size: Optional[int] = typer.Option(None, help="sequences generated together (default 64 on GPU, 8 on CPU)"),
    generation: str = typer.Option("auto", help=GEN_HELP),
    chat: Optional[bool] = typer.Option(None, "--chat/--no-chat", help="chat template (default: if the tokenizer has one)"),
    check_checker: bool = typer.Option(False, "--check-checker",
                                       help="no model: score the dataset's own answers/solutions and shuffled answers"),
    seed: int = typer.Option(0, help="sampling seed"),
    answer_format: str = typer.Option("boxed", help="boxed: ask for \\boxed{}, math-verify on the last box | "
                                                    "number: ask 'Answer with the number only.', the number "
                                                    "after the last '=' (else the last one) must equal the answer"),
    dtype: str = typer.Option("auto", help=DTYPE_HELP),
    device: str = typer.Option("auto", help=DEVICE_HELP),
    out: Optional[Path] = typer.Option(None, help="output folder (default runs/eval/math/<model>/<dataset>)"),
):
    """Math benchmarks with boxed answers checked by math-verify: avg@k, pass@k, per-problem JSONL."""
    # deferred: the command's modules load when it runs, so `hybridize --help` stays light
    from .common import print_table, write_csv, write_json
    from .math import (ANSWER_FORMATS, DATASETS, MathEvalConfig, check_checker as run_check, evaluate_math,
                       load_math_dataset)

    _at_least_one(samples=samples, max_new_tokens=max_new_tokens, limit=limit, batch_size=batch_size)
    if check_checker:
        names = [*DATASETS, "arith"] if dataset == "all" else [dataset]
        rows = []
        for n in names:
            r = run_check(load_math_dataset(n, limit))
            rows.append({"dataset": n, **{k: v for k, v in r.items() if k != "failed_boxed_ids"}})
        cols = ["dataset", "n", "answers_boxed", "answers_raw", "solutions", "n_solutions", "shuffled",
                "shuffled_same_string"]
        print_table(rows, cols, title="answer checker on reference answers (want ~1) and shuffled answers (want ~0)")
        d = _out(out, "math", "check_checker")
        write_csv(d / "check_checker.csv", rows, cols)
        write_json(d / "check_checker.json", rows)
        _done(d)
        return
    if dataset == "all":
        raise typer.BadParameter("'all' works only with --check-checker; pick one dataset")
    if answer_format not in ANSWER_FORMATS:
        raise typer.BadParameter(f"--answer-format is one of {', '.join(ANSWER_FORMATS)}, not {answer_format!r}")
    name, m, tok = _load(model, dtype, device)
    cfg = MathEvalConfig(dataset=dataset, samples=samples, greedy=greedy, temperature=temperature, top_p=top_p,
                         max_new_tokens=max_new_tokens, limit=limit, batch_size=batch_size, chat=chat, seed=seed,
                         generation=generation, answer_format=answer_format)
    d = _out(out, "math", name, Path(dataset).stem)
    s = evaluate_math(m, tok, cfg, d)
    print_table([{"model": name, **{k: v for k, v in s.items() if k != "by_level"}}], title=f"math: {dataset}")
    if s.get("by_level"):
        print_table(s["by_level"], title=f"math: {dataset} by level")
    _done(d)


# ---- needle in a haystack -----------------------------------------------------------------------

@eval_app.command("niah")
def niah_cmd(
    model: str = typer.Option("default", "--model", "-m", help=MODEL_HELP),
    task: str = typer.Option("s-niah-1", help="s-niah-1|2|3, mk-niah-1|2|3, mv-niah, mq-niah (RULER)"),
    lengths: str = typer.Option("1k,2k,4k", help="prompt lengths in tokens, e.g. '1k,2k,4k' (k = 1024)"),
    depths: str = typer.Option("0,0.25,0.5,0.75,1", help="needle depths in [0, 1]"),
    samples: int = typer.Option(4, help="prompts per (length, depth) cell"),
    max_new_tokens: Optional[int] = typer.Option(None, help="answer budget (default 64, 48 per value for multi-value)"),
    batch_size: Optional[int] = typer.Option(None, help="prompts generated together (default 32 on GPU, 4 on CPU)"),
    generation: str = typer.Option("auto", help=GEN_HELP),
    essays: Optional[str] = typer.Option(None, help="haystack: text file, JSONL with 'text', or hub dataset "
                                                    "(default: shared paul_graham_essays.txt; where it is missing, "
                                                    "the built-in python-reference text)"),
    chat: Optional[bool] = typer.Option(None, "--chat/--no-chat", help="chat template (default: if present)"),
    seed: int = typer.Option(0, help="seed of keys and values"),
    dtype: str = typer.Option("auto", help=DTYPE_HELP),
    device: str = typer.Option("auto", help=DEVICE_HELP),
    out: Optional[Path] = typer.Option(None, help="output folder (default runs/eval/niah/<model>/<task>)"),
):
    """RULER-style needle-in-a-haystack: accuracy table (length x depth) and heatmap PNG."""
    # deferred: the command's modules load when it runs, so `hybridize --help` stays light
    from .common import parse_float_list, parse_int_list, print_table
    from .niah import NiahConfig, evaluate_niah, get_task

    get_task(task)
    _at_least_one(samples=samples, max_new_tokens=max_new_tokens, batch_size=batch_size)
    cfg = NiahConfig(task=task, lengths=tuple(parse_int_list(lengths)), depths=tuple(parse_float_list(depths)),
                     samples=samples, max_new_tokens=max_new_tokens, batch_size=batch_size, essays=essays,
                     chat=chat, seed=seed, generation=generation)
    name, m, tok = _load(model, dtype, device)
    d = _out(out, "niah", name, task)
    s = evaluate_niah(m, tok, cfg, d)
    print_table(s["table"], title=f"{task} accuracy ({name}); overall {s['accuracy']:.3f}")
    _done(d)


# ---- MQAR ---------------------------------------------------------------------------------------

@eval_app.command("mqar")
def mqar_cmd(
    mixers: str = typer.Option("attention,linear_attn,gla,deltanet",
                               help="comma-separated: 'attention' and/or hybridize.mixers names"),
    seq_len: int = typer.Option(64, help="sequence length"),
    num_kv: int = typer.Option(8, help="key-value pairs per sequence"),
    vocab: int = typer.Option(128, help="vocabulary size"),
    d_model: int = typer.Option(64, help="model width"),
    layers: int = typer.Option(2, help="blocks"),
    heads: int = typer.Option(2, help="heads per mixer"),
    steps: int = typer.Option(2000, help="training steps (short runs under-train attention: see mqar.py)"),
    batch_size: int = typer.Option(64, help="training batch size"),
    lr: float = typer.Option(3e-3, help="peak learning rate"),
    test_size: int = typer.Option(512, help="held-out sequences"),
    setting: List[str] = typer.Option([], "--setting", "-s", help="mixer setting name=value (repeatable), e.g. short_conv=true"),
    seed: int = typer.Option(0, help="seed"),
    device: str = typer.Option("auto", help=DEVICE_HELP),
    out: Optional[Path] = typer.Option(None, help="output folder (default runs/eval/mqar)"),
):
    """Train small models from scratch on multi-query associative recall and report test accuracy."""
    # deferred: the command's modules load when it runs, so `hybridize --help` stays light
    from .common import print_table
    from .mqar import MqarConfig, parse_settings, run_mqar

    cfg = MqarConfig(mixers=tuple(x.strip() for x in mixers.split(",") if x.strip()), seq_len=seq_len, num_kv=num_kv,
                     vocab=vocab, d_model=d_model, layers=layers, heads=heads, steps=steps, batch_size=batch_size,
                     lr=lr, test_size=test_size, mixer_settings=parse_settings(setting), seed=seed, device=device)
    d = _out(out, "mqar")
    rows = run_mqar(cfg, d)
    print_table(rows, ["mixer", "accuracy", "final_loss", "params", "train_s"],
                title=f"MQAR: L={seq_len}, {num_kv} pairs, vocab {vocab}, d={d_model}, {layers} layers, {steps} steps")
    _done(d)


# ---- perplexity ---------------------------------------------------------------------------------

@eval_app.command("ppl")
def ppl_cmd(
    model: List[str] = typer.Option(["default"], "--model", "-m", help=MODEL_HELP + " (repeat to compare)"),
    text: str = typer.Option("wikitext2", help="'wikitext2' (shared data; where it is missing, "
                                                      "'python-reference'), 'python-reference' (Python's Language "
                                                      "Reference, built in) or a .txt / .jsonl file"),
    lengths: str = typer.Option("256,512,1k,2k,4k", help="context lengths in tokens"),
    tokens: int = typer.Option(16384, help="tokens scored at every length"),
    dtype: str = typer.Option("auto", help=DTYPE_HELP),
    device: str = typer.Option("auto", help=DEVICE_HELP),
    out: Optional[Path] = typer.Option(None, help="output folder (default runs/eval/ppl/<model>)"),
):
    """Perplexity vs context length (length extrapolation) with plots."""
    # deferred: the command's modules load when it runs, so `hybridize --help` stays light
    from .common import parse_int_list, print_table, save_line_plot, write_csv
    from .perplexity import PplConfig, compare_rows, evaluate_ppl

    cfg = PplConfig(text=text, lengths=tuple(parse_int_list(lengths)), tokens=tokens)
    results = {}
    for spec in model:
        name, m, tok = _load(spec, dtype, device)
        results[name] = evaluate_ppl(m, tok, cfg, _out(out, "ppl", name) if len(model) == 1 else
                                     (out or Path("runs/eval/ppl")) / name)
        del m
    rows = compare_rows(results, sorted(cfg.lengths))
    print_table(rows, title=f"perplexity on {text} ({tokens} tokens per length)")
    d = _out(out, "ppl", *([] if len(model) > 1 else list(results)))
    write_csv(d / "ppl_compare.csv", rows)
    save_line_plot(d / "ppl_compare.png", {n: ([r["length"] for r in rows], [r[n] for r in rows]) for n in results},
                   xlabel="context length (tokens)", ylabel="perplexity", title=text, logx=True)
    _done(d)


# ---- KV-regression probe ------------------------------------------------------------------------

@eval_app.command("kv-probe")
def kv_probe_cmd(
    dim: int = typer.Option(64, help="key/value width d"),
    length: int = typer.Option(1000, help="pairs per sequence for the fixed-length tables"),
    lengths: str = typer.Option("500,4000,32000", help="lengths of the scaling table"),
    trials: int = typer.Option(2, help="independent sequences averaged"),
    methods: str = typer.Option("linear_attn,deltanet,gdn,gla,qdelta,rls", help="methods to compare"),
    decay: float = typer.Option(0.999, help="constant decay of gdn / gla"),
    seed: int = typer.Option(0, help="data seed"),
    out: Optional[Path] = typer.Option(None, help="output folder (default runs/eval/kv_probe)"),
):
    """The key-value regression probe of "Rethinking Key-Value Relationships in Linear Attention": relationships, normalisation, retrieval, short conv, scaling."""
    # deferred: the command's modules load when it runs, so `hybridize --help` stays light
    from .common import parse_int_list
    from .kv_probe import ProbeConfig, run_probe

    _at_least_one(dim=dim, length=length, trials=trials)
    cfg = ProbeConfig(dim=dim, length=length, lengths=tuple(parse_int_list(lengths)), trials=trials,
                      methods=tuple(x.strip() for x in methods.split(",") if x.strip()), decay=decay, seed=seed)
    d = _out(out, "kv_probe")
    run_probe(cfg, d)
    _done(d)


# ---- speed --------------------------------------------------------------------------------------

@eval_app.command("speed")
def speed_cmd(
    model: List[str] = typer.Option(["default"], "--model", "-m",
                                    help=MODEL_HELP + " (repeat: e.g. -m teacher=default -m hybrid=runs/h)"),
    lengths: str = typer.Option("1k,2k,4k,8k", help="context lengths in tokens"),
    batch_sizes: str = typer.Option("1", help="batch sizes, e.g. '1,8'"),
    decode_tokens: int = typer.Option(32, help="decode steps timed after each prefill"),
    repeats: int = typer.Option(1, help="runs per cell (median)"),
    decode: str = typer.Option("auto", help="loop (HF forward per step) | fast (CUDA-graph loop) | auto (fast on CUDA)"),
    dtype: str = typer.Option("auto", help=DTYPE_HELP),
    device: str = typer.Option("auto", help=DEVICE_HELP),
    out: Optional[Path] = typer.Option(None, help="output folder (default runs/eval/speed)"),
):
    """Prefill/decode tokens per second, cache size and peak memory, models side by side."""
    # deferred: the command's modules load when it runs, so `hybridize --help` stays light
    from .common import parse_int_list, print_table
    from .speed import COLUMNS, SpeedConfig, run_speed

    _at_least_one(decode_tokens=decode_tokens, repeats=repeats)
    cfg = SpeedConfig(lengths=tuple(parse_int_list(lengths)), batch_sizes=tuple(parse_int_list(batch_sizes)),
                      decode_tokens=decode_tokens, repeats=repeats, decode=decode)
    models = {}
    for spec in model:
        name, m, _ = _load(spec, dtype, device)
        if name in models:
            name = f"{name}_{len(models)}"
        models[name] = m
    d = _out(out, "speed")
    rows = run_speed(models, cfg, d)
    print_table(rows, COLUMNS, title="speed (decode_speedup: vs the first model)")
    _done(d)


# ---- recovery -----------------------------------------------------------------------------------

@eval_app.command("recovery")
def recovery_cmd(
    teacher: str = typer.Option(..., "--teacher", help="'default' or the teacher's checkpoint dir"),
    model: Optional[List[str]] = typer.Option(None, "--model", "-m", help="NAME=DIR (repeatable); none: only the "
                                              "teacher's rows, which later runs into the same --out reuse"),
    out: Path = typer.Option(..., help="output folder: recovery.json, recovery.md, recovery.png"),
    time_budget: Optional[float] = typer.Option(None, help="seconds; no new row starts after them"),
    lengths: str = typer.Option("1k,2k,4k,8k", help="S-NIAH prompt lengths"),
    needle_samples: int = typer.Option(4, help="S-NIAH prompts per length (4: a CPU smoke run; 96 tells a 0.9x "
                                                "ratio from parity, Fisher's p = 0.002, where 40 cannot)"),
    niah_tasks: str = typer.Option("s-niah-1,s-niah-2,s-niah-3", help="S-NIAH tasks (comma list)"),
    arith_samples: int = typer.Option(10, help="arith:test problems per level"),
    ppl_length: int = typer.Option(1024, help="perplexity context length"),
    ppl_tokens: int = typer.Option(8192, help="tokens scored per perplexity row"),
    chat_answer_tokens: int = typer.Option(48, help="the teacher's greedy answer length for the kl/agree:answers rows"),
    overwrite: bool = typer.Option(False, help="redo rows already in recovery.json"),
    generation: str = typer.Option("auto", help=GEN_HELP),
    dtype: str = typer.Option("auto", help=DTYPE_HELP),
    device: str = typer.Option("auto", help=DEVICE_HELP),
):
    """Teacher vs models on a fixed suite (ppl, KL/agreement, S-NIAH, arith): ratio table, JSON and bars."""
    # deferred: the command's modules load when it runs, so `hybridize --help` stays light
    from .common import load_model, parse_int_list
    from .recovery import NIAH_TASKS, RecoveryConfig, check_lengths, check_tokenizer, parse_model_spec, run_recovery

    specs = [parse_model_spec(s) for s in model or []]
    tasks = tuple(t.strip().lower() for t in niah_tasks.split(",") if t.strip())
    bad = [t for t in tasks if t not in NIAH_TASKS]
    if bad:
        raise UserError(f"--niah-tasks {','.join(bad)}: use some of {','.join(NIAH_TASKS)}")
    cfg = RecoveryConfig(lengths=tuple(parse_int_list(lengths)), needle_samples=needle_samples, niah_tasks=tasks,
                         arith_samples=arith_samples, ppl_length=ppl_length, ppl_tokens=ppl_tokens,
                         chat_answer_tokens=chat_answer_tokens, time_budget=time_budget, overwrite=overwrite,
                         generation=generation)
    t, tok = load_model(teacher, dtype=dtype, device=device)
    check_lengths(t, cfg)
    models = {"teacher": t}
    for name, src in specs:
        m, mtok = load_model(src, dtype=dtype, device=device)
        check_tokenizer(name, tok, mtok)
        models[name] = m
    run_recovery(models, tok, cfg, out, log=lambda s: typer.secho(s, err=True))
    _done(out)


# ---- needle attention ------------------------------------------------------------------------------

@eval_app.command("needle-attention")
def needle_attention_cmd(
    teacher: str = typer.Option(..., "--teacher", help="'default' or the teacher's checkpoint dir"),
    model: str = typer.Option(..., "--model", "-m", help="the converted model's folder"),
    length: int = typer.Option(2048, help="prompt length in tokens"),
    samples: int = typer.Option(8, help="prompts (needle depths spread evenly)"),
    task: str = typer.Option("s-niah-1", help="s-niah-1 (a number in repeated noise), s-niah-2 (a number in "
                             "essays) or s-niah-3 (a UUID in essays)"),
    out: Optional[Path] = typer.Option(None, help="output folder (default runs/eval/needle_attention/<model>)"),
    dtype: str = typer.Option("auto", help=DTYPE_HELP),
    device: str = typer.Option("auto", help=DEVICE_HELP),
):
    """Per kept softmax layer: the teacher's needle-reading head and its mass beside the model's; answer log-prob."""
    # deferred: the command's modules load when it runs, so `hybridize --help` stays light
    from .common import load_model, model_device
    from .needle_attention import NeedleAttentionConfig, compare, markdown, write
    from .niah import get_task
    from .recovery import check_tokenizer

    _at_least_one(length=length, samples=samples)
    get_task(task)   # an unknown task is one line before any model loads
    t, tok = load_model(teacher, dtype=dtype, device=device)
    m, mtok = load_model(model, dtype=dtype, device=device)
    check_tokenizer("model", tok, mtok)
    rep = compare(t, m, tok, NeedleAttentionConfig(length=length, samples=samples, task=task), model_device(m))
    d = _out(out, "needle_attention", Path(model).name)
    write(rep, d)
    typer.echo(markdown(rep))
    _done(d)
