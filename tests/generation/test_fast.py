"""The fast rollout path gives the same tokens as HF `generate` (the plain cached path).

Independent reference: `model.generate` on the same model, inputs and seed. Checked on tiny hybrids
(GLA, SSE, Gated DeltaNet mixers + one softmax layer), a plain Llama and a Qwen3-family hybrid, greedy
and seeded sampling (temperature / top-k / top-p), left-padded batches, EOS early stop; plus the
masked whole-buffer attention that CUDA graphs use, the fallback for unsupported settings, and
installing the path into a model (what the trainer does). A CUDA-graph test runs only on a GPU.
"""
from __future__ import annotations

import pytest
import torch

from hybridize.generation.fast import FastGenConfig, FastGenerator, fast_generate, fast_generate_installed
from tests.rl.helpers import left_padded_batch as _batch, byte_tokenizer, tiny_hybrid, tiny_teacher

PAD = byte_tokenizer().pad_token_id


def _both(model, gen, kw, seed=1, ids=None, am=None):
    if ids is None:
        ids, am = _batch()
    torch.manual_seed(seed)
    ref = model.generate(input_ids=ids, attention_mask=am, pad_token_id=PAD, **kw)
    torch.manual_seed(seed)
    out = gen(input_ids=ids, attention_mask=am, pad_token_id=PAD, **kw)
    return ref, out


def _hf_logits(model, ids, am, kw, seed=1):
    torch.manual_seed(seed)
    out = model.generate(input_ids=ids, attention_mask=am, pad_token_id=PAD, output_logits=True,
                         return_dict_in_generate=True, **kw)
    return out.sequences, [x.float() for x in out.logits]


SETTINGS = [
    dict(do_sample=False, max_new_tokens=24),
    dict(do_sample=True, max_new_tokens=24),
    dict(do_sample=True, temperature=0.7, top_k=40, top_p=0.9, max_new_tokens=24),
]
EOS = list(range(0, 256, 12))   # many EOS ids: rows finish at different steps


@pytest.mark.parametrize("mixer", ["gla", "sse", "gdn"])
def test_same_tokens_as_hf_generate(mixer):
    model, _ = tiny_hybrid(mixer=mixer)
    gen = FastGenerator(model)
    for kw in SETTINGS:
        for eos in (None, EOS):
            ref, out = _both(model, gen, {**kw, "eos_token_id": eos})
            assert gen.last_fallback_reason is None
            assert out.shape == ref.shape, (kw, eos)
            assert torch.equal(out, ref), (kw, eos)


def test_same_tokens_as_hf_generate_with_window_sinks():
    """Sliding windows with attention sinks (their two fixed buffers and the token count) through the static
    decode state: prompts and generations longer than window + sinks."""
    model, _ = tiny_hybrid(mixer="swa", mixer_settings={"swa": {"window": 5, "sinks": 2}})
    gen = FastGenerator(model)
    for kw in SETTINGS:
        ref, out = _both(model, gen, kw)
        assert gen.last_fallback_reason is None
        assert torch.equal(out, ref), kw


@pytest.mark.parametrize("mixer", ["sse", "gdn"])
def test_same_logits_as_hf_generate(mixer):
    """Every step's logits are bitwise equal (same operations on the same values), softmax layer
    included: a wrong position id or cache slot shows here even when tokens happen to agree."""
    model, _ = tiny_hybrid(mixer=mixer)
    gen = FastGenerator(model, FastGenConfig(record_logits=True))
    ids, am = _batch()
    kw = dict(do_sample=True, max_new_tokens=16)
    seq, ref = _hf_logits(model, ids, am, kw)
    torch.manual_seed(1)
    out = gen(input_ids=ids, attention_mask=am, pad_token_id=PAD, **kw)
    assert torch.equal(out, seq)
    assert len(gen.last_logits) == len(ref) == 16
    for a, b in zip(gen.last_logits, ref):
        assert torch.equal(a, b)


def test_eos_cut_matches_hf():
    """Rows finish at different steps; the output ends where the last row finished, pads after EOS."""
    model, _ = tiny_hybrid(mixer="gla")
    gen = FastGenerator(model)
    seen_short = False
    for seed in range(4):
        ref, out = _both(model, gen, dict(do_sample=True, max_new_tokens=40, eos_token_id=EOS), seed=seed)
        assert torch.equal(out, ref)
        seen_short |= out.shape[1] < 9 + 40
    assert seen_short, "no run stopped early: the EOS path was not exercised"


