"""`hybridize grpo` command: help, settings listing, recipe + overrides, a tiny run, one-line errors."""
from __future__ import annotations

import typer
import yaml
from typer.testing import CliRunner

from hybridize.errors import UserError
from hybridize.rl.cli import register
from tests.rl.helpers import tiny_hybrid, write_problems


def _app():
    app = typer.Typer()
    register(app)

    @app.command("noop")  # a second command so typer keeps `grpo` as a sub-command
    def noop():
        pass

    return app


runner = CliRunner()


def test_help_and_settings():
    r = runner.invoke(_app(), ["grpo", "--help"])
    assert r.exit_code == 0 and "--recipe" in r.output and "--resume" in r.output and "--model" in r.output
    r = runner.invoke(_app(), ["grpo", "--settings"])
    assert r.exit_code == 0 and "grpo.num_generations = 8" in r.output and "lora.enabled" in r.output


def test_recipes_resolve_with_overrides():
    for recipe in ("smollm2-135m/grpo", "qwen3-1.7b/grpo"):
        r = runner.invoke(_app(), ["grpo", "--recipe", recipe, "--model", "some/dir", "--show",
                                   "grpo.max_steps=7", "lora.r=4"])
        assert r.exit_code == 0, r.output
        cfg = yaml.safe_load(r.output)
        assert cfg["model"] == "some/dir" and cfg["grpo"]["max_steps"] == 7 and cfg["lora"]["r"] == 4
        assert cfg["grpo"]["num_generations"] == 8


def test_bad_override_is_a_user_error():
    r = runner.invoke(_app(), ["grpo", "--show", "grpo.no_such_key=1"])
    assert isinstance(r.exception, UserError) and "unknown setting" in str(r.exception)
    r = runner.invoke(_app(), ["grpo", "--show", "grpo.max_steps=abc"])
    assert isinstance(r.exception, UserError)
    for bad in ("compile_decode=yes", "cuda_graphs=maybe", "decode_gemm=cutlass", "prefill_tokens=-1"):
        r = runner.invoke(_app(), ["grpo", "--show", bad])
        assert isinstance(r.exception, UserError) and bad.split("=")[0] in str(r.exception), bad
    r = runner.invoke(_app(), ["grpo", "--show", "compile_decode=on"])
    assert r.exit_code == 0 and yaml.safe_load(r.output)["compile_decode"] == "on"


def test_tiny_run(tmp_path):
    tiny_hybrid(tmp_path / "m", mixer="gla")
    write_problems(tmp_path / "p.jsonl")
    args = ["grpo", "--model", str(tmp_path / "m"), "--output-dir", str(tmp_path / "run"),
            f"data.train=[{tmp_path / 'p.jsonl'}]", "grpo.num_generations=4", "grpo.per_device_train_batch_size=4",
            "grpo.max_completion_length=8", "grpo.max_steps=1", "save_steps=1", "progress=false"]
    r = runner.invoke(_app(), args)
    assert r.exit_code == 0, (r.output, r.exception)
    assert (tmp_path / "run" / "final" / "config.json").is_file()
    assert (tmp_path / "run" / "metrics.jsonl").is_file() and (tmp_path / "run" / "summary.json").is_file()
    r = runner.invoke(_app(), args[:-3] + ["grpo.max_steps=2", "progress=false", "--resume"])
    assert r.exit_code == 0, (r.output, r.exception)
