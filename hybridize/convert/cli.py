"""`hybridize convert` (teacher -> hybrid checkpoint + report) and `hybridize generate` (quick check).

    hybridize convert --src default --layers 5:1 --mixer sse --out runs/demo
    hybridize convert --src ./my-qwen3 --layers attn=5,11,17 --mixer gla --mixer-settings use_rope=true
    hybridize generate --model runs/demo --prompt "What is 7 * 8?"

The plan is printed before anything slow runs; bad input ends with one line (exit status 2).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import typer
from rich.console import Console

from hybridize.convert.calibrate import calibration_inputs
from hybridize.convert.convert import convert_model
from hybridize.convert.fingerprint import fingerprint, recorded_source
from hybridize.convert.plan import parse_plan, plan_summary, plan_table
from hybridize.convert.report import SAMPLE_TEXTS, conversion_report, report_table, sample_inputs
from hybridize.convert.select.plan_file import is_plan_file, plan_from_file
from hybridize.convert.settings import check_user_settings
from hybridize.convert.sources import describe_source, family_source_note, load_config
from hybridize.generation.loading import DTYPES, load_model

#: the --dtype choices of `convert` and `generate` (names in `hybridize.generation.loading.DTYPES`)
DTYPE_CHOICES = ("float32", "bfloat16", "float16")
DEFAULT_PROMPT = "What is the capital of France?"


def parse_settings(items: list[str] | None) -> dict:
    """`--mixer-settings` values: JSON objects and/or key=value pairs (values read as JSON when they parse)."""
    out: dict = {}
    for item in items or []:
        item = item.strip()
        if item.startswith("{"):
            try:
                value = json.loads(item)
            except json.JSONDecodeError as e:
                raise ValueError(f"--mixer-settings {item!r} is not valid JSON ({e.msg})") from None
            if not isinstance(value, dict):
                raise ValueError("--mixer-settings JSON must be an object")
            out.update(value)
            continue
        for pair in item.split(","):
            if "=" not in pair:
                raise ValueError(f"--mixer-settings {pair!r}: write key=value, mixer.key=value or a JSON object")
            key, raw = (s.strip() for s in pair.split("=", 1))
            try:
                out[key] = json.loads(raw)
            except json.JSONDecodeError:
                out[key] = raw
    return out


def _torch_dtype(name: str):
    if name not in DTYPE_CHOICES:
        raise ValueError(f"--dtype {name!r}: choose one of {', '.join(DTYPE_CHOICES)}")
    return DTYPES[name]


def _check_out(out: Path, overwrite: bool) -> None:
    """Refuse an --out that is a file or a non-empty folder (without --overwrite); creates nothing, so a
    conversion that fails later leaves no empty folder behind."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a folder")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"--out {out} is not empty; pass --overwrite or choose another folder")


def _teacher_record(src: str) -> dict:
    """What `src` resolved to, plus what the checkpoint records as its teacher: an absolute path (a name for
    'default' and hub ids) and a fingerprint of the weight files (`hybridize.convert.fingerprint`)."""
    return {**describe_source(src), "teacher": recorded_source(src), "fingerprint": fingerprint(src)}


def _check_settings(config, plan: list[str], settings: dict) -> None:
    """The old name of `hybridize.convert.settings.check_user_settings` (kept for callers of it)."""
    check_user_settings(config, plan, settings)