def test_masked_whole_buffer_path():
    """The CUDA-graph layout (whole KV buffer + mask, no slicing) run eagerly on CPU."""
    model, _ = tiny_hybrid(mixer="sse")
    gen = FastGenerator(model, FastGenConfig(exact_lengths=False, bucket=16, record_logits=True))
    ids, am = _batch()
    seq, ref = _hf_logits(model, ids, am, dict(do_sample=True, max_new_tokens=16))
    torch.manual_seed(1)
    out = gen(input_ids=ids, attention_mask=am, pad_token_id=PAD, do_sample=True, max_new_tokens=16)
    assert torch.equal(out, seq)
    for a, b in zip(gen.last_logits, ref):   # different reduction lengths: equal up to rounding
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()
    for kw in SETTINGS:
        ref, out = _both(model, gen, {**kw, "eos_token_id": EOS})
        assert torch.equal(out, ref), kw


@pytest.mark.parametrize("mixer,settings", [("sse", None), ("swa", {"swa": {"window": 5, "sinks": 2}})])
def test_compiled_decode_step_same_tokens(mixer, settings):
    """FastGenConfig.compile=on: the torch.compile'd step (the masked path a CUDA graph captures) gives the
    tokens of the uncompiled step, greedy and seeded sampling; and it did run compiled (not silently eager).
    The window's step writes its ring in place, which the compiled step must keep."""
    model, _ = tiny_hybrid(mixer=mixer, layers=2, mixer_settings=settings)
    plain = FastGenerator(model, FastGenConfig(exact_lengths=False, bucket=16, compile="off"))
    compiled = FastGenerator(model, FastGenConfig(exact_lengths=False, bucket=16, compile="on"))
    from torch._dynamo.utils import counters

    ids, am = _batch()
    torch._dynamo.reset()
    for kw in (dict(do_sample=False, max_new_tokens=10), dict(do_sample=True, max_new_tokens=10)):
        ref, out = [(torch.manual_seed(3), g(input_ids=ids, attention_mask=am, pad_token_id=PAD, **kw))[1]
                    for g in (plain, compiled)]
        assert torch.equal(out, ref), kw
    assert counters["stats"]["unique_graphs"] > 0   # the step went through dynamo


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
def test_compiled_decode_step_follows_in_place_weight_updates(device):
    """GRPO updates the policy's weights in place between rollouts (and `compile_decode=auto` compiles its decode step):
    the compiled step of a reused generator (on CUDA: compiled and captured in a CUDA graph) must read the new
    weights, not values captured at its first call."""
    model, _ = tiny_hybrid(mixer="sse", layers=2)
    model = model.to(device)
    graphs = "on" if device == "cuda" else "off"
    plain = FastGenerator(model, FastGenConfig(exact_lengths=False, bucket=16, cuda_graphs="off", compile="off"))
    compiled = FastGenerator(model, FastGenConfig(exact_lengths=False, bucket=16, compile="on", cuda_graphs=graphs))
    ids, am = (t.to(device) for t in _batch())
    kw = dict(input_ids=ids, attention_mask=am, pad_token_id=PAD, do_sample=False, max_new_tokens=8)
    before = compiled(**kw)
    torch.manual_seed(11)
    with torch.no_grad():   # an optimizer step's kind of change: every weight moved in place
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5 * p.std().clamp(min=1e-3))
    after, ref = compiled(**kw), plain(**kw)
    assert torch.equal(after, ref)
    assert not torch.equal(after, before)   # the update changed the greedy tokens, so stale weights would show
    if device == "cuda":
        assert compiled.stats["graphs"]   # the second call replayed the captured graph


