"""Batched generation for lists of prompts: `generate(model, tokenizer, prompts) -> completions`.

Each prompt (token ids) is one job per sample; jobs are sorted by prompt length (similar lengths share a
batch, so little padding), left-padded into `input_ids` `[B, T]` and `attention_mask` `[B, T]` (1 = real
token), generated to `[B, T + n]`, and each row is cut at its own first EOS (the tokenizer's, the
generation config's and ChatML's `<|im_end|>`); the output keeps the input order. temperature 0 is greedy.

The decode loop is `generation="fast"`: the static-buffer decode loop of `hybridize.generation.fast`
(CUDA graphs on GPU, same tokens as HF generate; HF's own loop is host-bound, a fixed cost per step
whatever the model size), or `"hf"`: `model.generate`. `"auto"` picks fast on CUDA and HF elsewhere
(on CPU the fast path is no faster and HF is the reference).
"""
from __future__ import annotations

import sys
import time
from typing import Sequence

import torch
from tqdm.auto import tqdm

from .fast import FastGenConfig, FastGenerator
from .loading import model_device


def pad_id(tokenizer) -> int:
    for t in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0):
        if t is not None:
            return int(t)
    return 0


def eos_ids(tokenizer, model=None) -> list[int]:
    """The ids that end a completion: tokenizer EOS, the generation config's EOS, ChatML's <|im_end|>."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gc = getattr(model, "generation_config", None)
    g = getattr(gc, "eos_token_id", None)
    if g is not None:
        ids.update([int(x) for x in (g if isinstance(g, (list, tuple)) else [g])])
    tid = tokenizer.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tokenizer.get_vocab() else None
    if tid is not None:
        ids.add(int(tid))
    return sorted(ids)


GENERATION_MODES = ("auto", "fast", "hf")


def resolve_generation(mode: str | None, device) -> str:
    """'auto' -> 'fast' on CUDA (static buffers + CUDA graphs, `hybridize.generation.fast`), 'hf' elsewhere
    (HF's own loop; on CPU the fast path is no faster and HF is the reference)."""
    mode = mode or "auto"
    if mode not in GENERATION_MODES:
        raise ValueError(f"generation must be one of {', '.join(GENERATION_MODES)}, got {mode!r}")
    if mode == "auto":
        return "fast" if torch.device(device).type == "cuda" else "hf"
    return mode


def default_batch_size(device, gpu: int, cpu: int) -> int:
    """Batch size when none is given: large on a GPU (decode steps are latency-bound), small on CPU."""
    return gpu if torch.device(device).type == "cuda" else cpu


def left_pad(seqs: Sequence[Sequence[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> left-padded `input_ids` `[B, T]` and `attention_mask` `[B, T]` (1 = real token)."""
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad, dtype=torch.long)
    mask = torch.zeros(len(seqs), T, dtype=torch.long)
    for r, s in enumerate(seqs):
        if len(s):
            ids[r, T - len(s):] = torch.tensor(list(s), dtype=torch.long)
            mask[r, T - len(s):] = 1
    return ids, mask


def cut_at_eos(toks: Sequence[int], eos: Sequence[int]) -> tuple[list[int], bool]:
    """(tokens before the first EOS, whether there was one): each row stops at its own EOS."""
    eos = set(eos)
    for j, t in enumerate(toks):
        if t in eos:
            return list(toks[:j]), True
    return list(toks), False


@torch.no_grad()
def generate(model, tokenizer, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 256,
             temperature: float = 0.0, top_p: float = 1.0, num_samples: int = 1, batch_size: int = 8,
             seed: int = 0, desc: str = "generate", progress: bool = True, generation: str = "auto",
             deadline: float | None = None, log=None) -> list[list[dict | None]]:
    """Sample `num_samples` completions for each prompt (token ids). temperature 0 = greedy.

    Returns, per prompt, a list of `{"text", "token_ids", "num_tokens", "finished"}` (token_ids: the completion's
    tokens before its EOS; finished: ended on EOS).
    Jobs (prompt x sample) are sorted by prompt length and left-padded into batches of `batch_size`,
    so a batch holds prompts of similar length (little padding); the output order is the input order.
    A batch stops when all its rows have ended; each row's completion is cut at its own first EOS.

    `generation`: 'fast' (static-buffer decode loop with CUDA graphs on GPU, same tokens as HF),
    'hf' (`model.generate`) or 'auto' (fast on CUDA). `deadline` (a `time.time()` value): no batch
    starts that would end after it (judged by the previous batch's time); the completions of jobs not
    run are None. `log(msg)` is called after each batch."""
    if num_samples < 1 or batch_size < 1:
        raise ValueError("num_samples and batch_size must be >= 1")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt: every prompt needs at least one token")
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    top = max((max(p) for p in prompts), default=0)
    if vocab and top >= vocab:  # on CUDA this would be a device-side assert that poisons the process
        raise ValueError(f"prompt token id {top} is outside the model's vocabulary ({vocab}): "
                         "was the prompt tokenized with another tokenizer?")
    device = model_device(model)
    mode = resolve_generation(generation, device)
    pad, eos = pad_id(tokenizer), eos_ids(tokenizer, model)
    jobs = [(i, s) for i in range(len(prompts)) for s in range(num_samples)]
    # similar lengths together: less padding (order restored below); stable, so ties keep input order
    jobs.sort(key=lambda j: len(prompts[j[0]]))
    out: list[list[dict | None]] = [[None] * num_samples for _ in prompts]
    run = _batch_runner(model, mode, _gen_kwargs(max_new_tokens, temperature, top_p, pad, eos))
    bar = tqdm(total=len(jobs), desc=desc, disable=not progress, leave=False)
    n_batches = -(-len(jobs) // batch_size)
    last_s = 0.0   # the previous batch's time: a batch that would end past the deadline is not started
    for k, b0 in enumerate(range(0, len(jobs), batch_size)):
        if deadline is not None and time.time() + last_s > deadline:
            if log:
                log(f"{desc}: time is up, {len(jobs) - b0} of {len(jobs)} completions not generated")
            break
        t0 = time.perf_counter()
        batch = jobs[b0:b0 + batch_size]
        ids, mask = left_pad([prompts[i] for i, _ in batch], pad)
        torch.manual_seed(seed * 1_000_003 + b0)
        gen = run(ids.to(device), mask.to(device))
        new = gen[:, ids.shape[1]:].cpu()
        for r, (i, s) in enumerate(batch):
            toks, finished = cut_at_eos(new[r].tolist(), eos)
            out[i][s] = {"text": tokenizer.decode(toks, skip_special_tokens=True), "token_ids": toks,
                         "num_tokens": len(toks), "finished": finished}
        bar.update(len(batch))
        last_s = time.perf_counter() - t0
        if log:
            log(f"{desc}: batch {k + 1}/{n_batches} ({len(batch)} x {ids.shape[1]} prompt tokens, "
                f"{new.shape[1]} steps, {mode}) {last_s:.1f} s")
    bar.close()
    return out


def _gen_kwargs(max_new_tokens: int, temperature: float, top_p: float, pad: int, eos: list[int]) -> dict:
    greedy = temperature <= 0
    kw = dict(max_new_tokens=max_new_tokens, do_sample=not greedy, pad_token_id=pad, eos_token_id=eos or None)
    if greedy:   # None: no sampling warpers from the model's generation config
        kw.update(temperature=None, top_p=None, top_k=None)
    else:
        kw.update(temperature=temperature, top_p=top_p, top_k=0)
    return kw


def _batch_runner(model, mode: str, gen_kw: dict):
    """A function `(input_ids, attention_mask) -> [B, T + n]` ids. The fast generator is kept across
    batches so its CUDA graphs (one per batch size and buffer length) are captured once."""
    if mode == "hf":
        return lambda ids, mask: model.generate(input_ids=ids, attention_mask=mask, **gen_kw)
    fast = FastGenerator(model, FastGenConfig())
    warned: list[str] = []

    def run(ids, mask):
        res = fast(input_ids=ids, attention_mask=mask, **gen_kw)
        why = fast.last_fallback_reason
        if why and why not in warned:
            warned.append(why)
            print(f"fast generation fell back to model.generate: {why}", file=sys.stderr, flush=True)
        return res

    return run


__all__ = ["GENERATION_MODES", "generate", "resolve_generation", "default_batch_size", "left_pad", "cut_at_eos",
           "pad_id", "eos_ids"]
