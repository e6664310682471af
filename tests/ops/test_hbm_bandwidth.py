"""benchmarks/ops/hbm_bandwidth.py: one clear line without a GPU; on CUDA, rows whose bandwidths are a plausible share
of the data sheet (the H200 run is in RESULTS.md)."""
import json

import pytest
import torch

from benchmarks.ops.hbm_bandwidth import main

CUDA = torch.cuda.is_available()


@pytest.mark.skipif(CUDA, reason="the no-GPU message (this machine has one)")
def test_without_a_gpu_it_says_so_in_one_line():
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        main(["--gb", "0.01"])


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_rows_on_a_gpu(tmp_path):
    name = torch.cuda.get_device_name()
    if not any(word in name for word in ("H100", "H200")):
        pytest.skip(f"no data sheet bandwidth listed for {name}")
    out = tmp_path / "hbm.json"
    got = main(["--gb", "0.5", "--reps", "5", "--out", str(out)])
    assert [r["case"] for r in got["rows"]] == ["sum", "copy"]
    assert got["rows"][1]["bytes"] == 2 * got["rows"][0]["bytes"]
    assert all(0.2 < r["of_sheet"] < 1.05 for r in got["rows"])
    assert json.loads(out.read_text())["rows"] == got["rows"]