def test_compile_raises_dynamo_limits_for_the_call_only(monkeypatch):
    """compile=on: dynamo's recompile limits are raised to 8 (32 accumulated) entries per decoder layer while the
    generator runs (each layer's frames are compiled on their own on the GPU, where our kernels are graph breaks;
    under the default limit of 8 the later layers silently ran uncompiled) and restored after; off: untouched."""
    import torch._dynamo

    from hybridize.generation import fast as fg

    cfg = torch._dynamo.config
    model, _ = tiny_hybrid(mixer="sse", layers=12)
    before = (cfg.cache_size_limit, cfg.accumulated_cache_size_limit)
    with cfg.patch(cache_size_limit=8, accumulated_cache_size_limit=256):
        with fg._compile_limits(model, True):
            assert (cfg.cache_size_limit, cfg.accumulated_cache_size_limit) == (96, 384)
        assert (cfg.cache_size_limit, cfg.accumulated_cache_size_limit) == (8, 256)
        with fg._compile_limits(model, False):
            assert cfg.cache_size_limit == 8
        with cfg.patch(cache_size_limit=500):   # a user's higher limit is kept
            with fg._compile_limits(model, True):
                assert cfg.cache_size_limit == 500
        seen = []
        real = fg.FastGenerator._generate
        monkeypatch.setattr(fg.FastGenerator, "_generate",
                            lambda self, *a: seen.append(cfg.cache_size_limit) or real(self, *a))
        ids, am = _batch()
        FastGenerator(model, FastGenConfig(exact_lengths=False, compile="on"))(
            input_ids=ids, attention_mask=am, pad_token_id=PAD, max_new_tokens=2)
        assert seen == [96] and cfg.cache_size_limit == 8
    assert (cfg.cache_size_limit, cfg.accumulated_cache_size_limit) == before


def test_compiled_decode_step_through_lora():
    """compile=on with LoRA-wrapped projections (what GRPO with lora.enabled decodes through): same greedy
    tokens as the uncompiled step."""
    from peft import LoraConfig, get_peft_model

    from hybridize.generation.fast import find_generator_model

    model, _ = tiny_hybrid(mixer="sse", layers=2)
    peft = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "o_proj"],
                                            task_type="CAUSAL_LM"))
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.5)   # a non-zero adapter, so LoRA changes the logits
    inner = find_generator_model(peft.eval())
    ids, am = _batch()
    outs = [FastGenerator(inner, FastGenConfig(exact_lengths=False, bucket=16, compile=c))(
        input_ids=ids, attention_mask=am, pad_token_id=PAD, do_sample=False, max_new_tokens=8) for c in ("off", "on")]
    assert torch.equal(outs[0], outs[1])
    base = FastGenerator(model, FastGenConfig(exact_lengths=False, bucket=16))
    with peft.disable_adapter():
        plain = base(input_ids=ids, attention_mask=am, pad_token_id=PAD, do_sample=False, max_new_tokens=8)
    assert not torch.equal(plain, outs[1])   # the adapter was in the compiled step
    with pytest.raises(ValueError, match="compile must be one of"):
        FastGenerator(model, FastGenConfig(exact_lengths=False, compile="yes"))(
            input_ids=ids, attention_mask=am, pad_token_id=PAD, max_new_tokens=2)


@pytest.mark.parametrize("mixer,settings", [("sse", None), ("gdn", None), ("swa", {"swa": {"window": 5, "sinks": 2}})])
@pytest.mark.parametrize("prefill_tokens", [9, 18])
def test_prefill_in_row_groups_same_as_hf(mixer, settings, prefill_tokens):
    """`prefill_tokens`: 5 rows of 9 tokens (two left-padded) prefilled 1 or 2 at a time, each group loaded into its
    own rows of the static buffers (keys/values, mixer states, the window's sinks): the same tokens as HF
    generate, the same logits up to rounding, on the exact and the whole-buffer (CUDA-graph layout) paths."""
    model, _ = tiny_hybrid(mixer=mixer, mixer_settings=settings)
    ids, am = _batch(B=5)
    kw = dict(do_sample=True, max_new_tokens=16)
    seq, ref = _hf_logits(model, ids, am, kw)
    for exact in (True, False):
        gen = FastGenerator(model, FastGenConfig(prefill_tokens=prefill_tokens, exact_lengths=exact, bucket=16,
                                                 record_logits=True))
        assert [r.stop - r.start for r in gen._row_groups(5, 9)] == ([1] * 5 if prefill_tokens == 9 else [2, 2, 1])
        torch.manual_seed(1)
        out = gen(input_ids=ids, attention_mask=am, pad_token_id=PAD, **kw)
        assert gen.last_fallback_reason is None
        assert torch.equal(out, seq), exact
        for a, b in zip(gen.last_logits, ref):
            assert (a - b).abs().max() <= 1e-5 * b.abs().max(), exact


