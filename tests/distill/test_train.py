"""Training stages on tiny random models: the loss falls on a fixed batch, frozen parameters stay
bit-identical, align trains only mixer parameters, and kill-and-resume repeats the uninterrupted run."""
from __future__ import annotations

import json

import pytest
import torch

from hybridize.distill.align import align
from hybridize.distill.config import AlignConfig, E2EConfig, TrainArgs, load_config
from hybridize.distill.data import pack_docs_exact
from hybridize.distill.e2e import e2e, e2e_loss
from hybridize.distill.loop import run_loop

from .helpers import ToyTokenizer, tiny_llama, toy_convert, write_texts


class FixedData:
    """The same packed batch at every step."""

    def __init__(self, batch):
        self.b = batch

    def batch(self, step, micro):
        return self.b

    def tokens_per_step(self, step):
        return self.b["input_ids"].numel()


def _cfg(cls, tmp_path, name, steps=6, **over):
    data = write_texts(tmp_path / "texts.jsonl")
    base = {"train": {"run_dir": str(tmp_path / name), "max_steps": steps, "progress": False, "save_every": 3,
                      "warmup_steps": 1, "lr": 3e-3},
            "data": {"train": str(data), "seq_len": 24, "batch_tokens": 48}}
    for k, v in over.items():
        base.setdefault(k, {}).update(v) if isinstance(v, dict) else base.__setitem__(k, v)
    return load_config(cls, None, base)


def _losses(run_dir):
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if "loss" in r}


def test_e2e_loss_decreases_on_fixed_batch(tmp_path):
    teacher = tiny_llama(0)
    student = toy_convert(tiny_llama(1), layers=(0, 1))  # another init: a large KL to remove
    g = torch.Generator().manual_seed(0)
    batch = pack_docs_exact([torch.randint(3, 96, (n,), generator=g).tolist() for n in (9, 14, 6)])
    first = float(e2e_loss(student, teacher, batch, ce_weight=0.0)[0])
    train = TrainArgs(run_dir=str(tmp_path / "fixed"), max_steps=25, lr=1e-2, warmup_steps=0, progress=False,
                      save_every=0, scheduler="constant")

    def step_fn(m, b):
        loss, parts = e2e_loss(m, teacher, b, ce_weight=0.0)
        return loss, {}
    res = run_loop(train, student, step_fn, FixedData(batch))
    last = float(e2e_loss(student, teacher, batch, ce_weight=0.0)[0])
    assert last < 0.2 * first, (first, last)
    assert (tmp_path / "fixed" / "loss.png").is_file()
    assert res.step == 25


@pytest.mark.parametrize("params", ["mixer", "mixer_new"])
def test_align_trains_only_mixer_params(tmp_path, params):
    teacher = tiny_llama(0)
    student = toy_convert(teacher, layers=(0, 2), copy_weights=False)
    before = {n: p.detach().clone() for n, p in student.named_parameters()}
    cfg = _cfg(AlignConfig, tmp_path, "align", steps=8, params=params)
    align(student, teacher, ToyTokenizer(), cfg)
    changed = {n for n, p in student.named_parameters() if not torch.equal(p, before[n])}
    if params == "mixer":
        expected = {n for n in before if ".self_attn.mixer." in n and n.split(".")[2] in ("0", "2")}
    else:
        expected = {"model.layers.0.self_attn.mixer.decay", "model.layers.2.self_attn.mixer.decay"}
    assert changed == expected
    losses = _losses(tmp_path / "align")
    if params == "mixer":  # (the decay alone cannot undo random projections)
        assert losses[8] < 0.7 * losses[1], losses
    summary = json.loads((tmp_path / "align" / "trainable.json").read_text())
    assert summary["trainable"] == sum(before[n].numel() for n in expected)
    # the teacher itself never changes
    assert all(not p.requires_grad for p in teacher.parameters())


def test_e2e_frozen_params_stay_bit_identical(tmp_path):
    teacher = tiny_llama(0)
    student = toy_convert(tiny_llama(0), layers=(1,))
    before = {n: p.detach().clone() for n, p in student.named_parameters()}
    cfg = _cfg(E2EConfig, tmp_path, "e2e", steps=4, params="*mlp*,*mixer.decay")
    e2e(student, teacher, ToyTokenizer(), cfg)
    for n, p in student.named_parameters():
        trains = ".mlp." in n or n.endswith("mixer.decay")
        assert torch.equal(p, before[n]) != trains, n
    mix = json.loads((tmp_path / "e2e" / "data.json").read_text())   # the mix in tokens, beside the run
    assert [s["source"] for s in mix["sources"]] == [cfg.data.train] and mix["tokens"] == mix["sources"][0]["tokens"] > 0


