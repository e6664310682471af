"""Issue 29: `--resume` and `export` of a DeepSpeed checkpoint never unpickle code. DeepSpeed's own loaders
(`engine.load_checkpoint`, `zero_to_fp32`) call `torch.load(weights_only=False)`, so
`checkpoint.check_deepspeed_pickles` first opens every pickle of the checkpoint weights-only, allowing only
the plain-data classes real ZeRO-2/3 checkpoints hold.

One subprocess (`python tests/distill/test_deepspeed_safe_load.py worker DIR`; DeepSpeed initialises
torch.distributed and accelerate's process-wide state, see test_scale.py) runs a one-process ZeRO-2 stage B
on a tiny hybrid, stopped after step 1 and resumed, exports it, then replaces one checkpoint file at a time
by a pickle whose unpickling creates a marker file, and tries `--resume` and `export` on it.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from tests.distill.test_scale import HAS_DS, RECIPES, run_worker

PARTS = ["pytorch_model/mp_rank_00_model_states.pt", "pytorch_model/zero_pp_rank_0_mp_rank_00_optim_states.pt"]
pytestmark = pytest.mark.skipif(not HAS_DS, reason="deepspeed is not installed (pip install deepspeed)")


@pytest.fixture(scope="module")
def res(tmp_path_factory):
    return run_worker(__file__, tmp_path_factory.mktemp("ds_safe"))


def test_zero2_checkpoint_resumes_and_exports(res):
    """The safe check accepts a real ZeRO-2 checkpoint (and the DeepSpeed classes allowed are enough)."""
    assert res["payload_is_live"]  # the payload does create the marker when unpickled freely
    assert res["resumed_steps"] == [1, 2], res
    assert res["deepspeed_unpickled"] == sorted(Path(p).name for p in PARTS)  # the spy sees DeepSpeed's loads
    assert res["export"] == "ok", res
    assert res["allowlist"] == {"zero2_optim_states": "ok", "fp16_dynamic_loss_scaler": "ok",
                                "functools.partial": "refused", "builtins.eval": "refused"}, res["allowlist"]


@pytest.mark.parametrize("part", PARTS)
@pytest.mark.parametrize("action", ["resume", "export"])
def test_pickled_payload_in_a_deepspeed_checkpoint_is_refused(res, action, part):
    out = res[f"{action}:{part}"]
    msg, ckpt = out["error"], out["checkpoint"]
    assert out["type"] == "UserError" and "\n" not in msg, out
    assert msg.startswith(f"refusing to load {ckpt}/{part}: it holds pickled objects other than tensors and "
                          "plain data (it builds io.open)"), msg
    assert not out["marker"]  # the payload never ran
    assert out["loaded"] is False  # and DeepSpeed's loaders never opened the folder


def _worker(tmp: Path) -> None:
    import functools
    import shutil

    import deepspeed.comm.torch as ds_comm
    from accelerate.state import AcceleratorState
    from deepspeed.runtime.fp16.loss_scaler import CreateLossScaler

    from hybridize.distill.checkpoint import check_deepspeed_pickles
    from hybridize.distill.export import export_checkpoint
    from hybridize.errors import UserError
    from tests.distill.test_lost_work import plant_payload, spy_free_unpickles
    from tests.distill.test_scale import e2e_config, make_student_folder, run_e2e

    ds_comm.build_shm_op = lambda: None  # see test_scale._worker
    torch.set_num_threads(1)
    opened, real_load = spy_free_unpickles()  # every file unpickled freely (DeepSpeed's loaders)

    marker, live = plant_payload(tmp)
    res = {"payload_is_live": live}

    folder = make_student_folder(tmp / "student")
    cfg = e2e_config(tmp, "run", folder, steps=2, params="all",
                     train={"deepspeed": str(RECIPES / "ds_zero2.json")})
    run_e2e(cfg, stop_after=1)  # killed after step 1 (checkpoint written)
    AcceleratorState._reset_state(True)
    opened.clear()
    losses, _ = run_e2e(cfg, resume=True)
    AcceleratorState._reset_state(True)
    res["resumed_steps"], res["deepspeed_unpickled"] = sorted(losses), sorted({Path(f).name for f in opened})
    export_checkpoint(tmp / "run", tmp / "export")
    res["export"] = "ok"

    ckpt = tmp / "run" / "checkpoints" / "step-000002"
    probe = tmp / "probe"
    probe.mkdir()

    def verdict(obj):
        torch.save(obj, probe / "x.pt")
        try:
            check_deepspeed_pickles(probe)
            return "ok"
        except UserError:
            return "refused"
    optim = real_load(ckpt / PARTS[1], weights_only=False)
    dyn = CreateLossScaler(torch.half, 0, True, {"init_scale": 2.0 ** 16, "scale_window": 1000, "min_scale": 1,
                                                 "delayed_shift": 2, "consecutive_hysteresis": False})
    res["allowlist"] = {"zero2_optim_states": verdict(optim),
                        "fp16_dynamic_loss_scaler": verdict({"loss_scaler": dyn}),
                        "functools.partial": verdict(functools.partial(print, "hi")),
                        "builtins.eval": verdict({"f": eval})}

    for part in PARTS:
        original = (ckpt / part).read_bytes()
        shutil.copy(tmp / "payload.pt", ckpt / part)
        for action in ("resume", "export"):
            opened.clear()
            try:
                if action == "resume":
                    run_e2e(cfg, resume=True)
                else:
                    export_checkpoint(ckpt, tmp / "export_bad")
                out = {"type": "none", "error": ""}
            except Exception as e:  # noqa: BLE001 - the test reports what came out
                out = {"type": type(e).__name__, "error": str(e)}
            AcceleratorState._reset_state(True)
            res[f"{action}:{part}"] = {**out, "checkpoint": str(ckpt), "marker": marker.exists(),
                                       "loaded": bool(opened)}
            marker.unlink(missing_ok=True)
        (ckpt / part).write_bytes(original)
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "worker":
    _worker(Path(sys.argv[2]))
