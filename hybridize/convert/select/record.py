"""What `hybridize select` writes under OUT, and how a rerun resumes from it.

- `select.json`: the teacher (source, fingerprint, layer count), the measurement settings, every score
  measured so far (`scores[criterion][layer]`), the alignment losses, greedy steps, and at the end the
  choice and the plan. Rewritten (temporary file + `os.replace`) after EACH layer, so a crash loses at most
  the layer under way; a rerun with the same teacher and measurement settings skips what is recorded
  (`--keep`, `--criterion` and `--greedy` may change: choosing again costs nothing).
- `select.md` (the table), `select.png` (bars per layer, kept layers marked) and `plan.txt` (the plan
  string; written last, so its presence means the selection finished).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from hybridize.errors import UserError

JSON, MD, PNG, PLAN = "select.json", "select.md", "select.png", "plan.txt"
OUTPUTS = (JSON, MD, PNG, PLAN, "aligned.safetensors")


def atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


class SelectRecord:
    """`select.json` in memory; every `put_*` writes it back."""

    def __init__(self, out: Path, teacher: dict, measure: dict, overwrite: bool = False):
        self.out, self.path = Path(out), Path(out) / JSON
        if self.out.exists() and not self.out.is_dir():
            raise UserError(f"--out {self.out} exists and is not a folder")
        if overwrite:
            for name in OUTPUTS:
                (self.out / name).unlink(missing_ok=True)
        old = self._read()
        if old:
            _check_same(old, teacher, measure, self.path)
        self.data = old or {"teacher": teacher, "measure": measure, "scores": {}, "greedy": []}

    def _read(self) -> dict | None:
        if not self.path.is_file():
            return None
        try:
            return json.loads(self.path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise UserError(f"{self.path} is damaged (not JSON); pass --overwrite to start again") from None

    def scores(self, criterion: str) -> dict[int, float]:
        return {int(k): v for k, v in self.data["scores"].get(criterion, {}).items()}

    def put_score(self, criterion: str, layer: int, value: float) -> None:
        self.data["scores"].setdefault(criterion, {})[str(layer)] = value
        self.write()

    def put(self, **items) -> None:
        self.data.update(items)
        self.write()

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        atomic_write(self.path, json.dumps(self.data, indent=1) + "\n")


def _check_same(old: dict, teacher: dict, measure: dict, path: Path) -> None:
    """Refuse to mix measurements of another teacher or other settings into one record."""
    was = old.get("teacher", {})
    if (was.get("num_layers"), was.get("fingerprint")) != (teacher["num_layers"], teacher["fingerprint"]):
        raise UserError(f"{path} holds a selection for teacher {was.get('src')!r} ({was.get('num_layers')} layers); "
                        "pass --overwrite or another --out")
    changed = sorted(k for k in measure if old.get("measure", {}).get(k) != measure[k])
    if changed:
        diff = ", ".join(f"{k}: {old.get('measure', {}).get(k)!r} -> {measure[k]!r}" for k in changed)
        raise UserError(f"{path} was measured with other settings ({diff}); pass --overwrite or another --out")


#: score columns in table order, and what each means
COLUMNS = {
    "kl": "KL(teacher || teacher with this layer alone converted), nats/token",
    "needle": "rise of the answer's NLL on S-NIAH prompts with this layer alone converted, nats/token",
    "retrieval": "attention mass of the layer's most retrieving head on the needle's value (0-1)",
    "combined": "mean rank percentile of kl, needle and retrieval (0-1)",
    "induction": "attention of the layer's best induction head on the token after the earlier occurrence (0-1)",
    "previous_token": "attention of the layer's best previous-token head on position t-1 (0-1)",
    "align_nmse": "the layer's mixer after alignment: nMSE to the teacher attention (1 = as bad as zero)",
}


def table_rows(record: dict, kept: list[int]) -> list[dict]:
    """One row per layer: each recorded score (COLUMNS order) and whether the layer keeps softmax."""
    n = record["teacher"]["num_layers"]
    cols = [c for c in COLUMNS if c in record["scores"]]
    rows = []
    for i in range(n):
        row = {"layer": i}
        for crit in cols:
            row[crit] = record["scores"][crit].get(str(i))
        row["keep"] = i in kept
        rows.append(row)
    return rows


def write_md(path: Path, record: dict, rows: list[dict]) -> None:
    cols = [c for c in rows[0] if c not in ("layer", "keep")]
    t = record["teacher"]
    lines = [f"# layer selection: {t['src']} ({t['num_layers']} layers)", "",
             f"criterion `{record['criterion']}`{' + greedy' if record.get('use_greedy') else ''}, keep "
             f"{record['keep']}{', windows ' + str(record['windows']) if record.get('windows') else ''}: plan "
             f"`{record['plan']}`", "",
             *[f"- {c}: {COLUMNS[c]}" for c in cols], "",
             "| layer | " + " | ".join(cols) + " | softmax kept |", "| ---: |" + " ---: |" * len(cols) + " --- |"]
    for r in rows:
        vals = " | ".join("-" if r[c] is None else f"{r[c]:.4g}" for c in cols)
        lines.append(f"| {r['layer']} | {vals} | {'**kept**' if r['keep'] else ''} |")
    if record.get("greedy") and record.get("use_greedy"):
        lines += ["", "greedy steps (KL of the hybrid after keeping the layer): "
                  + ", ".join(f"{s['layer']} ({s['kl']:.4g})" for s in record["greedy"][:record["keep"]])]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def save_bars(path: Path, record: dict, rows: list[dict]) -> None:
    """One bar panel per criterion, kept layers in red."""
    # deferred: this module loads with the CLI, eval.common brings the generation engine
    from hybridize.eval.common import plt

    pyplot = plt()
    cols = [c for c in rows[0] if c not in ("layer", "keep")]
    fig, axes = pyplot.subplots(len(cols), 1, figsize=(max(6, 0.3 * len(rows) + 2), 2.2 * len(cols) + 0.6),
                                squeeze=False)
    colors = ["tab:red" if r["keep"] else "tab:gray" for r in rows]
    for ax, c in zip(axes[:, 0], cols):
        ax.bar([r["layer"] for r in rows], [r[c] if r[c] is not None else 0.0 for r in rows], color=colors)
        ax.set_ylabel(c)
        ax.set_xticks([r["layer"] for r in rows])
        ax.tick_params(axis="x", labelsize=7)
    axes[0, 0].set_title(f"{record['teacher']['src']}: red = keeps softmax ({record['plan']})", fontsize=9)
    axes[-1, 0].set_xlabel("layer")
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    pyplot.close(fig)
    os.replace(tmp, path)
