"""Multi-query associative recall (MQAR; Arora et al. 2023, "Zoology"), the synthetic recall task the
seeds use to compare token mixers, plus a tiny train-from-scratch harness.

A sequence `[L]`: `num_kv` key-value pairs `k1 v1 k2 v2 ...` (keys from the lower half of the
vocabulary, values from the upper half, keys distinct), then a query section where every key appears
once more at a random even offset, immediately followed by its value; the other query-section
positions hold token 0. The model is trained with next-token loss ONLY at the query keys (target:
that key's value); accuracy is the share of query keys whose value is predicted (argmax).
Departure from Zoology: queried keys appear exactly once each (Zoology samples query positions with
a power law over the gap); the filler token is 0 as in Zoology.

The model: token + learned position embeddings, `layers` x [RMSNorm -> mixer -> residual,
RMSNorm -> GELU MLP -> residual], RMSNorm, linear head. The mixer is any name of
`hybridize.mixers` (built with `build_mixer(name, settings, hidden_size=d, num_heads=h,
num_kv_heads=h, head_dim=d/h)` and called with the base.py contract; its `aux_loss` is added) or
"attention" (causal softmax attention, the reference every linear mixer is compared with).

Budget note: at a short budget (d 64, 2 layers, 1500 steps) the accuracies are far from converged
and the mixers' ranking changes with the length (accuracies: benchmarks/RESULTS.md). Attention (learned absolute positions) is the slowest to find
the induction circuit: Zoology-style comparisons train for ~100x more examples; raise --steps (and
sweep --lr) before reading mixer rankings off short runs.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from hybridize.convert.settings import check_mixer_settings
from hybridize.errors import UserError
from hybridize.mixers import build_mixer
from .common import resolve_device, write_csv, write_json

IGNORE = -100


# ---- data -----------------------------------------------------------------------------------------

def mqar_batch(batch: int, seq_len: int, num_kv: int, vocab: int, generator: torch.Generator | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs `[batch, seq_len]`, labels `[batch, seq_len]`): labels[p] = value of the key at
    input p for query keys, IGNORE elsewhere (labels are aligned with inputs: position p predicts
    the token at p + 1)."""
    half = vocab // 2
    if num_kv >= half - 1:
        raise ValueError(f"num_kv {num_kv} needs a vocabulary larger than {2 * (num_kv + 1)}; got {vocab}")
    if seq_len < 4 * num_kv:
        raise ValueError(f"seq_len {seq_len} must be >= 4 * num_kv ({4 * num_kv}): pairs plus one query per key")
    g = generator
    keys = torch.stack([torch.randperm(half - 1, generator=g)[:num_kv] + 1 for _ in range(batch)])  # 1..half-1
    vals = torch.randint(half, vocab, (batch, num_kv), generator=g)
    x = torch.zeros(batch, seq_len, dtype=torch.long)
    y = torch.full((batch, seq_len), IGNORE, dtype=torch.long)
    x[:, 0:2 * num_kv:2], x[:, 1:2 * num_kv:2] = keys, vals
    slots = (seq_len - 2 * num_kv) // 2            # even offsets available in the query section
    for b in range(batch):
        pos = 2 * num_kv + 2 * torch.randperm(slots, generator=g)[:num_kv]
        order = torch.randperm(num_kv, generator=g)
        x[b, pos], x[b, pos + 1] = keys[b, order], vals[b, order]
        y[b, pos] = vals[b, order]
    return x, y


# ---- model ----------------------------------------------------------------------------------------

