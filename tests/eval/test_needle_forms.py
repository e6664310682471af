"""hybridize/eval/needle_forms.py (and its script, benchmarks/pipeline/needle_forms.py): each kept needle answer put
in its form, counted with its score."""
import json

import pytest

from benchmarks.pipeline.needle_forms import main
from hybridize.eval.needle_forms import collect, form, markdown

UUID = "4278a370-7f2d-43e2-81f9-242e1c7236db"


@pytest.mark.parametrize("completion,expected", [
    (":\n\n- 4278a370-7f2d-43e2-81f9-242e1c7236db.", "value-first"),
    (":\n\n* 4278a370-7f2d", "value-first"),
    (":\n\n- 1. The special uuids for x", "numbered"),
    (":\n\n- 1. 4278a370-7f2d-43e2-81f9-242e1c7236db", "numbered"),
    (" not available in the text.", "other"),
    (":\n\n- 4278a371-0000", "other"),
])
def test_form(completion, expected):
    assert form(completion, UUID) == expected


def test_collect_counts_forms_and_first_characters(tmp_path):
    d = tmp_path / "needles" / "s-niah-3_4096" / "student"
    d.mkdir(parents=True)
    rows = [{"answers": [UUID], "completion": ": " + UUID, "score": 1.0},
            {"answers": [UUID], "completion": ":\n- 1. The", "score": 0.0},
            {"answers": ["ab" + UUID[2:]], "completion": " no", "score": 0.0}]
    (d / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cells = collect(tmp_path)
    t = cells["s-niah-3_4096"]["student"]
    assert t["n"] == 3 and t["score"] == pytest.approx(1 / 3)
    assert t["forms"] == {"numbered:wrong": 1, "other:wrong": 1, "value-first:right": 1}
    assert t["first_char"] == {"digit:right": 1, "digit:wrong": 1, "letter:wrong": 1}
    assert "| s-niah-3_4096 | student | 0.333 | 1 / 0 | 1 | 1 | 1 / 2 |" in markdown(cells)


def test_a_folder_without_needles_is_one_line(tmp_path):
    with pytest.raises(SystemExit, match="no needles/ folder"):
        main([str(tmp_path)])
