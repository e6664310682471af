"""`benchmarks.pipeline.multi_gpu_summary`: the one-GPU reference first, losses side by side, the largest relative
loss difference over steps 1-5, tokens/s divided by the run's GPUs (the first third of the steps left out), the
peak memory of each rank; `--steps` lists what a TRL run logged."""
from __future__ import annotations

import json

from benchmarks.pipeline.multi_gpu_summary import gpus, load_runs, main, steps, summary


def _run(root, name, rows):
    (root / name).mkdir(parents=True)
    (root / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_summary_against_the_one_gpu_reference(tmp_path, capsys):
    _run(tmp_path, "zero2_2gpu", [{"step": 1, "loss": 2.02, "tok_per_s": 999.0},
                                  {"step": 2, "loss": 1.5, "tok_per_s": 400.0},
                                  {"step": 3, "loss": 1.4, "tok_per_s": 600.0, "peak_mem_gb_per_rank": [3.0, 3.5]}])
    _run(tmp_path, "ref_1gpu", [{"step": 1, "loss": 2.0, "tok_per_s": 1.0},
                                {"step": 2, "loss": 1.5, "tok_per_s": 300.0},
                                {"step": 3, "loss": 1.4, "tok_per_s": 300.0, "peak_mem_gb_per_rank": [4.0]}])
    (tmp_path / "student").mkdir()                          # a folder without metrics is not a run
    runs = load_runs(tmp_path)
    assert list(runs) == ["ref_1gpu", "zero2_2gpu"] and gpus("zero3_2gpu") == 2 and gpus("ref_1gpu") == 1
    text = summary(runs)
    assert "| 1 | 2.00000 | 2.02000 |" in text
    assert "| zero2_2gpu | 2 | 1.00e-02 | 250 | 3.00, 3.50 |" in text      # (400 + 600) / 2 steps / 2 GPUs
    assert "| ref_1gpu | 1 |  | 300 | 4.00 |" in text
    main([str(tmp_path), "--out", str(tmp_path / "s.md")])
    assert (tmp_path / "s.md").read_text().strip() == text and text in capsys.readouterr().out


def test_steps_of_a_trl_run():
    text = steps([{"step": 1, "loss": 0.5, "reward": 0.0, "rollout/fast": 1.0, "learning_rate": 1e-6},
                  {"train_runtime": 3.0}, {"step": 2, "loss": float("nan"), "reward": 0.25}])
    assert text.splitlines() == ["   step 1: loss 0.5, reward 0, rollout/fast 1, learning_rate 1e-06",
                                 "   step 2: reward 0.25"]
