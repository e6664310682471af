"""`speed_table --gpus N` (benchmarks/generation/shards.py): which cells each worker takes, how the workers' shard
files come back into the table's JSONL, and a whole run with two workers on the CPU."""
import json

import pytest

from benchmarks.generation.shards import merge_shards, parse_shard, shard_path, shard_todo, worker_argv


def test_every_item_goes_to_one_worker_and_a_cell_stays_whole():
    todo = [(B, shape, T, m, p) for B in (8, 1, 32) for shape in ("a", "b") for T in (1024, 2048, 4096)
            for m in ("teacher", "hybrid") for p in ("engine", "engine compiled")]
    parts = [shard_todo(todo, i, 4) for i in range(4)]
    assert sorted(x for p in parts for x in p) == sorted(todo)            # each item once
    for p in parts:
        cells = {x[:3] for x in p}
        assert all(x in p for x in todo if x[:3] in cells)                   # a cell's paths together
        assert {c[0] for c in cells} == {8, 1, 32}                           # a share of every batch size
    assert [x for x in todo if x in parts[0]] == parts[0]                    # the table's order kept


def test_merge_moves_complete_rows_and_deletes_the_shard_files(tmp_path):
    out = tmp_path / "speed.jsonl"
    out.write_text(json.dumps({"n": 0}) + "\n")
    shard_path(out, 0).write_text(json.dumps({"n": 1}) + "\n" + json.dumps({"n": 2}) + "\n")
    shard_path(out, 1).write_text(json.dumps({"n": 3}) + "\n" + '{"cut off')   # a worker killed mid-row
    assert merge_shards(out) == 3
    assert sorted(json.loads(l)["n"] for l in out.read_text().splitlines()) == [0, 1, 2, 3]
    assert not list(tmp_path.glob("*.shard*.jsonl"))
    assert merge_shards(out) == 0


def test_worker_arguments_and_shard_errors():
    assert worker_argv(["--out", "x", "--gpus", "4", "--lens", "64"], 2, 4) == ["--out", "x", "--lens", "64",
                                                                                 "--shard", "2/4"]
    assert worker_argv(["--gpus=4", "--out", "x"], 0, 4) == ["--out", "x", "--shard", "0/4"]
    assert parse_shard("") is None and parse_shard("1/3") == (1, 3)
    for bad in ("3/3", "x", "1"):
        with pytest.raises(SystemExit, match="--shard"):
            parse_shard(bad)


def test_two_workers_fill_the_table_and_a_rerun_skips_it(tmp_path):
    """Two worker processes on the CPU (the tiny shape): one cell each, every path of both cells in --out, marked as
    measured beside another worker, no shard file left; run again, nothing is measured twice."""
    from benchmarks.generation.speed_table import main

    out = tmp_path / "speed.jsonl"
    argv = ["--shapes", "tiny", "--lens", "64", "--batches", "1,2", "--new-tokens", "2", "--dtype", "float32",
            "--hf-warmup", "1", "--out", str(out), "--gpus", "2"]
    main(argv)
    rows = [json.loads(l) for l in out.read_text().splitlines()]
    assert sorted({(r["batch"], r["model"], r["table_path"]) for r in rows}) == sorted(
        {(B, m, p) for B in (1, 2) for m, p in [("teacher", "HF warmed"), ("teacher", "HF static compiled"),
                                                ("teacher", "engine"), ("teacher", "engine compiled"),
                                                ("hybrid", "engine"), ("hybrid", "engine compiled")]})
    assert len(rows) == 12 and all(r["concurrent_workers"] == 2 for r in rows)
    assert not list(tmp_path.glob("*.shard*.jsonl"))
    assert "12 with 2 workers" in out.with_suffix(".md").read_text()
    main(argv)
    assert len(out.read_text().splitlines()) == 12
