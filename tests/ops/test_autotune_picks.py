"""`benchmarks/ops/autotune_picks.py`: Triton's cached autotune results read back, fastest configs first."""
from __future__ import annotations

import json

import pytest

from benchmarks.ops import autotune_picks as ap


def _write(cache, folder, kernel, key, timings):
    """One `<kernel>.autotune.json` as Triton writes it: key and (config, [ms, ...]) pairs."""
    (cache / folder).mkdir(parents=True)
    configs = [[{"kwargs": kw, "num_warps": w, "num_stages": s}, [ms, ms * 1.1]] for kw, w, s, ms in timings]
    (cache / folder / f"{kernel}.autotune.json").write_text(json.dumps({"key": key, "configs_timings": configs}))


def test_picks_sorts_filters_and_caps(tmp_path):
    _write(tmp_path, "A", "_dk_kernel", [128, "tf32", "torch.bfloat16"],
           [({"BT": 16, "BK": 64}, 4, 2, 1.30), ({"BT": 16, "BK": 32}, 2, 3, 1.21), ({"BT": 32, "BK": 32}, 4, 2, 1.5)])
    _write(tmp_path, "B", "_dv_kernel", [128], [({"BT": 16, "BV": 128}, 4, 2, 0.71)])
    (tmp_path / "C").mkdir()
    (tmp_path / "C" / "other.json").write_text("{}")          # not an autotune file: ignored
    recs = ap.picks(tmp_path, top=2)
    assert [r["kernel"] for r in recs] == ["_dk_kernel", "_dv_kernel"]
    assert recs[0]["configs"] == [("BT=16, BK=32, w2 s3", 1.21), ("BT=16, BK=64, w4 s2", 1.30)]
    assert [r["kernel"] for r in ap.picks(tmp_path, kernels=("_dv_kernel",))] == ["_dv_kernel"]


def test_main_prints_the_table_and_refuses_a_missing_cache(tmp_path, capsys):
    _write(tmp_path, "A", "_output_kernel", [128, "torch.float32"], [({"BT": 16, "BV": 128}, 4, 2, 0.63)])
    ap.main(["--cache", str(tmp_path), "--out", str(tmp_path / "picks.json")])
    out = capsys.readouterr().out
    assert "_output_kernel" in out and "BT=16, BV=128, w4 s2: 0.630" in out and "torch.float32" not in out
    assert json.loads((tmp_path / "picks.json").read_text())[0]["kernel"] == "_output_kernel"
    with pytest.raises(SystemExit, match="no Triton cache"):
        ap.main(["--cache", str(tmp_path / "absent")])
    with pytest.raises(SystemExit, match="no \\*.autotune.json"):
        ap.main(["--cache", str(tmp_path), "--kernels", "_none"])
