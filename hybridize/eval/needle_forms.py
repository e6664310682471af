"""How each needle answer that `hybridize eval recovery` kept (`<out>/needles/<task>_<L>/<model>/samples.jsonl`)
is formed, so that a score of 0 says whether the model copied the value badly or answered in another form.

Each completion is put in one of three forms, after the bullets and colons it opens with: `value-first` (it starts
with the first 8 characters of the expected value), `numbered` (it starts a numbered list, "1. ..."), `other`. The
counts go with each sample's score, split by whether the value starts with a digit (a value that opens with a digit
competes with a list's "1"). A model whose value-first answers are right but which rarely starts with the value
copies well and chooses the wrong answer form; one whose value-first answers are wrong copies badly.
"""
from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

_LEAD = re.compile(r"^[\s:*\-]+")
#: what the table says, for the reports that carry it
EXPLAIN = ("Each kept answer (needles/) by its opening: the value itself (right / wrong copy), a numbered list, or "
           "other. Right value-first answers with few value-first openings: the model copies but answers in another "
           "form; wrong value-first answers: it copies badly.")


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
    lines = ["| task | model | score | value-first right / wrong | numbered | other | value opens with a digit: "
             "right / n |", "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for task in sorted(cells, key=lambda t: (t.rsplit("_", 1)[0], int(t.rsplit("_", 1)[1]))):
        for model, t in sorted(cells[task].items()):
            f, d = t["forms"], t["first_char"]
            numbered = f.get("numbered:right", 0) + f.get("numbered:wrong", 0)
            other = f.get("other:right", 0) + f.get("other:wrong", 0)
            digit = d.get("digit:right", 0) + d.get("digit:wrong", 0)
            lines.append(f"| {task} | {model} | {t['score']:.3f} | {f.get('value-first:right', 0)} / "
                         f"{f.get('value-first:wrong', 0)} | {numbered} | {other} | {d.get('digit:right', 0)} / {digit} |")
    return "\n".join(lines)
