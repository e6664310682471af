"""Layer plans: every accepted spelling against hand-written expectations, and one-line errors."""
from __future__ import annotations

import pytest

from hybridize.convert.plan import PLAN_FORMS, parse_plan, plan_summary, plan_table

A = "attn"


def test_ratio_five_to_one_on_30_layers():
    plan = parse_plan("5:1", 30, "sse")
    assert [i for i, k in enumerate(plan) if k == A] == [5, 11, 17, 23, 29]
    assert all(k == "sse" for i, k in enumerate(plan) if i not in (5, 11, 17, 23, 29))


@pytest.mark.parametrize("spec,n,expected", [
    ("2:1", 7, ["gla", "gla", A, "gla", "gla", A, "gla"]),
    ("1:2", 5, ["gla", A, A, "gla", A]),
    (" 3 : 1 ", 4, ["gla", "gla", "gla", A]),
])
def test_ratio(spec, n, expected):
    assert parse_plan(spec, n, "gla") == expected


def test_repeating_pattern():
    plan = parse_plan("sse,swa,sse,swa,attn", 12, "gla")
    assert plan == ["sse", "swa", "sse", "swa", A] * 2 + ["sse", "swa"]
    assert parse_plan("gla", 3, "sse") == ["gla"] * 3
    assert parse_plan("softmax,GDN", 4, "sse") == [A, "gdn", A, "gdn"]  # aliases, case


def test_explicit_indices():
    plan = parse_plan("attn=5,11,17", 20, "sse")
    assert [i for i, k in enumerate(plan) if k == A] == [5, 11, 17]
    assert set(plan) == {A, "sse"}
    assert parse_plan("attn=0-1,-1", 5, "gla") == [A, A, "gla", "gla", A]
    assert parse_plan("attn=4;swa=1,2", 5, "gla") == ["gla", "swa", "swa", "gla", A]


def test_per_layer():
    plan = parse_plan("0-3:gla,4:attn,5-29:sse", 30, "gdn")
    assert plan[:4] == ["gla"] * 4 and plan[4] == A and plan[5:] == ["sse"] * 25
    assert parse_plan("1:gla", 3, "sse") == [A, "gla", A]  # unlisted layers stay softmax


def test_all_and_none():
    assert parse_plan("all", 3, "deltanet") == ["deltanet"] * 3
    assert parse_plan("NONE", 3, "deltanet") == [A] * 3
    with pytest.raises(ValueError, match="converts none of the 3 layers"):
        parse_plan("none", 3, "deltanet", allow_none=False)


@pytest.mark.parametrize("spec,needle", [
    ("0:5", "converts nothing"),
    ("5:0", "write 'all'"),
    ("0:1", "converts nothing"),
    ("attn", "converts none of the 6 layers"),
    ("attn=0-5", "converts none of the 6 layers"),
    ("0-2:attn", "converts none of the 6 layers"),
])
def test_plans_with_a_zero_ratio_part_or_no_converted_layer_are_refused(spec, needle):
    """Issue 29: '0:5' converted nothing and '5:0' was accepted, both with exit 0."""
    with pytest.raises(ValueError) as e:
        parse_plan(spec, 6, "sse")
    msg = str(e.value)
    assert needle in msg and "\n" not in msg and PLAN_FORMS in msg


@pytest.mark.parametrize("spec", ["0:5", "5:0", "none"])
def test_convert_cli_refuses_a_plan_that_converts_nothing(tmp_path, spec):
    from typer.testing import CliRunner

    from hybridize.cli import app
    from tests.convert.common import tiny_teacher

    tiny_teacher("llama").save_pretrained(tmp_path / "t")
    res = CliRunner().invoke(app, ["convert", "--src", str(tmp_path / "t"), "--layers", spec,
                                   "--out", str(tmp_path / "o")])
    assert res.exit_code != 0 and isinstance(res.exception, ValueError), res.output
    assert "bad layer plan" in str(res.exception) and PLAN_FORMS in str(res.exception)
    assert not (tmp_path / "o").exists()


def test_summary_round_trips():
    plan = parse_plan("sse,swa,attn", 10, "gla")
    assert parse_plan(plan_summary(plan), 10, "gla") == plan


def test_table_lists_runs():
    from rich.console import Console

    console = Console(width=100, record=True)
    console.print(plan_table(parse_plan("5:1", 12, "sse")))
    text = console.export_text()
    assert "0-4" in text and "softmax (kept)" in text and "10 of 12 layers converted" in text


@pytest.mark.parametrize("spec", [
    "", "5:", ":1", "0:0", "foo", "sse,,attn", "attn=", "attn=1,x", "attn=40", "attn=3-1",
    "attn=1,1", "0-3:gla,3:sse", "0-3:nope", "12:gla", "attn=1 sse", "5:1:2",
])
def test_malformed_plans_give_one_line_errors(spec):
    with pytest.raises(ValueError) as e:
        parse_plan(spec, 10, "sse")
    msg = str(e.value)
    assert "\n" not in msg and repr(spec) in msg and PLAN_FORMS in msg


def test_unknown_default_mixer():
    with pytest.raises(ValueError, match="unknown mixer"):
        parse_plan("5:1", 10, "mamba")