def test_prefill_row_groups_without_padding_and_bad_setting():
    teacher = tiny_teacher()
    ids = torch.randint(0, 256, (5, 7))
    gen = FastGenerator(teacher, FastGenConfig(prefill_tokens=20))   # 2 rows of 7 tokens a group
    assert [(r.start, r.stop) for r in gen._row_groups(5, 7)] == [(0, 2), (2, 4), (4, 5)]
    assert [(r.start, r.stop) for r in gen._row_groups(2, 30)] == [(0, 1), (1, 2)]   # a row is the least
    ref, out = _both(teacher, gen, dict(do_sample=False, max_new_tokens=12), ids=ids, am=torch.ones_like(ids))
    assert torch.equal(out, ref)
    assert [(r.start, r.stop) for r in FastGenerator(teacher)._row_groups(5, 7)] == [(0, 5)]
    with pytest.raises(ValueError, match="prefill_tokens"):
        FastGenerator(teacher, FastGenConfig(prefill_tokens=-1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_stats_count_the_prefill_kernels_in_the_prefill():
    """The stats' prefill time waits for the prefill's queued kernels: each row group's forward is followed by a
    ~50 ms GPU sleep; all of them land in `prefill_s`, none in `decode_s` (before the fix the last group's ran in
    the decode and inflated its per-step time)."""
    import time
    model, _ = tiny_hybrid(mixer="sse")
    model = model.cuda()
    ids, am = (t.cuda() for t in _batch(B=5))
    gen = FastGenerator(model, FastGenConfig(prefill_tokens=18, bucket=16))   # groups of 2, 2, 1 rows
    cycles = 10 ** 8
    torch.cuda.synchronize()
    t = time.perf_counter()
    torch.cuda._sleep(cycles)
    torch.cuda.synchronize()
    sleep_s = time.perf_counter() - t
    plain = gen._prefill

    def slow_prefill(*args):
        out = plain(*args)
        torch.cuda._sleep(cycles)
        return out

    gen(input_ids=ids, attention_mask=am, pad_token_id=PAD, do_sample=False, max_new_tokens=4)   # warm-up
    gen._prefill = slow_prefill
    gen(input_ids=ids, attention_mask=am, pad_token_id=PAD, do_sample=False, max_new_tokens=4)
    assert gen.stats["prefill_s"] >= 0.9 * 3 * sleep_s, (gen.stats, sleep_s)
    assert gen.stats["decode_s"] < 0.5 * sleep_s, (gen.stats, sleep_s)


def test_plain_transformer_and_no_padding():
    teacher = tiny_teacher()
    gen = FastGenerator(teacher)
    ids = torch.randint(0, 256, (2, 7))
    for kw in SETTINGS:
        ref, out = _both(teacher, gen, kw, ids=ids, am=torch.ones_like(ids))
        assert gen.last_fallback_reason is None
        assert torch.equal(out, ref)


def test_qwen3_family_hybrid():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from hybridize.convert.convert import convert_model

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                      pad_token_id=PAD, eos_token_id=257)
    cfg._attn_implementation = "sdpa"
    model = convert_model(Qwen3ForCausalLM(cfg).eval(), ["gla", "attn", "gla"], mixer="gla").eval()
    gen = FastGenerator(model)
    for kw in SETTINGS[:2]:
        ref, out = _both(model, gen, kw)
        assert torch.equal(out, ref)


def test_fallback_for_unsupported_settings():
    model, _ = tiny_hybrid(mixer="gla")
    gen = FastGenerator(model)
    ref, out = _both(model, gen, dict(do_sample=True, max_new_tokens=8, repetition_penalty=1.3))
    assert "RepetitionPenalty" in gen.last_fallback_reason
    assert torch.equal(out, ref)
    strict = FastGenerator(model, FastGenConfig(fallback=False))
    with pytest.raises(ValueError, match="fast generation cannot run"):
        strict(input_ids=ref[:, :9], max_new_tokens=4, num_beams=2)


def test_installed_into_model_and_removed():
    model, _ = tiny_hybrid(mixer="gla")
    ids, am = _batch()
    torch.manual_seed(3)
    ref = model.generate(input_ids=ids, attention_mask=am, do_sample=True, max_new_tokens=10, pad_token_id=PAD)
    with fast_generate_installed(model) as gen:
        assert model.generate is gen
        torch.manual_seed(3)
        out = model.generate(input_ids=ids, attention_mask=am, do_sample=True, max_new_tokens=10, pad_token_id=PAD)
        assert gen.last_fallback_reason is None and gen.stats["steps"] == 10
    assert "generate" not in vars(model)
    assert torch.equal(out, ref)
    assert torch.equal(fast_generate(model, ids, am, max_new_tokens=10, do_sample=False, pad_token_id=PAD),
                       model.generate(input_ids=ids, attention_mask=am, max_new_tokens=10, do_sample=False,
                                      pad_token_id=PAD))


def test_through_peft_wrapper():
    from peft import LoraConfig, get_peft_model

    model, _ = tiny_hybrid(mixer="gla")
    peft_model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    ids, am = _batch()
    kw = dict(input_ids=ids, attention_mask=am, do_sample=False, max_new_tokens=8, pad_token_id=PAD)
    ref = peft_model.generate(**kw)
    with fast_generate_installed(peft_model) as gen:
        out = peft_model.generate(**kw)
        assert gen is not None and gen.last_fallback_reason is None
    assert torch.equal(out, ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("compile_", ["off", "on"])
@pytest.mark.parametrize("mixer,settings", [("gla", None), ("sse", None), ("swa", {"swa": {"window": 5, "sinks": 2}})])
def test_cuda_graphs_same_tokens(mixer, settings, compile_):
    """On the GPU: the eager exact path equals HF generate; the CUDA-graph path equals the eager path
    with the same (whole-buffer, masked) layout, token for token; graphs are reused across calls (the window's
    decode step writes its ring in place inside the graph)."""
    model, _ = tiny_hybrid(mixer=mixer, mixer_settings=settings)
    model = model.cuda()
    exact = FastGenerator(model, FastGenConfig(cuda_graphs="off"))
    masked = FastGenerator(model, FastGenConfig(cuda_graphs="off", exact_lengths=False, bucket=16))
    graphs = FastGenerator(model, FastGenConfig(cuda_graphs="on", bucket=16, check_every=4, compile=compile_))
    ids, am = (t.cuda() for t in _batch())
    for kw in SETTINGS:
        kw = {**kw, "eos_token_id": EOS}
        ref, out = _both(model, exact, kw, ids=ids, am=am)
        assert torch.equal(out, ref), kw
        torch.manual_seed(1)
        a = masked(input_ids=ids, attention_mask=am, pad_token_id=PAD, **kw)
        torch.manual_seed(1)
        b = graphs(input_ids=ids, attention_mask=am, pad_token_id=PAD, **kw)
        assert graphs.stats["graphs"] or b.shape[1] <= 9 + 3
        assert torch.equal(a, b), kw
    n = len(graphs._sessions)
    _both(model, graphs, dict(do_sample=False, max_new_tokens=24), ids=ids, am=am)
    assert len(graphs._sessions) == n
    # other kernel options (which kernels a graph launches): another session, not the captured one
    from hybridize.ops.common.options import current_kernel_options, use_kernel_options

    before, flipped = list(graphs._sessions), not current_kernel_options().pdl
    with use_kernel_options(pdl=flipped):
        _both(model, graphs, dict(do_sample=False, max_new_tokens=24), ids=ids, am=am)
    newest = list(graphs._sessions)[-1]
    assert newest not in before and newest[-1].pdl == flipped


def test_compile_auto_switches_after_the_uncompiled_decode_time():
    """compile=auto (ski rental): a generator decodes uncompiled until its uncompiled decode time on the masked /
    graph path reaches compile_after_s, then its sessions compile; the tokens stay those of the uncompiled step.
    Never with a budget it does not reach, and never on the exact path (which a compiled step does not serve)."""
    model, _ = tiny_hybrid(mixer="sse", layers=2)
    ids, am = _batch()
    kw = dict(input_ids=ids, attention_mask=am, pad_token_id=PAD, do_sample=False, max_new_tokens=8)
    ref = FastGenerator(model, FastGenConfig(exact_lengths=False, bucket=16, compile="off"))(**kw)
    assert FastGenConfig().compile == "auto"   # the default (measured on an H100: RESULTS.md, "compile=auto")
    auto = FastGenerator(model, FastGenConfig(exact_lengths=False, bucket=16, compile_after_s=1e-9))
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    first = auto(**kw)
    assert not auto.stats["compiled"] and auto.uncompiled_decode_s > 0 and not counters["stats"]["unique_graphs"]
    second = auto(**kw)
    assert auto.stats["compiled"] and counters["stats"]["unique_graphs"] > 0   # the step went through dynamo
    assert torch.equal(first, ref) and torch.equal(second, ref)
    spent = auto.uncompiled_decode_s
    auto(**kw)
    assert auto.uncompiled_decode_s == spent   # compiled calls do not count
    never = FastGenerator(model, FastGenConfig(exact_lengths=False, bucket=16, compile="auto", compile_after_s=1e9))
    exact = FastGenerator(model, FastGenConfig(bucket=16, compile="auto", compile_after_s=0.0))
    for g in (never, never, exact, exact):
        assert torch.equal(g(**kw), ref) and not g.stats["compiled"]
    assert exact.uncompiled_decode_s == 0.0
    with pytest.raises(ValueError, match="compile_after_s"):
        FastGenerator(model, FastGenConfig(compile="auto", compile_after_s=-1.0))


def test_compile_auto_that_fails_decodes_uncompiled_with_a_warning(monkeypatch):
    """compile=auto is the default, so a compile that fails (no working inductor, an op dynamo cannot trace) must
    not fail the call: the call is redone uncompiled (same greedy tokens), a warning says why, and the generator
    does not try again. With compile=on, which the user asked for, the error is raised."""
    model, _ = tiny_hybrid(mixer="sse", layers=2)
    ids, am = _batch()
    kw = dict(input_ids=ids, attention_mask=am, pad_token_id=PAD, do_sample=False, max_new_tokens=8)
    ref = FastGenerator(model, FastGenConfig(exact_lengths=False, bucket=16, compile="off"))(**kw)
    tries = []

    def broken_compile(fn, **_):
        tries.append(fn)

        def run(*a, **k):
            raise RuntimeError("inductor: no working C compiler\nlong trace")
        return run

    monkeypatch.setattr(torch, "compile", broken_compile)
    gen = FastGenerator(model, FastGenConfig(exact_lengths=False, bucket=16, compile_after_s=0.0))
    with pytest.warns(RuntimeWarning, match="compiling the decode step failed .RuntimeError: inductor: no working"):
        out = gen(**kw)
    assert torch.equal(out, ref) and not gen.stats["compiled"] and len(tries) == 1
    assert gen.compile_failed == "RuntimeError: inductor: no working C compiler"
    assert torch.equal(gen(**kw), ref) and len(tries) == 1   # not tried again
    on = FastGenerator(model, FastGenConfig(exact_lengths=False, bucket=16, compile="on"))
    with pytest.raises(RuntimeError, match="no working C compiler"):
        on(**kw)


def test_kernel_options_read_once_per_call(monkeypatch):
    """The engine reads the environment's kernel options once per call, not per op (that read was about 100
    reads of every HYBRIDIZE_* variable per prefill at the 135M shape); an explicit setting still wins."""
    from hybridize.ops.common import options

    model, _ = tiny_hybrid(mixer="sse")
    gen = FastGenerator(model, FastGenConfig(compile="off"))
    reads = []
    real = options._env_options
    monkeypatch.setattr(options, "_env_options", lambda: reads.append(1) or real())
    ids, am = _batch()
    gen(input_ids=ids, attention_mask=am, pad_token_id=PAD, do_sample=False, max_new_tokens=5)
    assert len(reads) == 1
    reads.clear()
    seen = []
    real_prefill = FastGenerator._prefill
    monkeypatch.setattr(FastGenerator, "_prefill", lambda self, *a: seen.append(options.current_kernel_options())
                        or real_prefill(self, *a))
    with options.use_kernel_options(sse_fused_prefill=False):
        reads.clear()   # entering the block read the options it changes
        gen(input_ids=ids, attention_mask=am, pad_token_id=PAD, do_sample=False, max_new_tokens=2)
    assert reads == [] and seen and all(o.sse_fused_prefill is False for o in seen)
