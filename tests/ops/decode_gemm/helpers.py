"""Shared checks for the decode-step stacking options (`FastGenConfig.stack_mlp`, `stack_qkv`)."""
from __future__ import annotations

import torch


def stacked_run_agrees(model, option: str):
    """A function that decodes the tiny batch greedily with `FastGenConfig(option=True)` and `(option=False)`
    (CPU, mode "triton": the stacked GEMM through F.linear), asserts the same tokens and logits within fp32 rounding,
    and returns the stacked run's logits. Its generators are made once, so repeated calls reuse their caches."""
    from hybridize.generation.fast import FastGenConfig, FastGenerator
    from tests.rl.helpers import byte_tokenizer, left_padded_batch

    pad = byte_tokenizer().pad_token_id
    ids, am = left_padded_batch()
    gens = {on: FastGenerator(model, FastGenConfig(record_logits=True, exact_lengths=False, gemm="triton",
                                                   **{option: on})) for on in (True, False)}

    def run():
        outs = {}
        for on, gen in gens.items():
            toks = gen(input_ids=ids, attention_mask=am, pad_token_id=pad, do_sample=False, max_new_tokens=5)
            outs[on] = (toks, gen.last_logits)
        assert torch.equal(outs[True][0], outs[False][0])
        for a, b in zip(outs[True][1], outs[False][1]):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())
        return outs[True][1]
    return run
