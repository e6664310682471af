"""A malformed or non-UTF-8 `grpo --recipe` file ends in one line with the file, line and column (issue 29:
the YAML parser's multi-line error escaped as a stack trace)."""
from __future__ import annotations

import pytest

from tests.convert.test_bad_files import run_main


@pytest.mark.parametrize("text,needle", [
    (b"grpo:\n  max_steps: [1, 2\n  beta: 3\n", "line 3, column 7: not valid YAML (expected ',' or ']', but got ':')"),
    (b"grpo: {max_steps: 1}\n\tbeta: 2\n", "line 2, column 1: not valid YAML"),
    (b"\xff\xfe grpo: 1\n", "line 1, column 1: not UTF-8 text (byte 0xff)"),
])
def test_bad_recipe_is_one_line(tmp_path, monkeypatch, capsys, text, needle):
    recipe = tmp_path / "r.yaml"
    recipe.write_bytes(text)
    line = run_main(monkeypatch, capsys, ["grpo", "--recipe", str(recipe), "--show"])
    assert f"{recipe}, {needle}" in line


def test_good_recipe_still_loads():
    from hybridize.rl.config import load_grpo_config

    assert load_grpo_config("smollm2-135m/grpo").grpo.max_steps > 0


@pytest.mark.parametrize("override,key", [
    ("grpo.max_steps=-5", "grpo.max_steps"),          # TRL would train whole epochs instead
    ("grpo.max_steps=0", "grpo.max_steps"),
    ("grpo.num_generations=1", "grpo.num_generations"),
    ("grpo.per_device_train_batch_size=0", "grpo.per_device_train_batch_size"),
    ("grpo.max_completion_length=0", "grpo.max_completion_length"),
    ("grpo.learning_rate=-1e-6", "grpo.learning_rate"),
    ("data.max_prompt_tokens=0", "data.max_prompt_tokens"),
    ("lora.r=0", "lora.r"),
])
def test_grpo_counts_fail_at_parse_time(override, key):
    """As distill's train.max_steps=-5 (issue 29): a GRPO step count or size below its minimum is one line
    when the settings are read; grpo.max_steps=-5 used to make TRL silently train by epochs."""
    from hybridize.errors import UserError
    from hybridize.rl.config import load_grpo_config

    with pytest.raises(UserError) as e:
        load_grpo_config(None, [override])
    assert str(e.value).startswith(f"{key} must be >=") and "\n" not in str(e.value)
