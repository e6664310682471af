"""Mixer settings are type- and range-checked against the mixer's config before the teacher loads
(issue 29: `use_rope: "false"` was stored as a truthy string; zero sizes crashed deep in a forward)."""
from __future__ import annotations

import pytest
from typer.testing import CliRunner

from hybridize.convert.settings import check_settings, field_types
from hybridize.errors import UserError
from hybridize.mixers.sse import SSEConfig
from tests.convert.common import tiny_teacher, tiny_tokenizer


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("teacher")
    tiny_teacher("llama").save_pretrained(d)
    tiny_tokenizer().save_pretrained(d)
    return d


def test_field_types_reads_optional_and_plain_fields():
    t = field_types(SSEConfig)
    assert t["use_rope"] == (bool,) and t["chunk_size"] == (int,) and t["decay_min"] == (float,)


@pytest.mark.parametrize("settings,needle", [
    ({"use_rope": "false"}, 'sse.use_rope must be a JSON bool (true or false), got the string "false"'),
    ({"use_rope": 1}, "sse.use_rope must be a JSON bool"),
    ({"top_k": "2"}, "sse.top_k must be an integer"),
    ({"top_k": 1.5}, "sse.top_k must be an integer"),
    ({"top_k": True}, "sse.top_k must be an integer"),
    ({"decay_min": "0.9"}, "sse.decay_min must be a number"),
    ({"decay_min": float("nan")}, "finite"),
    ({"chunk_size": 0}, "sse.chunk_size is a size or count and must be an integer >= 1, got 0"),
    ({"num_partitions": -2}, "sse.num_partitions is a size or count"),
    ({"bogus": 1}, "mixer 'sse' has no setting 'bogus'"),
])
def test_check_settings_rejects(settings, needle):
    with pytest.raises(UserError) as e:
        check_settings({"sse": settings})
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_check_settings_accepts_right_types():
    check_settings({"sse": {"use_rope": False, "top_k": 2, "decay_min": 1, "varlen_min_len": 0},
                    "linear_attn": {"scale": None, "row_topk": 2}, "swa": {"window": 8, "sinks": 0}})
    with pytest.raises(UserError, match="swa.sinks is a size or count and must be an integer >= 0"):
        check_settings({"swa": {"sinks": -1}})


@pytest.mark.parametrize("setting,needle", [
    ('{"use_rope": "false"}', "sse.use_rope must be a JSON bool"),
    ("chunk_size=0", "sse.chunk_size is a size or count"),   # ZeroDivisionError in the forward before
    ("num_partitions=0", "sse.num_partitions is a size or count"),
    ("top_k=9", "mixer 'sse' rejects its settings: need 1 <= top_k <= num_partitions"),
])
def test_convert_checks_settings_before_the_teacher_loads(teacher_dir, tmp_path, monkeypatch, setting, needle):
    import hybridize.convert.sources as sources

    def no_load(*a, **k):
        raise AssertionError("the teacher must not load when the settings are bad")

    monkeypatch.setattr(sources, "load_model", no_load)
    from hybridize.cli import app

    out = tmp_path / "o"
    res = CliRunner().invoke(app, ["convert", "--src", str(teacher_dir), "--out", str(out), "--mixer", "sse",
                                   "--layers", "all", "--mixer-settings", setting])
    assert isinstance(res.exception, UserError), res.output
    assert needle in str(res.exception) and "\n" not in str(res.exception)
    assert not out.exists()


def test_convert_model_type_checks_settings_on_every_route():
    """The library entry (`convert_model`, used by demo and scripts) refuses a wrongly typed setting too,
    instead of storing the truthy string "false"."""
    from hybridize.convert.convert import convert_model

    with pytest.raises(UserError, match='sse.use_rope must be a JSON bool'):
        convert_model(tiny_teacher("llama"), "all", mixer="sse", mixer_settings={"use_rope": "false"})
