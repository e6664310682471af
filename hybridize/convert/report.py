"""Conversion report: per layer the mixer, its new parameter count and how far its output is from the
teacher layer's, plus whole-model agreement - as a JSON-able dict and a rich table.

Layer error is layer-local (the attention-transfer view of alignment stage A): the teacher runs on the
sample sequences, each converted layer's mixer gets exactly the input the teacher's attention got
(same normalised hidden states, same RoPE cos/sin), and
`rel_err = ||mixer(x) - attn(x)||_F / ||attn(x)||_F` over all real tokens of all samples.
Model-level: relative error of the final logits, top-1 next-token agreement and mean KL(teacher || hybrid).

Family: what the teacher's attention does beyond plain softmax attention (its family's entry in
`hybridize.families` read against this config) and, per mixer kind, whether the converted layers keep each
feature or drop it and why (`report["family"]`; the dropped ones are printed under the table).

Samples: a few built-in English/maths/code snippets (so the default job needs no data files), or
random token ids when no tokenizer is given (tiny test models); they run as one right-padded batch.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from hybridize.convert.layout import new_parameter_names
from hybridize.families import dropped_lines, family_traits
from hybridize.modeling import ATTN, AttentionSlot

SAMPLE_TEXTS = (
    "The old lighthouse keeper climbed the spiral stairs every evening at dusk. From the top he could see "
    "the fishing boats returning to the harbour, their lanterns flickering like small stars on the dark water. "
    "He wrote the name of each boat in a worn leather notebook.",
    "Question: A train travels 180 kilometres in 2.5 hours. What is its average speed? "
    "Answer: The average speed is distance divided by time, so 180 / 2.5 = 72 kilometres per hour. "
    "Therefore the answer is 72.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
    "print([fibonacci(i) for i in range(10)])  # [0, 1, 1, 2, 3, 5, 8, 13, 21, 34]",
)


def sample_inputs(tokenizer=None, vocab_size: int | None = None, n: int = 3, length: int = 48,
                  seed: int = 0) -> list[torch.Tensor]:
    """A list of `[1, T]` id tensors: tokenised SAMPLE_TEXTS (cut at `length`), or random ids."""
    if tokenizer is not None:
        return [tokenizer(t, return_tensors="pt").input_ids[:, :length] for t in SAMPLE_TEXTS[:n]]
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (1, length), generator=g) for _ in range(n)]


def capture_attention_io(teacher, layers: list[int]):
    """Forward hooks recording (normalised input, position_embeddings, output) of teacher attentions."""
    records: dict[int, list] = {i: [] for i in layers}
    handles = []
    for i in layers:
        def hook(module, args, kwargs, output, i=i):
            x = kwargs.get("hidden_states", args[0] if args else None)
            records[i].append((x.detach(), kwargs.get("position_embeddings"), output[0].detach()))
        handles.append(teacher.model.layers[i].self_attn.register_forward_hook(hook, with_kwargs=True))
    return records, handles


def right_pad(inputs: list[torch.Tensor], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`[1, T_i]` ids -> one batch `[N, T_max]` right-padded, and `[N, T_max]` bool of real tokens.

    Causal models never look ahead, so right padding leaves every real token's output unchanged:
    one batched forward replaces N separate ones, and padding positions are simply not scored."""
    t_max = max(x.shape[1] for x in inputs)
    ids = torch.full((len(inputs), t_max), pad_id, dtype=torch.long)
    valid = torch.zeros(len(inputs), t_max, dtype=torch.bool)
    for i, x in enumerate(inputs):
        ids[i, :x.shape[1]] = x[0]
        valid[i, :x.shape[1]] = True
    return ids, valid


@torch.no_grad()
def conversion_report(teacher, hybrid, inputs: list[torch.Tensor] | None = None, tokenizer=None,
                      source: dict | None = None) -> dict[str, Any]:
    """Measure the converted model against its teacher on `inputs` (default: `sample_inputs`)."""
    if inputs is None:
        inputs = sample_inputs(tokenizer, teacher.config.vocab_size)
    device = next(teacher.parameters()).device
    ids, valid = (t.to(device) for t in right_pad(inputs))
    plan = hybrid.config.layer_plan
    conv = [i for i, k in enumerate(plan) if k != ATTN]
    records, handles = capture_attention_io(teacher, conv)
    try:
        t_logits = teacher(ids, use_cache=False).logits.float()
    finally:
        for h in handles:
            h.remove()
    layers = _layer_rows(hybrid, plan, records, valid)
    model = _model_metrics(hybrid, ids, valid, t_logits)
    n_teacher = sum(p.numel() for p in teacher.parameters())
    n_hybrid = sum(p.numel() for p in hybrid.parameters())
    return {
        "source": source or {},
        "family": family_record(hybrid),
        "plan": list(plan),
        "mixer_settings": hybrid.config.mixer_settings,
        "samples": len(inputs),
        "tokens": int(valid.sum()),
        "layers": layers,
        "params": {"teacher": n_teacher, "hybrid": n_hybrid,
                   "new": sum(r["new_params"] for r in layers)},
        "model": model,
    }