def test_pretrained_lr_scale_scales_only_parameters_outside_the_mixers(tmp_path):
    """Adam's first step moves every weight by ~lr: with scale 0.25 the MLP/embedding steps shrink 4x,
    the mixer's stay the same; scale 0 keeps them bit-identical."""
    def first_step(scale, name):
        teacher = tiny_llama(0)
        student = toy_convert(tiny_llama(0), layers=(1,))
        before = {n: p.detach().clone() for n, p in student.named_parameters()}
        cfg = _cfg(E2EConfig, tmp_path, name, steps=1, params="all", pretrained_lr_scale=scale,
                   train={"warmup_steps": 0, "scheduler": "constant", "max_grad_norm": 0.0})
        e2e(student, teacher, ToyTokenizer(), cfg)
        return {n: (p.detach() - before[n]).abs().max().item() for n, p in student.named_parameters()}

    full, quarter, zero = first_step(1.0, "s1"), first_step(0.25, "s25"), first_step(0.0, "s0")
    mixer = [n for n in full if ".self_attn.mixer." in n]
    other = [n for n in full if n not in mixer and full[n] > 0]
    assert mixer and other
    for n in mixer:
        assert quarter[n] == pytest.approx(full[n], rel=1e-4), n
        assert zero[n] == pytest.approx(full[n], rel=1e-4), n
    for n in other:
        assert quarter[n] == pytest.approx(0.25 * full[n], rel=1e-3), n
        assert zero[n] == 0.0, n


@pytest.mark.parametrize("stage", ["e2e", "align"])
def test_kill_and_resume_gives_the_same_next_step_loss(tmp_path, stage):
    cls, fn = (E2EConfig, e2e) if stage == "e2e" else (AlignConfig, align)
    extra = {"train": {"grad_accum": 2}}

    def fresh():
        teacher = tiny_llama(0, tie=True)  # tied embeddings must survive save_state too
        return toy_convert(tiny_llama(5, tie=True), layers=(0, 1)), teacher

    s, t = fresh()
    fn(s, t, ToyTokenizer(), _cfg(cls, tmp_path, "full", **extra))
    s, t = fresh()
    cfg = _cfg(cls, tmp_path, "killed", **extra)
    fn(s, t, ToyTokenizer(), cfg, stop_after=3)  # "killed" after the step-3 checkpoint
    s, t = fresh()
    fn(s, t, ToyTokenizer(), cfg, resume=True)
    full, resumed = _losses(tmp_path / "full"), _losses(tmp_path / "killed")
    assert sorted(resumed) == list(range(1, 7))
    for step in range(1, 7):
        assert resumed[step] == full[step], (step, resumed[step], full[step])


def test_resume_without_checkpoint_starts_fresh(tmp_path):
    s, t = toy_convert(tiny_llama(0), layers=(0,)), tiny_llama(0)
    res = e2e(s, t, ToyTokenizer(), _cfg(E2EConfig, tmp_path, "r", steps=2), resume=True)[0]
    assert res.step == 2 and (tmp_path / "r" / "checkpoints" / "step-000002").is_dir()


def test_nan_loss_stops_with_one_line_error_and_saves_no_diverged_state(tmp_path):
    from hybridize.errors import UserError

    s, t = toy_convert(tiny_llama(0), layers=(0,)), tiny_llama(0)
    with torch.no_grad():
        s.model.layers[0].self_attn.mixer.decay.fill_(float("nan"))
    cfg = _cfg(E2EConfig, tmp_path, "nan", steps=3)
    with pytest.raises(UserError, match="loss is nan at step 0.*no checkpoint was saved before it"):
        e2e(s, t, ToyTokenizer(), cfg)
    assert not (tmp_path / "nan" / "checkpoints" / "step-000000").exists()  # its weights are nan


def test_align_layers_per_step_rotates(tmp_path):
    teacher = tiny_llama(0)
    student = toy_convert(teacher, layers=(0, 2), copy_weights=False)
    cfg = _cfg(AlignConfig, tmp_path, "rot", steps=3, layers_per_step=1)
    align(student, teacher, ToyTokenizer(), cfg)
    rows = [json.loads(x) for x in (tmp_path / "rot" / "metrics.jsonl").read_text().splitlines()]
    assert [sorted(k for k in r if k.startswith("L")) for r in rows] == [["L0"], ["L2"], ["L0"]]
