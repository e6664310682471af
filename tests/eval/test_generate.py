"""Batched generation of the eval tasks: the fast decode loop gives the same completions as HF
`generate`, batching prompts by length gives the same per-prompt results as one prompt at a time,
each row stops at its own EOS, and a deadline leaves the rest undone instead of running over.

Independent references: `generation="hf"` (HF's own loop) and `batch_size=1` (no padding at all).
Models: a tiny random Llama and a tiny hybrid converted from it (GLA mixer + one softmax layer), with
many EOS ids so rows of one batch end at different steps. CPU, fp32.
"""
from __future__ import annotations

import json
import time

import pytest
import torch

from hybridize.generation.batched import cut_at_eos, generate, left_pad, resolve_generation
from tests.eval.conftest import make_tiny_llama

EOS_EVERY = 11   # every 11th token id ends a row: rows of one batch stop at different steps


def _with_many_eos(model):
    model.generation_config.eos_token_id = list(range(3, model.config.vocab_size, EOS_EVERY))
    model.generation_config.pad_token_id = 0
    return model


@pytest.fixture(scope="module")
def models(tiny_tokenizer):
    from hybridize.convert.convert import convert_model

    llama = _with_many_eos(make_tiny_llama(len(tiny_tokenizer), seed=3))
    hybrid = convert_model(make_tiny_llama(len(tiny_tokenizer), seed=4), ["gla", "attn"], mixer="gla").eval()
    return {"llama": llama, "hybrid": _with_many_eos(hybrid)}


def _prompts(vocab, n=7, seed=0):
    """Random prompts of token ids in [3, vocab): `vocab` is the tokenizer's length, which depends on
    the BPE training corpus (378 tokens without the shared essays, e.g. on the GPU machine)."""
    g = torch.Generator().manual_seed(seed)
    lens = [5, 17, 9, 30, 9, 12, 3, 21, 14][:n]
    return [torch.randint(3, vocab, (L,), generator=g).tolist() for L in lens]


def test_prompts_fit_the_vocabulary(models, tiny_tokenizer):
    """Ids >= the vocabulary crash the embedding (CPU: IndexError; CUDA: a device-side assert that
    poisons every later CUDA test of the process)."""
    for m in models.values():
        assert m.config.vocab_size == len(tiny_tokenizer)
    assert max(max(p) for p in _prompts(len(tiny_tokenizer))) < len(tiny_tokenizer)


def test_out_of_vocabulary_prompt_is_a_clear_error(models, tiny_tokenizer):
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        generate(models["llama"], tiny_tokenizer, [[3, len(tiny_tokenizer)]], max_new_tokens=2, progress=False)