def family_record(hybrid) -> dict:
    """The teacher family, its attention features with what each mixer kind keeps or drops, and the
    dropped ones as lines (`hybridize.families.traits`)."""
    cfg = hybrid.config
    traits = family_traits(hybrid.family, cfg.source_config, cfg.layer_plan, cfg.mixer_settings)
    return {"model_type": hybrid.family.model_type, "title": hybrid.family.title,
            "features": [t.to_dict() for t in traits], "dropped": dropped_lines(traits)}


def _layer_rows(hybrid, plan, records, valid) -> list[dict]:
    params = dict(hybrid.named_parameters())
    new_names = set(new_parameter_names(hybrid))
    rows = []
    for i, kind in enumerate(plan):
        row = {"layer": i, "kind": kind, "new_params": 0, "rel_err": None}
        slot = hybrid.model.layers[i].self_attn
        if isinstance(slot, AttentionSlot):
            prefix = f"model.layers.{i}.self_attn."
            row["new_params"] = sum(p.numel() for n, p in params.items() if n.startswith(prefix) and n in new_names)
            (x, pe, y_t), = records[i]
            y = slot.mixer_forward(x, pe)[valid].float()
            y_t = y_t[valid].float()
            den = y_t.pow(2).sum().item()
            row["rel_err"] = ((y - y_t).pow(2).sum().item() / den) ** 0.5 if den > 0 else None
        rows.append(row)
    return rows


def _model_metrics(hybrid, ids, valid, t_logits) -> dict:
    lh = hybrid(ids, use_cache=False).logits.float()[valid]
    lt = t_logits[valid]
    den = lt.pow(2).sum().item()
    lpt, lph = F.log_softmax(lt, -1), F.log_softmax(lh, -1)
    n = lt.shape[0]
    return {"logits_rel_err": ((lh - lt).pow(2).sum().item() / den) ** 0.5 if den else None,
            "top1_agreement": (lt.argmax(-1) == lh.argmax(-1)).float().mean().item() if n else None,
            "kl_teacher_hybrid": (lpt.exp() * (lpt - lph)).sum(-1).mean().item() if n else None}


def report_table(report: dict):
    """Rich table of a report (one row per layer) with the model-level numbers as caption."""
    from rich.table import Table

    m = report.get("model", {})
    p = report.get("params", {})
    cap = (f"new params {p.get('new', 0):,} ({p.get('hybrid', 0):,} vs teacher {p.get('teacher', 0):,})\n"
           f"logits rel. err {_fmt(m.get('logits_rel_err'))}, top-1 agreement {_fmt(m.get('top1_agreement'), '.1%')}, "
           f"KL {_fmt(m.get('kl_teacher_hybrid'))} nats/token ({report.get('tokens', 0)} tokens)")
    dropped = report.get("family", {}).get("dropped", [])
    if dropped:
        cap += "\nthe mixer layers drop:\n" + "\n".join(f"  {line}" for line in dropped)
    table = Table(title="conversion report", caption=cap, caption_justify="left",
                  min_width=min(max(map(len, cap.splitlines())) + 4, 120))
    for col, just in (("layer", "right"), ("kind", "left"), ("new params", "right"), ("rel. err", "right")):
        table.add_column(col, justify=just)
    for r in report["layers"]:
        kind = "softmax (kept)" if r["kind"] == ATTN else r["kind"]
        table.add_row(str(r["layer"]), kind, f"{r['new_params']:,}" if r["new_params"] else "-",
                      _fmt(r["rel_err"]) if r["rel_err"] is not None else "-")
    return table


def _fmt(v, spec: str = ".4f") -> str:
    return "n/a" if v is None else format(v, spec)
