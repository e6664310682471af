"""The short layer-local alignment behind the kl / needle scores: EVERY layer is converted once (as
`hybridize convert --layers all` would, output gains calibrated), and all mixers are trained together for a
few steps on stage A's loss (`hybridize.distill.align`: each mixer reproduces its teacher attention's output
from the teacher's own inputs, nMSE). Layers never see each other in stage A, so one run of N steps gives
each layer the mixer it would get from N steps alone: L alignments for the price of one teacher forward
per step. The aligned slots are saved (`OUT/aligned.safetensors`, atomically) so a rerun skips this.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.nn as nn

from hybridize.convert.calibrate import calibration_inputs
from hybridize.convert.convert import convert_model
from hybridize.distill.align import LayerAligner, TeacherTap
from hybridize.distill.models import converted_layers, select_trainable
from .probe import amp

WARMUP_STEPS = 10
ALIGN_STATE = "aligned.safetensors"


def converted_slots(teacher: nn.Module, tokenizer, mixer: str, settings: dict, seed: int) -> dict[int, nn.Module]:
    """{layer: mixer slot} of the teacher converted whole (calibrated gains), each slot's mixer parameters
    trainable; the rest of the hybrid is dropped."""
    hybrid = convert_model(teacher, "all", mixer=mixer, mixer_settings=settings, seed=seed,
                           calibration_inputs=calibration_inputs(teacher, tokenizer))
    select_trainable(hybrid, "mixer")
    return dict(converted_layers(hybrid))


def align_slots(teacher: nn.Module, slots: dict[int, nn.Module], data, steps: int, lr: float, device: str,
                progress: bool = True) -> dict[int, float]:
    """Train every slot for `steps` steps (AdamW, warm-up then cosine, grad-norm clip 1). Returns each layer's
    nMSE averaged over the last 10 steps (1.0 = as far from the teacher as predicting zero)."""
    from tqdm.auto import trange
    from transformers import get_cosine_schedule_with_warmup

    if steps == 0:
        return {}
    params = [p for s in slots.values() for p in s.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = get_cosine_schedule_with_warmup(opt, min(WARMUP_STEPS, steps // 10), steps)
    aligner = LayerAligner(slots, "nmse").train()
    tap = TeacherTap(teacher, sorted(slots))
    tail: dict[int, list[float]] = {i: [] for i in slots}
    try:
        for step in trange(steps, desc="align mixers", disable=not progress):
            batch = {k: v.to(device) for k, v in data.batch(step, 0).items()}
            with amp(device):
                loss, per = aligner(tap.run(batch))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            if step >= steps - 10:
                for i in slots:
                    tail[i].append(float(per[i].detach()))
    finally:
        tap.close()
        aligner.eval()
    return {i: sum(v) / len(v) for i, v in tail.items()}


def save_slots(slots: dict[int, nn.Module], path: Path) -> None:
    """Every slot tensor, as `<layer>.<name>`, written to a temporary file and renamed into place."""
    from safetensors.torch import save_file

    state = {f"{i}.{k}": v.detach().float().cpu().contiguous() for i, s in slots.items()
             for k, v in s.state_dict().items()}
    tmp = path.with_name(path.name + ".tmp")
    save_file(state, str(tmp))
    os.replace(tmp, path)


def load_slots(slots: dict[int, nn.Module], path: Path) -> None:
    from safetensors.torch import load_file

    state = load_file(str(path))
    for i, s in slots.items():
        prefix = f"{i}."
        own = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        s.load_state_dict(own)