def quick_generate(model, tokenizer, prompt: str, max_new_tokens: int = 24) -> str:
    """Greedy continuation of `prompt` (through the chat template when the tokenizer has one)."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
    else:
        text = prompt
    enc = tokenizer(text, return_tensors="pt").to(next(model.parameters()).device)
    with torch.no_grad():
        ids = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(ids[0, enc.input_ids.shape[1]:], skip_special_tokens=True)


def run_convert(src: str, layers: str, mixer: str, out: Path, settings: dict, dtype: str = "float32",
                device: str = "cpu", samples: int = 3, prompt: str = DEFAULT_PROMPT, max_new_tokens: int = 16,
                overwrite: bool = False, console=None, calibrate: bool = True, seed: int = 0) -> dict:
    """The whole `convert` command; returns the report dict (also written to OUT/report.json, which records
    `seed`: the new mixer parameters are drawn from it and their names, `convert.seed_new_parameters`)."""
    console = console or Console()
    if not 1 <= samples <= len(SAMPLE_TEXTS):  # checked before minutes of work, not after the save
        raise ValueError(f"--samples {samples}: choose 1 to {len(SAMPLE_TEXTS)} (the built-in sample texts)")
    if prompt and max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens {max_new_tokens} must be >= 1 (or --prompt '' to skip the check)")
    tdtype = _torch_dtype(dtype)
    out = Path(out)
    t0 = time.perf_counter()
    note = family_source_note(src)
    if note:  # `--src Qwen`: say which checkpoint the family name stands for, before any download
        console.print(note)
    source = _teacher_record(src)
    config = load_config(src)
    if is_plan_file(layers):  # OUT/plan.txt or OUT/select.json of `hybridize select`, checked against this teacher
        layers = plan_from_file(layers, config.num_hidden_layers, source["fingerprint"], src)
    plan = parse_plan(layers, config.num_hidden_layers, mixer, allow_none=False)
    console.print(plan_table(plan, title=f"layer plan {layers!r} for {src} ({config.model_type}, "
                                         f"{config.num_hidden_layers} layers)"))
    check_user_settings(config, plan, settings)  # bad settings fail before loading
    _check_out(out, overwrite)
    teacher, tokenizer = load_model(src, dtype=tdtype, device=device, need_tokenizer=False)
    t_load = time.perf_counter()
    calib = calibration_inputs(teacher, tokenizer) if calibrate else None
    hybrid = convert_model(teacher, plan, mixer=mixer, mixer_settings=settings, teacher_source=source["teacher"],
                           calibration_inputs=calib, seed=seed).eval()
    hybrid.config.teacher_fingerprint = source["fingerprint"]  # checked when distillation loads this teacher
    t_conv = time.perf_counter()
    inputs = sample_inputs(tokenizer, teacher.config.vocab_size, n=samples)
    report = conversion_report(teacher, hybrid, inputs, source=source)
    t_rep = time.perf_counter()
    hybrid.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    t_save = time.perf_counter()
    report.update(plan_spec=layers, plan_summary=plan_summary(plan), default_mixer=mixer, dtype=dtype, seed=seed,
                  timings_s={"load": t_load - t0, "convert": t_conv - t_load, "report": t_rep - t_conv,
                             "save": t_save - t_rep})
    if prompt and tokenizer is not None:
        report["sample"] = {"prompt": prompt, "teacher": quick_generate(teacher, tokenizer, prompt, max_new_tokens),
                            "hybrid": quick_generate(hybrid, tokenizer, prompt, max_new_tokens)}
    report["timings_s"]["total"] = time.perf_counter() - t0
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    console.print(report_table(report))
    if "sample" in report:
        console.print(f"[bold]prompt[/]  {prompt}\n[bold]teacher[/] {report['sample']['teacher']!r}\n"
                      f"[bold]hybrid[/]  {report['sample']['hybrid']!r}")
    console.print(f"wrote {out}/ (checkpoint, tokenizer, report.json) in {report['timings_s']['total']:.1f} s")
    return report


def register(app: typer.Typer) -> None:
    """Add `convert` and `generate` to the main `hybridize` app."""

    @app.command("convert")
    def convert(
        out: Path = typer.Option(..., "--out", help="folder for the checkpoint, tokenizer and report.json"),
        src: str = typer.Option("default", "--src", help="teacher: 'default' (embedded SmolLM2-135M-Instruct), "
                                "a local HF folder, a .gguf file, a hub id, an alias like qwen3-1.7b or a family "
                                "name (Qwen, llama, gemma, phi, olmo, granite: its default checkpoint)"),
        layers: str = typer.Option("5:1", "--layers", help="layer plan: '5:1', 'sse,swa,sse,swa,attn', "
                                   "'attn=5,11,17', '0-3:gla,4:attn,5-29:sse', 'all', or the --out folder / "
                                   "plan.txt / select.json of `hybridize select` (checked against this teacher)"),
        mixer: str = typer.Option("sse", "--mixer", help="default mixer of the plan"),
        mixer_settings: list[str] = typer.Option(None, "--mixer-settings", help="mixer settings: a JSON object "
                                                 "or key=value / mixer.key=value (repeatable)"),
        dtype: str = typer.Option("float32", "--dtype", help="float32 | bfloat16 | float16"),
        device: str = typer.Option("cpu", "--device", help="cpu, cuda, cuda:1, ..."),
        samples: int = typer.Option(3, "--samples", help="built-in sample texts for the report (1-3)"),
        prompt: str = typer.Option(DEFAULT_PROMPT, "--prompt", help="quick greedy generation check ('' skips)"),
        max_new_tokens: int = typer.Option(16, "--max-new-tokens"),
        overwrite: bool = typer.Option(False, "--overwrite", help="write into a non-empty --out"),
        calibrate: bool = typer.Option(True, "--calibrate/--no-calibrate",
                                       help="fit each converted layer's output gain to its teacher layer on "
                                            "teacher-generated text (hybridize.convert.calibrate)"),
        seed: int = typer.Option(0, "--seed", help="seed of the new mixer parameters (each drawn from the seed "
                                 "and its name, so a rerun converts bit-identically); recorded in report.json"),
    ) -> None:
        """Convert a pretrained decoder into a hybrid checkpoint and print a conversion report."""
        run_convert(src, layers, mixer, out, parse_settings(mixer_settings), dtype, device, samples, prompt,
                    max_new_tokens, overwrite, calibrate=calibrate, seed=seed)

    if any(getattr(c, "name", None) == "generate" for c in app.registered_commands):
        return

    @app.command("generate")
    def generate(
        model: str = typer.Option(..., "--model", help="a checkpoint folder (hybrid or teacher) or 'default'"),
        prompt: str = typer.Option(DEFAULT_PROMPT, "--prompt"),
        max_new_tokens: int = typer.Option(48, "--max-new-tokens"),
        dtype: str = typer.Option("float32", "--dtype"),
        device: str = typer.Option("cpu", "--device"),
    ) -> None:
        """Greedy generation from a model (chat template applied when the tokenizer has one)."""
        note = family_source_note(model)
        if note:
            typer.secho(note, err=True, dim=True)
        m, tok = load_model(model, dtype=_torch_dtype(dtype), device=device, need_tokenizer=False)
        if tok is None:
            raise ValueError(f"{model} has no tokenizer files")
        t = time.perf_counter()
        text = quick_generate(m, tok, prompt, max_new_tokens)
        typer.echo(text)
        typer.secho(f"({max_new_tokens} tokens max in {time.perf_counter() - t:.1f} s)", err=True, dim=True)
