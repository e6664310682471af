"""Where a needle task fails, over one or more recovery report folders merged (`hybridize eval recovery` writes the
same table for its own folder into recovery.md): the form of each kept answer (hybridize/eval/needle_forms.py).

    python -m benchmarks.pipeline.needle_forms <report folder> [...] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from hybridize.eval.needle_forms import collect, markdown


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("reports", nargs="+", type=Path, help="recovery report folders (each with needles/)")
    p.add_argument("--json", type=Path, help="also write the counts here")
    a = p.parse_args(argv)
    cells: dict = {}
    for r in a.reports:
        if not (r / "needles").is_dir():
            raise SystemExit(f"{r} has no needles/ folder: run `hybridize eval recovery` into it first")
        for task, models in collect(r).items():
            cells.setdefault(task, {}).update(models)
    print(markdown(cells))
    if a.json:
        a.json.write_text(json.dumps(cells, indent=1))


if __name__ == "__main__":
    main()
