"""`hybridize eval needle-attention`: where a converted model loses needle retrieval, layer by layer.

A hybrid that keeps the teacher's softmax layers can still lose S-NIAH retrieval, because the queries and
keys those layers see come from hidden states that the converted layers below them changed. This diagnostic
runs the teacher and the hybrid side by side on S-NIAH prompts (`hybridize.convert.select.needle`, answer
teacher-forced; S-NIAH-1, RULER's single needle in repeated noise, by default; `task` s-niah-2 / -3 put a number
or a UUID in essays) and reports, for every layer the hybrid kept as softmax attention:

- the teacher's most retrieving head there and its needle mass: the share of attention that the positions
  copying the answer put on the needle's value tokens (the measure of `hybridize select`'s retrieval
  criterion, `hybridize.convert.select.retrieval`);
- the hybrid's mass at that same head, and at its own most retrieving head;

and, for both models, the answer's mean log-probability and top-1 accuracy at the answer positions. A kept
layer whose mass collapses says the converted layers below it corrupt what it reads; masses that hold while
the answer's probability falls point at the layers after it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from hybridize.convert.select.needle import needle_prompts
from hybridize.convert.select.probe import amp
from hybridize.convert.select.retrieval import needle_mass
from hybridize.distill.models import decoder_layers
from hybridize.errors import UserError


@dataclass
class NeedleAttentionConfig:
    length: int = 2048        # prompt tokens (the needle and its haystack)
    samples: int = 8          # prompts, needle depths spread evenly
    task: str = "s-niah-1"    # s-niah-1 / -2 / -3 (hybridize.eval.niah's tasks)


def softmax_layers(model: nn.Module) -> list[int]:
    """The layers of `model` that run softmax attention: all of a plain Transformer's, a hybrid's `attn` slots."""
    kept = getattr(model.config, "softmax_layers", None)   # HybridConfig's
    return list(range(len(decoder_layers(model)))) if kept is None else list(kept)


@torch.no_grad()
def needle_stats(model: nn.Module, prompts, layers: list[int], device) -> dict:
    """{"mass": {layer: [H] mean needle mass per head}, "answer_logprob", "answer_top1"} over `prompts`."""
    total = {i: None for i in layers}
    logprob, top1, n = 0.0, 0, 0
    with needle_mass(model, layers) as nm:
        for p in prompts:
            nm.aim(p)
            ids = torch.tensor([p.input_ids], device=device)
            with amp(device):
                hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state
                logits = model.lm_head(hidden[0, p.answer_positions]).float()   # [A, V]
            targets = ids[0, [q + 1 for q in p.answer_positions]]
            logprob += logits.log_softmax(-1).gather(-1, targets[:, None]).sum().item()
            top1 += int((logits.argmax(-1) == targets).sum())
            n += len(targets)
            for i in layers:
                total[i] = nm.mass[i] if total[i] is None else total[i] + nm.mass[i]
    return {"mass": {i: (total[i] / len(prompts)).tolist() for i in layers},
            "answer_logprob": logprob / n, "answer_top1": top1 / n}


def compare(teacher: nn.Module, hybrid: nn.Module, tokenizer, cfg: NeedleAttentionConfig, device) -> dict:
    """The report's rows: per softmax layer of the hybrid, the teacher's best head and both models' masses."""
    layers = softmax_layers(hybrid)
    if not layers:
        raise UserError("the model keeps no softmax attention layer: nothing to compare (needle-attention reads "
                        "the kept layers' attention)")
    if len(decoder_layers(teacher)) != len(decoder_layers(hybrid)):
        raise UserError("teacher and model have different layer counts: pass the model's own teacher")
    prompts = needle_prompts(tokenizer, cfg.length, cfg.samples, cfg.task, flag="--length")
    t, h = needle_stats(teacher, prompts, layers, device), needle_stats(hybrid, prompts, layers, device)
    rows = []
    for i in layers:
        tm, hm = torch.tensor(t["mass"][i]), torch.tensor(h["mass"][i])
        head = int(tm.argmax())
        rows.append({"layer": i, "teacher_head": head, "teacher_mass": float(tm[head]),
                     "model_mass_same_head": float(hm[head]), "model_head": int(hm.argmax()),
                     "model_mass": float(hm.max())})
    return {"task": cfg.task, "length": cfg.length, "samples": cfg.samples, "layers": rows,
            "teacher": {"answer_logprob": t["answer_logprob"], "answer_top1": t["answer_top1"]},
            "model": {"answer_logprob": h["answer_logprob"], "answer_top1": h["answer_top1"]}}


def markdown(rep: dict) -> str:
    task = rep.get("task", "s-niah-1").upper()   # reports written before `task` was a field: S-NIAH-1
    lines = [f"{task} needle mass (share of attention from the answer positions on the needle's value), "
             f"{rep['samples']} prompts of {rep['length']} tokens, answer teacher-forced.", "",
             "| kept layer | teacher head | teacher mass | model, same head | model head | model mass |",
             "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rep["layers"]:
        lines.append(f"| {r['layer']} | {r['teacher_head']} | {r['teacher_mass']:.3f} | {r['model_mass_same_head']:.3f} "
                     f"| {r['model_head']} | {r['model_mass']:.3f} |")
    t, m = rep["teacher"], rep["model"]
    lines += ["", "| | teacher | model |", "| --- | ---: | ---: |",
              f"| answer log-prob per token | {t['answer_logprob']:.3f} | {m['answer_logprob']:.3f} |",
              f"| answer top-1 | {t['answer_top1']:.3f} | {m['answer_top1']:.3f} |"]
    return "\n".join(lines) + "\n"


def write(rep: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "needle_attention.json").write_text(json.dumps(rep, indent=1))
    (out / "needle_attention.md").write_text(markdown(rep))
