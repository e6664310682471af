"""benchmarks/generation/compile_auto.py: the arithmetic of its table (the GPU run itself is in RESULTS.md), and the mixer
settings its model builder takes; profile_decode's choice of model."""
import pytest

from benchmarks.generation.compile_auto import add_regret, summarize


def call(i, wall, ms, compiled):
    return {"call": i, "wall_s": wall, "decode_ms": ms, "compiled": compiled}


def test_auto_compiles_midway_and_its_extra_is_over_the_uncompiled_calls_before():
    calls = [call(1, 2.0, 6.0, False), call(2, 2.2, 6.1, False), call(3, 14.0, 4.0, True),
             call(4, 1.0, 4.0, True), call(5, 1.2, 4.2, True)]
    got = summarize("auto", calls)
    assert (got["job_s"], got["first_compiled_call"], got["compile_extra_s"], got["steady_decode_ms"]) == \
        (20.4, 3, 11.9, 4.1)


def test_compiled_from_the_first_call_takes_its_extra_over_the_compiled_calls_after():
    got = summarize("on", [call(1, 15.0, 4.0, True), call(2, 1.0, 4.0, True), call(3, 3.0, 4.4, True)])
    assert (got["first_compiled_call"], got["compile_extra_s"], got["steady_decode_ms"]) == (1, 13.0, 4.2)


def test_never_compiled_has_no_extra_and_its_steady_step_is_every_calls():
    got = summarize("off", [call(1, 2.0, 6.0, False), call(2, 2.0, 5.0, False)])
    assert (got["first_compiled_call"], got["compile_extra_s"], got["steady_decode_ms"]) == (None, None, 5.5)


def test_regret_is_over_the_faster_of_off_and_on():
    rows = [{"mode": "off", "job_s": 40.0}, {"mode": "auto", "job_s": 50.0}]
    add_regret(rows)
    assert rows[1]["regret"] is None   # on has not run yet
    rows.append({"mode": "on", "job_s": 32.0})
    add_regret(rows)
    assert [r["regret"] for r in rows] == [1.25, 1.562, 1.0]


def test_pair_builder_takes_the_converters_mixer_settings():
    """`--mixer-settings` of compile_auto / profile_decode reaches the hybrid's config (a window plan's speed needs
    its window), parsed as `hybridize convert` parses it."""
    import torch

    from benchmarks.generation.compile_auto import args_parser
    from benchmarks.generation.rollouts import build_pair
    from hybridize.convert.cli import parse_settings

    args = args_parser().parse_args(["--shape", "tiny", "--plan", "1:1", "--mixer", "swa",
                                     "--mixer-settings", "swa.window=16", "--mixer-settings", "swa.sinks=2"])
    settings = parse_settings(args.mixer_settings)
    _, hybrid = build_pair("tiny", args.plan, args.mixer, torch.float32, "cpu", settings)
    assert hybrid.config.mixer_settings["swa"]["window"] == 16 and hybrid.config.mixer_settings["swa"]["sinks"] == 2
    _, plain = build_pair("tiny", "1:1", "swa", torch.float32, "cpu")
    assert plain.config.mixer_settings["swa"]["window"] == 512


def test_rows_record_the_kernel_options_in_force(tmp_path, monkeypatch):
    """A row says which kernel switches it ran under (pdl among them): a CPU smoke run with HYBRIDIZE_PDL=0."""
    import json

    from benchmarks.generation.compile_auto import main

    monkeypatch.setenv("HYBRIDIZE_PDL", "0")
    out = tmp_path / "ca.json"
    main(["--shape", "tiny", "--prompt-len", "16", "--new-tokens", "2", "--calls", "1", "--dtype", "float32",
          "--modes", "off", "--out", str(out)])
    got = json.loads(out.read_text())
    assert got["kernel_options"]["pdl"] is False and got["kernel_options"]["kernels"] == "auto"


def test_kernel_options_from_the_command_line_apply_to_the_run_only(tmp_path, monkeypatch):
    """--kernel-options sets switches over the environment's for the run (recorded in its row) and leaves the process's
    options as they were; a bad name or pair is one line."""
    import json

    from benchmarks.generation.compile_auto import main, parse_kernel_options
    from hybridize.ops.common.options import current_kernel_options

    monkeypatch.setenv("HYBRIDIZE_PDL", "0")
    out = tmp_path / "ca.json"
    main(["--shape", "tiny", "--prompt-len", "16", "--new-tokens", "2", "--calls", "1", "--dtype", "float32",
          "--modes", "off", "--kernel-options", "pdl=true, sse_step_finish=false", "--out", str(out)])
    got = json.loads(out.read_text())["kernel_options"]
    assert got["pdl"] is True and got["sse_step_finish"] is False
    assert current_kernel_options().pdl is False and current_kernel_options().sse_step_finish is True
    assert parse_kernel_options("") == {}
    with pytest.raises(SystemExit, match="unknown kernel option 'bogus'"):
        parse_kernel_options("bogus=1")
    with pytest.raises(SystemExit, match="name=value pairs"):
        parse_kernel_options("pdl")
    with pytest.raises(SystemExit, match="expected true/false"):
        parse_kernel_options("pdl=maybe")


