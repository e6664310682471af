"""`hybridize select`: measured choice of the layers that keep softmax attention (see the package docstring).

    hybridize select --src default --keep 5 --out runs/select
    hybridize convert --src default --layers runs/select/plan.txt --mixer sse --out runs/q-select
"""
from __future__ import annotations

import shlex
from pathlib import Path

import typer

from hybridize.convert.cli import parse_settings
from . import SelectConfig, run_select
from .record import table_rows

HELP = "\n\n".join((
    "Choose which KEEP layers of a teacher keep softmax attention, from measurements on the teacher, and write the "
    "plan for `hybridize convert --layers` (OUT/plan.txt, e.g. attn=3,9,15,21,27), a score per layer "
    "(OUT/select.json, OUT/select.md) and a bar plot (OUT/select.png). A higher score keeps softmax.",
    "kl (default): all layers converted once and all mixers aligned together for --steps steps (stage A, "
    "layer-local); then each layer alone converted, scored by KL(teacher || model) on --tokens tokens of training "
    "text.",
    "needle: the same one-layer models, scored by the rise of the answer's NLL on S-NIAH prompts (measured with kl "
    "unless --needle-samples 0).",
    "retrieval: the teacher's attention mass on the needle's value while it answers (no conversion).",
    "combined: the mean rank of kl, needle and retrieval.",
    "copying: the teacher's induction heads (attention on the token after an earlier occurrence, on random tokens "
    "repeated once); with --windows N the N other layers with the strongest previous-token heads get sliding-window "
    "attention (plan attn=...;swa=...). No conversion.",
    "--greedy (kl only): from all layers converted, keep softmax one layer at a time, each time the one that lowers "
    "the hybrid's KL most.",
    "Scores are saved after every layer: a rerun with the same OUT resumes (--overwrite starts again); --keep, "
    "--criterion and --greedy may change between runs. On CPU the defaults take long on a real teacher; try "
    "--steps 50 --tokens 4096 --align-batch-tokens 512 --needle-length 1024.",
))


def register(app: typer.Typer) -> None:
    """Add `select` to the main `hybridize` app."""

    @app.command("select", help=HELP)
    def select(
        out: Path = typer.Option(..., "--out", help="folder for plan.txt, select.json/.md/.png (resumed if present)"),
        src: str = typer.Option("default", "--src", help="teacher: 'default', a local HF folder, a .gguf, a hub id"),
        keep: int = typer.Option(5, "--keep", help="layers that keep softmax attention"),
        mixer: str = typer.Option("sse", "--mixer", help="the mixer the other layers get"),
        criterion: str = typer.Option("kl", "--criterion", help="kl | needle | retrieval | combined | copying"),
        windows: int = typer.Option(0, "--windows", help="copying: layers outside --keep that get sliding-window "
                                    "attention, by previous-token score"),
        greedy: bool = typer.Option(False, "--greedy", help="refine the kl choice greedily (K x candidates runs)"),
        steps: int = typer.Option(150, "--steps", help="alignment steps (all mixers at once; 0 = conversion only)"),
        lr: float = typer.Option(3e-3, "--lr", help="alignment learning rate"),
        tokens: int = typer.Option(16384, "--tokens", help="tokens each layer's KL is measured on"),
        seq_len: int = typer.Option(2048, "--seq-len", help="row length of those tokens"),
        align_seq_len: int = typer.Option(512, "--align-seq-len", help="alignment row length"),
        align_batch_tokens: int = typer.Option(2048, "--align-batch-tokens", help="alignment tokens per step"),
        text: str = typer.Option("python-docs", "--text", help="training text (built-in name, file, folder, hub "
                                 "dataset); evaluation text is refused"),
        needle_length: int = typer.Option(2048, "--needle-length", help="S-NIAH prompt length in tokens"),
        needle_samples: int = typer.Option(4, "--needle-samples", help="S-NIAH prompts (0: no needle scores)"),
        greedy_tokens: int = typer.Option(4096, "--greedy-tokens", help="KL tokens of each greedy trial"),
        greedy_candidates: int = typer.Option(12, "--greedy-candidates", help="layers tried per greedy step"),
        mixer_settings: list[str] = typer.Option(None, "--mixer-settings", help="as in convert (repeatable)"),
        seed: int = typer.Option(0, "--seed", help="seed of the new mixer parameters and the alignment data order"),
        device: str = typer.Option("auto", "--device", help="auto (cuda when present) | cpu | cuda | cuda:1"),
        overwrite: bool = typer.Option(False, "--overwrite", help="discard OUT's earlier selection"),
    ) -> None:
        cfg = SelectConfig(keep=keep, criterion=criterion.strip().lower(), mixer=mixer.strip().lower(),
                           mixer_settings=parse_settings(mixer_settings), greedy=greedy, windows=windows, steps=steps,
                           lr=lr, tokens=tokens, seq_len=seq_len, align_seq_len=align_seq_len,
                           align_batch_tokens=align_batch_tokens, text=text, needle_length=needle_length,
                           needle_samples=needle_samples, greedy_tokens=greedy_tokens,
                           greedy_candidates=greedy_candidates, seed=seed, device=device, overwrite=overwrite)
        record = run_select(src, cfg, out, log=lambda s: typer.secho(s, err=True))
        print_summary(record, src, out)


def print_summary(record: dict, src: str, out: Path) -> None:
    """The score table, the files, and the `convert` line to run next."""
    from rich.console import Console
    from rich.table import Table

    rows = table_rows(record, record["chosen"])
    cols = [c for c in rows[0] if c not in ("layer", "keep")]
    table = Table(title=f"layer scores ({record['criterion']}{', greedy' if record['use_greedy'] else ''})",
                  caption=f"kept softmax: {record['chosen']}")
    for c in ("layer", *cols, "softmax"):
        table.add_column(c, justify="right")
    for r in rows:
        table.add_row(str(r["layer"]), *("-" if r[c] is None else f"{r[c]:.4g}" for c in cols),
                      "[bold red]kept[/]" if r["keep"] else "")
    console = Console()
    console.print(table)
    times = ", ".join(f"{k} {v:.1f}" for k, v in record.get("timings_s", {}).items())
    console.print(f"wrote {out}/plan.txt ({record['plan']}), select.json, select.md, select.png")
    console.print(f"seconds: {times}")
    # quoted: a plan with windows holds a ';' that a shell would take as the end of the command. Windows get the
    # 4 attention sinks that brought retrieval back on the default (benchmarks/RESULTS.md, "(iv) sliding windows")
    sinks = " --mixer-settings swa.sinks=4" if record.get("windows") else ""
    console.print(f"next: hybridize convert --src {src} --layers {shlex.quote(record['plan'])} --mixer {record['mixer']}"
                  f"{sinks} --out runs/{Path(out).name}-{record['mixer']}", soft_wrap=True, highlight=False)