class SoftmaxAttention(nn.Module):
    """Causal multi-head softmax attention (the reference token mixer)."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.h = heads
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.o = nn.Linear(d, d, bias=False)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.h, D // self.h).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, D)), None


class _MixerAdapter(nn.Module):
    def __init__(self, name: str, d: int, heads: int, settings: dict | None):
        super().__init__()

        self.mixer = build_mixer(name, settings, hidden_size=d, num_heads=heads, num_kv_heads=heads,
                                 head_dim=d // heads)
        self.mixer.reset_new_parameters()

    def forward(self, x):
        kw = {}
        if getattr(self.mixer.config, "use_rope", False):   # e.g. swa: RoPE tables as the HF model builds them
            B, T, _ = x.shape
            D = self.mixer.config.head_dim
            inv = 1.0 / 10000.0 ** (torch.arange(0, D, 2, device=x.device, dtype=torch.float32) / D)
            ang = torch.arange(T, device=x.device, dtype=torch.float32)[:, None] * inv
            emb = torch.cat([ang, ang], -1).expand(B, T, D)
            kw["position_embeddings"] = (emb.cos().to(x.dtype), emb.sin().to(x.dtype))
        out = self.mixer(x, **kw)
        return out.hidden, out.aux_loss


class Block(nn.Module):
    def __init__(self, mixer: str, d: int, heads: int, settings: dict | None):
        super().__init__()
        self.n1, self.n2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.mix = SoftmaxAttention(d, heads) if mixer == "attention" else _MixerAdapter(mixer, d, heads, settings)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x):
        h, aux = self.mix(self.n1(x))
        x = x + h
        return x + self.mlp(self.n2(x)), aux


class MQARModel(nn.Module):
    """Tiny LM: `[B, T]` ids -> (logits `[B, T, vocab]`, summed aux loss or None)."""

    def __init__(self, mixer: str, vocab: int, d: int = 64, layers: int = 2, heads: int = 2, max_len: int = 1024,
                 settings: dict | None = None):
        super().__init__()
        if d % heads:
            raise ValueError(f"d_model {d} must be a multiple of heads {heads}")
        self.emb, self.pos = nn.Embedding(vocab, d), nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList([Block(mixer, d, heads, settings) for _ in range(layers)])
        self.norm, self.head = nn.RMSNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, x):
        T = x.shape[1]
        h = self.emb(x) + self.pos(torch.arange(T, device=x.device))
        aux = None
        for b in self.blocks:
            h, a = b(h)
            if a is not None:
                aux = a if aux is None else aux + a
        return self.head(self.norm(h)), aux


# ---- train and test ------------------------------------------------------------------------------

@dataclass
class MqarConfig:
    mixers: tuple[str, ...] = field(default=("attention", "linear_attn", "gla", "deltanet"),
                                    metadata={"help": "token mixers to compare ('attention' or hybridize.mixers names)"})
    seq_len: int = field(default=64, metadata={"help": "sequence length"})
    num_kv: int = field(default=8, metadata={"help": "key-value pairs per sequence"})
    vocab: int = field(default=128, metadata={"help": "vocabulary size (keys lower half, values upper half)"})
    d_model: int = field(default=64, metadata={"help": "model width"})
    layers: int = field(default=2, metadata={"help": "blocks"})
    heads: int = field(default=2, metadata={"help": "heads per mixer"})
    steps: int = field(default=2000, metadata={"help": "training steps"})
    batch_size: int = field(default=64, metadata={"help": "training batch size"})
    lr: float = field(default=3e-3, metadata={"help": "AdamW peak learning rate (cosine decay, 5% warm-up)"})
    weight_decay: float = field(default=0.1, metadata={"help": "AdamW weight decay"})
    test_size: int = field(default=512, metadata={"help": "held-out sequences for the accuracy"})
    mixer_settings: dict = field(default_factory=dict, metadata={"help": "extra settings for build_mixer"})
    seed: int = field(default=0, metadata={"help": "seed of init and data"})
    device: str = field(default="auto", metadata={"help": "cpu, cuda or auto"})


def mqar_loss(model: MQARModel, x, y):
    logits, aux = model(x)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), ignore_index=IGNORE)
    return loss + (aux if aux is not None else 0.0), logits


@torch.no_grad()
def mqar_accuracy(model: MQARModel, x, y, batch: int = 128) -> float:
    model.eval()
    right = total = 0
    for s in range(0, x.shape[0], batch):
        xb, yb = x[s:s + batch], y[s:s + batch]
        logits, _ = model(xb)
        m = yb != IGNORE
        right += (logits.argmax(-1)[m] == yb[m]).sum().item()
        total += m.sum().item()
    model.train()
    return right / max(total, 1)


def train_mqar(mixer: str, cfg: MqarConfig, progress: bool = True) -> dict:
    """Train one model from scratch on fresh batches; returns loss/accuracy/time and parameter count."""
    from tqdm.auto import tqdm

    dev = torch.device(resolve_device(cfg.device))
    torch.manual_seed(cfg.seed)
    model = MQARModel(mixer, cfg.vocab, cfg.d_model, cfg.layers, cfg.heads, cfg.seq_len, cfg.mixer_settings).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    warm = max(1, cfg.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(s, cfg.steps) / cfg.steps)))
    g_train = torch.Generator().manual_seed(cfg.seed + 1)
    g_test = torch.Generator().manual_seed(cfg.seed + 2)
    xt, yt = mqar_batch(cfg.test_size, cfg.seq_len, cfg.num_kv, cfg.vocab, g_test)
    xt, yt = xt.to(dev), yt.to(dev)
    t0, losses = time.perf_counter(), []
    bar = tqdm(range(cfg.steps), desc=f"mqar {mixer}", disable=not progress, leave=False)
    for _ in bar:
        x, y = mqar_batch(cfg.batch_size, cfg.seq_len, cfg.num_kv, cfg.vocab, g_train)
        loss, _ = mqar_loss(model, x.to(dev), y.to(dev))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    tail = losses[-max(1, len(losses) // 10):]
    return {"mixer": mixer, "accuracy": mqar_accuracy(model, xt, yt), "final_loss": sum(tail) / len(tail),
            "first_loss": losses[0] if losses else float("nan"), "params": sum(p.numel() for p in model.parameters()),
            "train_s": time.perf_counter() - t0, "steps": cfg.steps}


def check_mqar_settings(cfg: MqarConfig) -> None:
    """Sizes and counts, then `cfg.mixer_settings` type-, range- and build-checked for every mixer, before any
    trains (as `hybridize convert` checks `--mixer-settings`): `use_rope="false"`, `chunk_size=0` or
    `steps=0` is one line, not a truthy string or a ZeroDivisionError after the first mixers trained."""
    for key in ("vocab", "d_model", "layers", "heads", "steps", "batch_size", "test_size", "num_kv", "seq_len"):
        if getattr(cfg, key) < 1:  # steps=0 or heads=0 ended in a ZeroDivisionError
            raise UserError(f"mqar {key} must be >= 1, got {getattr(cfg, key)}")
    if cfg.d_model % cfg.heads:
        raise UserError(f"mqar d_model {cfg.d_model} must be a multiple of heads {cfg.heads}")
    if not cfg.lr >= 0:
        raise UserError(f"mqar lr must be >= 0, got {cfg.lr}")
    for name in cfg.mixers:
        if name != "attention":
            check_mixer_settings(name, cfg.mixer_settings, hidden_size=cfg.d_model, num_heads=cfg.heads,
                                 num_kv_heads=cfg.heads, head_dim=cfg.d_model // cfg.heads)


def run_mqar(cfg: MqarConfig, out_dir: str | Path | None = None, progress: bool = True) -> list[dict]:
    """Train and test every mixer of `cfg.mixers`; writes mqar.csv / mqar.json under `out_dir`."""
    check_mqar_settings(cfg)
    rows = [train_mqar(m, cfg, progress) for m in cfg.mixers]
    if out_dir is not None:
        write_csv(Path(out_dir) / "mqar.csv", rows)
        write_json(Path(out_dir) / "mqar.json", {"config": cfg.__dict__, "rows": rows})
    return rows


def parse_settings(items: Sequence[str]) -> dict:
    """['short_conv=true', 'chunk_size=16'] -> {'short_conv': True, 'chunk_size': 16}."""
    import json

    out = {}
    for it in items:
        if "=" not in it:
            raise ValueError(f"mixer setting {it!r} must look like name=value")
        k, v = it.split("=", 1)
        try:
            out[k.strip()] = json.loads(v)
        except json.JSONDecodeError:
            out[k.strip()] = v
    return out
