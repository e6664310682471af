"""Kernel options (`hybridize.ops.common.options`): the environment read in one place, the options object deciding
dispatch's path as the variables did, carried on the model's config.json, recorded in a run's config.yaml.
CPU only: paths are checked by which function dispatch picks, not by running GPU kernels."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from hybridize.errors import UserError
from hybridize.ops.common import dispatch, options, registry
from hybridize.ops.sse import reference as sse
from hybridize.ops.common.options import KernelOptions, current_kernel_options, use_kernel_options

ENV = {f.metadata["env"]: f.name for f in __import__("dataclasses").fields(KernelOptions) if f.metadata["env"]}


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    """No HYBRIDIZE_* kernel variable and no explicit options from elsewhere."""
    for var in ENV:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(options, "_CURRENT", None)


# ---- from_env ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("var,raw,value", [
    ("HYBRIDIZE_KERNELS", "torch", "torch"),
    ("HYBRIDIZE_KERNELS", "gpu", "gpu"),
    ("HYBRIDIZE_AUTOTUNE_TOP", "2", 2),
    ("HYBRIDIZE_CCQ_PRODUCTS", "split", "split"),
    ("HYBRIDIZE_CCQ_ROWS", "64", 64),
    ("HYBRIDIZE_CCQ_SEGMENT", "0", 0),
    ("HYBRIDIZE_CCQ_SEGMENT", "300", 300),
    ("HYBRIDIZE_CCQ_TUNE_TOP", "1", 1),
    ("HYBRIDIZE_FLA_DQKWG", "fla", "fla"),
    ("HYBRIDIZE_GLA_PRODUCTS", "split", "split"),
    ("HYBRIDIZE_GLA_ROWS", "256", 256),
    ("HYBRIDIZE_GLA_TUNE_TOP", "1", 1),
    ("HYBRIDIZE_SSE_GLA_PIECES", "0", False),
    ("HYBRIDIZE_SSE_GLA_GATHER", "on", "on"),
    ("HYBRIDIZE_SSE_GLA_GATHER", "0", "off"),
    ("HYBRIDIZE_SSE_FUSED_STEP", "0", False),
    ("HYBRIDIZE_SSE_STEP_FINISH", "0", False),
    ("HYBRIDIZE_WINDOW_STEP", "0", False),
    ("HYBRIDIZE_SSE_FUSED_PREFILL", "0", False),
    ("HYBRIDIZE_PDL", "0", False),
    ("HYBRIDIZE_SSE_MERGED_LOWRANK", "on", "on"),
    ("HYBRIDIZE_SSE_MERGED_LOWRANK", "1", "on"),
])
def test_from_env_parses_each_variable(var, raw, value, monkeypatch):
    field = ENV[var]
    assert getattr(KernelOptions.from_env({}), field) != value          # not the default
    assert getattr(KernelOptions.from_env({var: raw}), field) == value
    monkeypatch.setenv(var, raw)                                         # the process environment, read live
    assert getattr(current_kernel_options(), field) == value
    others = {k: v for k, v in current_kernel_options().to_dict().items() if k != field}
    assert others == {k: v for k, v in KernelOptions().to_dict().items() if k != field}


def test_every_variable_is_covered_and_unset_or_empty_gives_the_defaults():
    assert set(ENV) == {"HYBRIDIZE_KERNELS", "HYBRIDIZE_AUTOTUNE_TOP", "HYBRIDIZE_CCQ_PRODUCTS", "HYBRIDIZE_CCQ_ROWS",
                        "HYBRIDIZE_CCQ_SEGMENT", "HYBRIDIZE_CCQ_TUNE_TOP", "HYBRIDIZE_FLA_DQKWG",
                        "HYBRIDIZE_GLA_PRODUCTS", "HYBRIDIZE_GLA_ROWS", "HYBRIDIZE_GLA_DG_ANCHOR",
                        "HYBRIDIZE_SSE_GLA_PIECES", "HYBRIDIZE_SSE_GLA_GATHER", "HYBRIDIZE_GLA_TUNE_TOP",
                        "HYBRIDIZE_SSE_FUSED_STEP", "HYBRIDIZE_WINDOW_STEP", "HYBRIDIZE_SSE_FUSED_PREFILL",
                        "HYBRIDIZE_PDL", "HYBRIDIZE_SSE_MERGED_LOWRANK", "HYBRIDIZE_SSE_STEP_FINISH",
                        "HYBRIDIZE_SSE_STEP_LOWRANK"}
    assert KernelOptions.from_env({}) == KernelOptions() == KernelOptions.from_env({v: "" for v in ENV})
    d = KernelOptions().to_dict()
    assert d["kernels"] == "auto" and d["ccq_rows"] == 128 and d["gla_rows"] == 512 and d["ccq_segment"] is None
    assert d["sse_gla_pieces"] and d["sse_triton"] and d["sse_fused_step"] and d["window_step"] and d["sse_step_finish"]
    assert not d["force_triton"] and d["pdl"] and d["sse_merged_lowrank"] == "auto"
    assert d["sse_step_lowrank"] == "auto"
    assert all(help_ for _, _, _, help_ in KernelOptions.describe())


@pytest.mark.parametrize("var,raw", [
    ("HYBRIDIZE_KERNELS", "cuda"), ("HYBRIDIZE_AUTOTUNE_TOP", "many"), ("HYBRIDIZE_AUTOTUNE_TOP", "-1"),
    ("HYBRIDIZE_CCQ_PRODUCTS", "fast"), ("HYBRIDIZE_CCQ_ROWS", "0"), ("HYBRIDIZE_CCQ_SEGMENT", "1.5"),
    ("HYBRIDIZE_CCQ_TUNE_TOP", "x"), ("HYBRIDIZE_FLA_DQKWG", "ours"), ("HYBRIDIZE_GLA_PRODUCTS", "tf32"),
    ("HYBRIDIZE_GLA_ROWS", "lots"), ("HYBRIDIZE_GLA_DG_ANCHOR", "-16"), ("HYBRIDIZE_SSE_GLA_PIECES", "maybe"),
    ("HYBRIDIZE_SSE_FUSED_STEP", "sometimes"), ("HYBRIDIZE_WINDOW_STEP", "2"), ("HYBRIDIZE_SSE_FUSED_PREFILL", "x"),
    ("HYBRIDIZE_PDL", "yes please"), ("HYBRIDIZE_SSE_MERGED_LOWRANK", "sometimes"),
    ("HYBRIDIZE_SSE_STEP_LOWRANK", "gemm"),
])
def test_bad_value_is_one_clear_line(var, raw, monkeypatch):
    with pytest.raises(UserError) as e:
        KernelOptions.from_env({var: raw})
    msg = str(e.value)
    assert len(msg.splitlines()) == 1 and var in msg and f"kernel_options.{ENV[var]}" in msg and raw in msg
    monkeypatch.setenv(var, raw)      # the first kernel call that reads the options says the same
    with pytest.raises(UserError, match=var):
        current_kernel_options()


def test_explicit_options_beat_the_environment_and_are_restored(monkeypatch):
    monkeypatch.setenv("HYBRIDIZE_KERNELS", "torch")
    monkeypatch.setenv("HYBRIDIZE_CCQ_ROWS", "64")
    with use_kernel_options(kernels="gpu") as opts:
        assert current_kernel_options() is opts and opts.kernels == "gpu" and opts.ccq_rows == 64
        with use_kernel_options({"ccq_rows": 32}):
            assert (current_kernel_options().kernels, current_kernel_options().ccq_rows) == ("gpu", 32)
        assert current_kernel_options().ccq_rows == 64
    assert current_kernel_options().kernels == "torch"
    with pytest.raises(UserError, match="unknown kernel option 'kernel'"):
        options.resolve_kernel_options({"kernel": "torch"})
    with pytest.raises(UserError, match="kernel_options.kernels"):
        options.resolve_kernel_options({"kernels": "cuda"})


# ---- dispatch: the same path from the options as from the variable -------------------------------------

class _FakeCuda:
    """Stands in for a CUDA tensor: dispatch only asks `is_cuda`."""
    is_cuda = True


@pytest.fixture
def fake_ops(monkeypatch):
    monkeypatch.setattr(dispatch, "_gpu_tried", True)   # no fla adapter import
    monkeypatch.setitem(registry._GPU, ("gla", "chunk"), lambda *a, **k: "gpu")
    monkeypatch.setitem(registry._TORCH, ("gla", "chunk"), lambda *a, **k: "torch")
    monkeypatch.setitem(registry._TORCH, ("delta", "chunk"), lambda *a, **k: "torch")
    monkeypatch.delitem(registry._GPU, ("delta", "chunk"), raising=False)


@pytest.mark.parametrize("backend,gla,delta", [("auto", "gpu", "torch"), ("torch", "torch", "torch"),
                                               ("gpu", "gpu", RuntimeError)])
def test_dispatch_path_from_options_equals_from_env(backend, gla, delta, fake_ops, monkeypatch):
    def paths():
        out = [dispatch.run("gla", "chunk", _FakeCuda()), dispatch.get_backend()]
        try:
            out.append(dispatch.run("delta", "chunk", _FakeCuda()))
        except RuntimeError as e:
            assert "kernels=auto" in str(e)
            out.append(RuntimeError)
        return out

    monkeypatch.setenv("HYBRIDIZE_KERNELS", backend)
    from_env = paths()
    monkeypatch.delenv("HYBRIDIZE_KERNELS")
    monkeypatch.setenv("HYBRIDIZE_KERNELS", "torch" if backend != "torch" else "auto")   # overridden below
    with use_kernel_options(kernels=backend):
        from_options = paths()
    assert from_env == from_options == [gla, backend, delta]
    assert dispatch.run("gla", "chunk", torch.zeros(1)) == "torch"   # CPU tensors: always the PyTorch form


def test_set_backend_sets_the_option():
    dispatch.set_backend("torch")
    assert current_kernel_options().kernels == "torch" and dispatch.get_backend() == "torch"
    with pytest.raises(ValueError):
        dispatch.set_backend("cuda")


def test_sse_switches_follow_the_options(monkeypatch):
    """SSE's pieces-GLA choice and its Triton row movers / decode step: the options decide as the variable and
    the old module globals (`USE_TRITON`, `FORCE_TRITON`) did."""
    monkeypatch.setattr(options, "importlib", SimpleNamespace(util=SimpleNamespace(find_spec=lambda name: object())))
    bf16_cuda = SimpleNamespace(q=SimpleNamespace(is_cuda=True, dtype=torch.bfloat16), g=object())
    assert sse._gla_in_pieces("gla", bf16_cuda)
    monkeypatch.setenv("HYBRIDIZE_SSE_GLA_PIECES", "0")
    assert not sse._gla_in_pieces("gla", bf16_cuda)
    monkeypatch.delenv("HYBRIDIZE_SSE_GLA_PIECES")
    with use_kernel_options(sse_gla_pieces=False):
        assert not sse._gla_in_pieces("gla", bf16_cuda)
    with use_kernel_options(kernels="torch"):
        assert not sse._gla_in_pieces("gla", bf16_cuda)

    cuda_x = SimpleNamespace(is_cuda=True, dtype=torch.float32)
    cpu_x = torch.zeros(1)
    assert sse._triton_ok(cuda_x) and not sse._triton_ok(cpu_x)
    with use_kernel_options(sse_triton=False):
        assert not sse._triton_ok(cuda_x)
    with use_kernel_options(force_triton=True):
        assert sse._triton_ok(cpu_x)
    with use_kernel_options(kernels="torch", force_triton=True):
        assert not sse._triton_ok(cpu_x)


# ---- the model: config.json carries the explicit options, the forward puts them in force ----------------

def _tiny_hybrid():
    from hybridize.convert.convert import convert_model
    from tests.convert.common import tiny_teacher

    return convert_model(tiny_teacher("llama"), ["deltanet", "attn", "deltanet"], mixer="deltanet").eval()


def _seen_options(monkeypatch) -> list:
    seen = []

    def spy():
        opts = options.current_kernel_options()
        seen.append(opts)
        return opts
    monkeypatch.setattr(dispatch, "current_kernel_options", spy)
    return seen


def test_model_config_round_trip_and_forward_uses_its_options(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    model = _tiny_hybrid()
    assert model.config.kernel_options == {}
    ids = torch.randint(3, 50, (1, 9))
    seen = _seen_options(monkeypatch)
    monkeypatch.setenv("HYBRIDIZE_CCQ_ROWS", "64")
    with torch.no_grad():
        want = model(ids).logits
    assert seen and {o.ccq_rows for o in seen} == {64} and {o.kernels for o in seen} == {"auto"}

    model.config.kernel_options = {"kernels": "torch", "ccq_rows": 32}
    model.save_pretrained(tmp_path / "m")
    saved = json.loads((tmp_path / "m" / "config.json").read_text())
    assert saved["kernel_options"] == {"kernels": "torch", "ccq_rows": 32}
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    assert loaded.config.kernel_options == {"kernels": "torch", "ccq_rows": 32}
    seen.clear()
    with torch.no_grad():
        got = loaded(ids).logits
    assert seen and {(o.kernels, o.ccq_rows) for o in seen} == {("torch", 32)}   # explicit config > environment
    torch.testing.assert_close(got, want)
    assert current_kernel_options().ccq_rows == 64 and options._CURRENT is None   # restored after the forward

    # a config.json written before the field loads (as "nothing explicit"); a bad value is one line
    del saved["kernel_options"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(saved))
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "m").config.kernel_options == {}
    saved["kernel_options"] = {"kernels": "cuda"}
    (tmp_path / "m" / "config.json").write_text(json.dumps(saved))
    with pytest.raises(UserError, match="kernel_options.kernels: must be one of auto"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "m")


# ---- a run's config.yaml -------------------------------------------------------------------------------

from tests.distill.test_lost_work import _distill, folders  # noqa: E402,F401 (the tiny CLI run and its fixture)


def test_distill_run_records_and_uses_kernel_options(folders, tmp_path, monkeypatch):  # noqa: F811
    import yaml

    seen = _seen_options(monkeypatch)
    monkeypatch.setenv("HYBRIDIZE_CCQ_TUNE_TOP", "3")
    run = tmp_path / "run"
    r = _distill(folders, run, "train.max_steps=1", "kernel_options.ccq_rows=64", "kernel_options.kernels=torch")
    assert r.exit_code == 0, r.output + repr(r.exception)
    recorded = yaml.safe_load((run / "config.yaml").read_text())["kernel_options"]
    assert recorded == {**KernelOptions().to_dict(), "ccq_rows": 64, "kernels": "torch", "ccq_tune_top": 3}
    assert seen and {(o.kernels, o.ccq_rows, o.ccq_tune_top) for o in seen} == {("torch", 64, 3)}
    assert options._CURRENT is None
    # a --resume may change them; a bad one fails at parse time in one line
    r = _distill(folders, run, "train.max_steps=2", "kernel_options.ccq_rows=32", "--resume")
    assert r.exit_code == 0, r.output + repr(r.exception)
    assert yaml.safe_load((run / "config.yaml").read_text())["kernel_options"]["ccq_rows"] == 32
    r = _distill(folders, tmp_path / "bad", "train.max_steps=1", "kernel_options.kernels=cuda")
    assert r.exit_code != 0 and isinstance(r.exception, UserError) and "kernel_options.kernels" in str(r.exception)


def test_grpo_run_records_and_uses_kernel_options(tmp_path, monkeypatch):
    import yaml
    from typer.testing import CliRunner

    from tests.rl.helpers import tiny_hybrid, write_problems
    from tests.rl.test_cli import _app

    tiny_hybrid(tmp_path / "m", mixer="gla")
    write_problems(tmp_path / "p.jsonl")
    seen = _seen_options(monkeypatch)
    args = ["grpo", "--model", str(tmp_path / "m"), "--output-dir", str(tmp_path / "run"),
            f"data.train=[{tmp_path / 'p.jsonl'}]", "grpo.num_generations=4", "grpo.per_device_train_batch_size=4",
            "grpo.max_completion_length=8", "grpo.max_steps=1", "save_steps=0", "progress=false",
            "kernel_options.gla_rows=512"]
    r = CliRunner().invoke(_app(), args)
    assert r.exit_code == 0, (r.output, r.exception)
    recorded = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["kernel_options"]
    assert recorded == {**KernelOptions().to_dict(), "gla_rows": 512}
    assert seen and {o.gla_rows for o in seen} == {512} and options._CURRENT is None
    r = CliRunner().invoke(_app(), args[:-1] + ["kernel_options.gla_rows=0"])
    assert r.exit_code != 0 and "kernel_options.gla_rows: must be >= 1" in str(r.exception)


def test_an_auto_switch_takes_booleans_as_on_and_off():
    """sse_merged_lowrank was a bool before it had "auto": a config or variable that set it so still works."""
    assert KernelOptions(sse_merged_lowrank=False).sse_merged_lowrank == "off"
    assert KernelOptions(sse_merged_lowrank=True).sse_merged_lowrank == "on"
    assert KernelOptions.from_env({"HYBRIDIZE_SSE_MERGED_LOWRANK": "0"}).sse_merged_lowrank == "off"
    assert KernelOptions(sse_merged_lowrank="auto").sse_merged_lowrank == "auto"
    with pytest.raises(UserError, match="on \\| off"):
        KernelOptions(sse_merged_lowrank="sometimes")