def test_rows_record_the_decode_gemm_picks(tmp_path, monkeypatch):
    """A row keeps the decode GEMM config this process picked per weight shape (two processes of the same code can
    pick differently); without triton there are no picks to keep."""
    import importlib.util
    import json

    import torch

    from benchmarks.generation.compile_auto import main

    want = {}
    if importlib.util.find_spec("triton") is not None:
        from hybridize.ops.decode_gemm import triton_gemm

        key = (576, 576, 1, torch.bfloat16, False)
        monkeypatch.setitem(triton_gemm._CHOICE, key, "cublas")
        monkeypatch.setitem(triton_gemm._TIMINGS, key, {"cublas": 0.004})
        want = {"576x576 m=1 bfloat16": {"choice": "cublas", "us": {"cublas": 4.0}}}
    out = tmp_path / "ca.json"
    main(["--shape", "tiny", "--prompt-len", "16", "--new-tokens", "2", "--calls", "1", "--dtype", "float32",
          "--modes", "off", "--out", str(out)])
    assert json.loads(out.read_text())["gemm_choices"] == want


def test_gemm_choices_pinned_from_an_earlier_run(tmp_path, monkeypatch):
    """`--gemm-choices JSON` makes an earlier run's decode GEMM picks this process's (an A/B's rows then run the same
    GEMM kernels); a file without them is one clear line."""
    import json

    import pytest
    import torch

    from benchmarks.generation.compile_auto import main
    from hybridize.ops.decode_gemm import triton_gemm

    monkeypatch.setattr(triton_gemm, "_CHOICE", {})
    monkeypatch.setattr(triton_gemm, "_TIMINGS", {})
    earlier = tmp_path / "earlier.json"
    picks = {"576x576 m=1 bfloat16": {"choice": "BN16_BK256_S1_w4_s4", "us": {"cublas": 4.0}},
             "1536x576 m=8 bfloat16 bias": {"choice": "cublas", "us": {}}}
    earlier.write_text(json.dumps({"gemm_choices": picks}))
    out = tmp_path / "ca.json"
    main(["--shape", "tiny", "--prompt-len", "16", "--new-tokens", "2", "--calls", "1", "--dtype", "float32",
          "--modes", "off", "--gemm-choices", str(earlier), "--out", str(out)])
    got = json.loads(out.read_text())["gemm_choices"]
    assert {k: v["choice"] for k, v in got.items()} == {k: v["choice"] for k, v in picks.items()}
    assert triton_gemm._CHOICE[(576, 576, 1, torch.bfloat16, False)] == dict(BN=16, BK=256, SPLIT=1, num_warps=4,
                                                                               num_stages=4)
    assert triton_gemm._CHOICE[(1536, 576, 8, torch.bfloat16, True)] == "cublas"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"modes": []}))
    with pytest.raises(SystemExit, match="not a compile_auto JSON with gemm_choices"):
        main(["--gemm-choices", str(bad), "--out", str(out)])
    bad.write_text(json.dumps({"gemm_choices": {"576x576 m=1 bfloat16": {"choice": "BN16_fast"}}}))
    with pytest.raises(SystemExit, match="not a decode GEMM config name"):
        main(["--gemm-choices", str(bad), "--out", str(out)])


@pytest.mark.parametrize("model, kinds", [("teacher", {"softmax": 6}), ("hybrid", {"sse": 5, "softmax": 1})])
def test_profile_decode_profiles_either_model_of_the_pair(tmp_path, model, kinds):
    """`profile_decode --model teacher` profiles the pair's teacher on the same engine (no layer converted), the
    default its hybrid: a CPU smoke run of each, its layer kinds and header."""
    import json

    from benchmarks.generation.profile_decode import main

    out = tmp_path / "pd.json"
    main(["--model", model, "--plan", "5:1", "--mixer", "sse", "--batch", "1", "--prompt-len", "16", "--steps", "2",
          "--json", str(out)])
    res = json.loads(out.read_text())
    assert res["layers"] == kinds
    assert ("the teacher" in res["header"]) == (model == "teacher")
