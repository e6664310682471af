"""`hybridize` command line: one typer app; each area (convert, distill, eval, rl) adds its commands.

Errors a user can fix (UserError, missing files, bad values) print one line and exit with status 2.
Before any command runs, telemetry is switched off and `datasets` goes offline unless the command line
names hub data (`hybridize.offline`).
"""
from __future__ import annotations

import importlib
import sys

import typer

from hybridize.distill.config import RECIPES_DIR
from hybridize.errors import UserError

app = typer.Typer(
    name="hybridize",
    help="Turn a pretrained Hugging Face Transformer into a fast hybrid linear-attention model: "
         "convert, distill, fine-tune with GRPO, evaluate.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

# each module defines `register(app: typer.Typer) -> None`
AREAS = (
    "hybridize.convert.cli",
    "hybridize.convert.select.cli",
    "hybridize.eval.cli",
    "hybridize.distill.cli",
    "hybridize.rl.cli",
)

for _module in AREAS:
    importlib.import_module(_module).register(app)


@app.command("recipes", short_help="List the shipped recipes (names for `-r`) and the accelerate / DeepSpeed "
                                    "configs, with their folder.")
def recipes_cmd():
    """List the shipped recipes (names for `-r`) and the folder that holds them, with the accelerate /
    DeepSpeed configs under accelerate/ (use that path in `accelerate launch --config_file`)."""
    typer.echo(f"recipes folder: {RECIPES_DIR}")
    for path in sorted(RECIPES_DIR.rglob("*")):
        if path.suffix in (".yaml", ".json"):
            rel = path.relative_to(RECIPES_DIR)
            name = rel.with_suffix("") if rel.parts[0] != "accelerate" else rel
            typer.echo(f"  {name}")


def main() -> None:
    # deferred: offline loads the evaluation and GRPO data modules (the generation engine)
    from hybridize.offline import configure

    configure(sys.argv[1:])
    try:
        app()
    except (UserError, FileNotFoundError, ValueError) as e:
        typer.secho(f"error: {e}", fg=typer.colors.RED, err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