def test_helpers():
    ids, mask = left_pad([[5, 6, 7], [8]], pad=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert cut_at_eos([4, 5, 9, 5], [9]) == ([4, 5], True)
    assert cut_at_eos([4, 5], [9]) == ([4, 5], False)
    assert resolve_generation("auto", "cpu") == "hf" and resolve_generation("auto", "cuda:0") == "fast"
    with pytest.raises(ValueError, match="generation must be one of"):
        resolve_generation("vllm", "cpu")


@pytest.mark.parametrize("name", ["llama", "hybrid"])
def test_fast_equals_hf_and_batched_equals_unbatched(models, tiny_tokenizer, name):
    model, tok = models[name], tiny_tokenizer
    prompts = _prompts(len(tok))
    kw = dict(max_new_tokens=40, progress=False)
    ref = generate(model, tok, prompts, batch_size=1, generation="hf", **kw)
    hf_batched = generate(model, tok, prompts, batch_size=4, generation="hf", **kw)
    fast_batched = generate(model, tok, prompts, batch_size=4, generation="fast", **kw)
    fast_one = generate(model, tok, prompts, batch_size=1, generation="fast", **kw)
    assert hf_batched == ref
    assert fast_batched == ref
    assert fast_one == ref
    # the test means something: rows end at different steps, some on EOS, some at the budget
    n = [g[0]["num_tokens"] for g in ref]
    assert len(set(n)) >= 3 and any(g[0]["finished"] for g in ref)


def test_sampled_fast_equals_hf(models, tiny_tokenizer):
    """Seeded sampling: same seeds per batch, same draws (fast path = HF's processors + multinomial)."""
    model, tok = models["hybrid"], tiny_tokenizer
    kw = dict(max_new_tokens=12, temperature=0.8, top_p=0.9, num_samples=2, batch_size=3, seed=5, progress=False)
    assert generate(model, tok, _prompts(len(tok), 5), generation="fast", **kw) == \
        generate(model, tok, _prompts(len(tok), 5), generation="hf", **kw)


def test_eos_cut_per_row(models, tiny_tokenizer):
    """Each row's completion is its own tokens up to (not including) its first EOS, found here
    independently in HF's raw output for the prompt alone."""
    model, tok = models["llama"], tiny_tokenizer
    prompts = _prompts(len(tok))
    out = generate(model, tok, prompts, batch_size=7, max_new_tokens=40, generation="fast", progress=False)
    eos = set(model.generation_config.eos_token_id) | {tok.eos_token_id}
    for p, g in zip(prompts, out):
        raw = model.generate(input_ids=torch.tensor([p]), max_new_tokens=40, do_sample=False, pad_token_id=0,
                             eos_token_id=sorted(eos), temperature=None, top_p=None, top_k=None)[0, len(p):].tolist()
        stops = [j for j, t in enumerate(raw) if t in eos]
        want = raw[:stops[0]] if stops else raw
        assert g[0]["num_tokens"] == len(want) and g[0]["finished"] == bool(stops)
        assert g[0]["text"] == tok.decode(want, skip_special_tokens=True)


def test_deadline_stops_before_a_batch(models, tiny_tokenizer):
    model, tok = models["llama"], tiny_tokenizer
    lines = []
    out = generate(model, tok, _prompts(len(tok)), batch_size=2, max_new_tokens=4, progress=False,
                   deadline=time.time() - 1, log=lines.append)
    assert all(g == [None] for g in out) and "time is up" in lines[-1]


def test_math_batched_and_partial(models, tiny_tokenizer, tmp_path):
    from hybridize.eval.math import MathEvalConfig, evaluate_math

    data = tmp_path / "mini.jsonl"
    data.write_text("\n".join(json.dumps({"problem": "What is " + "one plus " * i + "one?", "answer": str(i + 1)})
                              for i in range(6)))
    model, tok = models["hybrid"], tiny_tokenizer
    rows = {}
    for bs in (1, 4):
        cfg = MathEvalConfig(dataset=str(data), greedy=True, max_new_tokens=10, batch_size=bs)
        evaluate_math(model, tok, cfg, tmp_path / f"b{bs}", progress=False)
        rows[bs] = [json.loads(x) for x in (tmp_path / f"b{bs}" / "problems.jsonl").read_text().splitlines()]
    assert [r["completions"] for r in rows[1]] == [r["completions"] for r in rows[4]]
    assert [r["id"] for r in rows[4]] == list(range(6))            # input order kept
    cfg = MathEvalConfig(dataset=str(data), greedy=True, max_new_tokens=10, batch_size=4)
    s = evaluate_math(model, tok, cfg, tmp_path / "late", progress=False, deadline=time.time() - 1)
    assert s["problems"] == 0 and s["partial"] and s["problems_requested"] == 6 and s["avg@1"] != s["avg@1"]


def test_niah_batched_equals_unbatched(models, tiny_tokenizer, tmp_path):
    from hybridize.eval.common import data_file
    from hybridize.eval.niah import NiahConfig, build_samples, evaluate_niah

    if data_file("haystack/paul_graham_essays.txt") is None:
        pytest.skip("shared data not present")
    model, tok = models["hybrid"], tiny_tokenizer
    base = dict(task="s-niah-1", lengths=(220, 260), depths=(0.0, 0.5, 1.0), samples=1, max_new_tokens=6)
    samples = build_samples(tok, NiahConfig(**base))
    comps = {}
    for bs, gen in ((1, "hf"), (3, "hf"), (3, "fast")):
        evaluate_niah(model, tok, NiahConfig(**base, batch_size=bs, generation=gen), tmp_path / f"{bs}{gen}",
                      progress=False, samples=samples)
        comps[(bs, gen)] = [json.loads(x)["completion"]
                            for x in (tmp_path / f"{bs}{gen}" / "samples.jsonl").read_text().splitlines()]
    assert comps[(1, "hf")] == comps[(3, "hf")] == comps[(3, "fast")] and len(comps[(1, "hf")]) == 6
    late = evaluate_niah(model, tok, NiahConfig(**base), None, progress=False, samples=samples,
                         deadline=time.time() - 1)
    assert late["lengths_done"] == [] and late["table"] == [] and late["prompts"] == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (CUDA-graph decode path)")
@pytest.mark.parametrize("name", ["llama", "hybrid"])
def test_fast_equals_hf_on_cuda(models, tiny_tokenizer, name):
    """With CUDA graphs the attention reads the whole masked buffer: tokens still agree (fp32, no near-ties)."""
    import copy

    model = copy.deepcopy(models[name]).cuda()
    kw = dict(max_new_tokens=40, batch_size=4, progress=False)
    assert generate(model, tiny_tokenizer, _prompts(len(tiny_tokenizer)), generation="fast", **kw) == \
        generate(model, tiny_tokenizer, _prompts(len(tiny_tokenizer)), generation="hf", **kw)
