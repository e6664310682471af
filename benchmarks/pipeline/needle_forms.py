"""Where a needle task fails: the form of each answer that `hybridize eval recovery` kept
(`<report>/needles/<task>_<L>/<model>/samples.jsonl`).

Each completion is put in one of three forms, after the bullets and colons it opens with: `value-first` (it starts
with the first 8 characters of the expected value), `numbered` (it starts a numbered list, "1. ..."), `other`. The
table counts each form with its score, split by whether the value starts with a digit (a value that opens with a
digit competes with a list's "1"). A model whose value-first answers are right but which rarely starts with the
value copies well and chooses the wrong answer form; one whose value-first answers are wrong copies badly.

    python -m benchmarks.pipeline.needle_forms <report folder> [...] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from pathlib import Path

_LEAD = re.compile(r"^[\s:*\-]+")


def form(completion: str, value: str) -> str:
    """value-first | numbered | other."""
    c = _LEAD.sub("", completion)
    if c.startswith(value[:8]):
        return "value-first"
    if re.match(r"\d+\.\s", c):
        return "numbered"
    return "other"


def tally(rows: list[dict]) -> dict:
    """Counts of (form, right) and (value's first character digit/letter, right) over one cell's samples."""
    forms, leads = Counter(), Counter()
    for r in rows:
        value = r["answers"][0]
        right = r["score"] >= 1.0
        forms[f"{form(r['completion'], value)}:{'right' if right else 'wrong'}"] += 1
        leads[f"{'digit' if value[:1].isdigit() else 'letter'}:{'right' if right else 'wrong'}"] += 1
    return {"n": len(rows), "score": sum(r["score"] for r in rows) / max(len(rows), 1),
            "forms": dict(sorted(forms.items())), "first_char": dict(sorted(leads.items()))}


def collect(report: Path) -> dict:
    """{task_L: {model: tally}} for every samples.jsonl under `report`/needles."""
    out: dict = {}
    for f in sorted(report.glob("needles/*/*/samples.jsonl")):
        rows = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
        out.setdefault(f.parent.parent.name, {})[f.parent.name] = tally(rows)
    return out


def markdown(cells: dict) -> str:
    lines = ["| task | model | score | value-first right / wrong | numbered | other | value opens with a digit: right / n |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for task in sorted(cells, key=lambda t: (t.rsplit("_", 1)[0], int(t.rsplit("_", 1)[1]))):
        for model, t in sorted(cells[task].items()):
            f, d = t["forms"], t["first_char"]
            lines.append(f"| {task} | {model} | {t['score']:.3f} | {f.get('value-first:right', 0)} / "
                         f"{f.get('value-first:wrong', 0)} | {f.get('numbered:right', 0) + f.get('numbered:wrong', 0)} | "
                         f"{f.get('other:right', 0) + f.get('other:wrong', 0)} | {d.get('digit:right', 0)} / "
                         f"{d.get('digit:right', 0) + d.get('digit:wrong', 0)} |")
    return "\n".join(lines)


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
