"""Stage B's attention term (`hybridize/distill/attention_transfer.py`): the recorded queries and keys give the
kept layers' attention exactly (against eager attention's probabilities), packed documents see only their own
keys, the term is 0 for the teacher's own layers and trains the converted layer below a kept one."""
from __future__ import annotations

import pytest
import torch

from hybridize.convert.convert import convert_model
from hybridize.distill.attention_transfer import (ATTENTION, attention_kl, attention_logprobs, probe_attention,
                                                  record, sample_queries)
from hybridize.distill.e2e import e2e_loss
from tests.convert.common import tiny_teacher


def _ids(B=2, T=21, seed=0):
    return torch.randint(3, 90, (B, T), generator=torch.Generator().manual_seed(seed))


def test_recorded_attention_equals_eager_probabilities_and_outputs_are_unchanged():
    teacher = tiny_teacher("llama").eval()
    assert teacher.config.num_key_value_heads < teacher.config.num_attention_heads   # grouped keys repeated
    ids = _ids()
    plain = teacher(input_ids=ids).logits
    with probe_attention(teacher), record([0, 2]) as rec:
        assert teacher.config._attn_implementation == ATTENTION
        probed = teacher(input_ids=ids).logits
    assert teacher.config._attn_implementation != ATTENTION    # restored
    torch.testing.assert_close(probed, plain)
    rows, keys = sample_queries(None, None, ids.shape, 6, min_keys=1)
    teacher.set_attn_implementation("eager")
    probs = teacher(input_ids=ids, output_attentions=True).attentions
    for layer in (0, 2):
        A = probs[layer]                                   # [B, H, T, T]
        want = A.gather(2, rows[:, None, :, None].expand(A.shape[0], A.shape[1], rows.shape[1], A.shape[-1]))
        torch.testing.assert_close(attention_logprobs(rec, layer, rows, keys).exp(), want, atol=1e-6, rtol=1e-5)


def test_packed_documents_attend_only_inside_themselves():
    """A query of the second document of a packed row has the attention it has when that document runs alone."""
    teacher = tiny_teacher("llama").eval()
    a, b = _ids(1, 9, seed=1), _ids(1, 12, seed=2)
    packed = torch.cat([a, b], 1)
    pos = torch.cat([torch.arange(9), torch.arange(12)])[None]
    rows, keys = sample_queries(pos, None, packed.shape, 8, min_keys=1)
    assert not keys[0, rows[0] >= 9][:, :9].any()          # no key of document 1 for a query of document 2
    assert keys[0, rows[0] >= 9].sum(-1).tolist() == (pos[0, rows[0][rows[0] >= 9]] + 1).tolist()
    with probe_attention(teacher):   # no cache: transformers finds the packed documents from position_ids then
        with record([1]) as rp:
            teacher(input_ids=packed, position_ids=pos, use_cache=False)
        with record([1]) as ra:
            teacher(input_ids=b, use_cache=False)
    last = torch.tensor([[20]])                            # the last token of document 2, which sees keys 9..20
    got = attention_logprobs(rp, 1, last, (torch.arange(21) >= 9)[None, None])
    alone = attention_logprobs(ra, 1, torch.tensor([[11]]), torch.ones(1, 1, 12, dtype=torch.bool))
    torch.testing.assert_close(got[..., 9:].exp(), alone.exp(), atol=1e-6, rtol=1e-5)


def test_padding_keys_are_never_seen():
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :4] = 0                                        # left padding
    rows, keys = sample_queries(None, mask, (2, 10), 5, min_keys=2)
    assert not keys[1, :, :4].any() and (rows[1] >= 5).all()   # a real token that sees at least 2 real keys


def test_term_is_zero_for_the_teachers_own_layers_and_trains_the_converted_layer_below():
    teacher = tiny_teacher("llama").eval()
    same = convert_model(teacher, "none", mixer="gla").eval()
    hybrid = convert_model(teacher, "gla,attn,attn").train()
    batch = {"input_ids": _ids(), "attention_mask": torch.ones(2, 21, dtype=torch.long)}
    with probe_attention(same, teacher):
        _, p0 = e2e_loss(same, teacher, batch, hidden_layers=[0, 1, 2], attn_weight=1.0, attn_queries=8)
    assert p0["attn"] < 1e-9
    with probe_attention(hybrid, teacher):
        base, pb = e2e_loss(hybrid, teacher, batch)
        torch.manual_seed(0)
        loss, parts = e2e_loss(hybrid, teacher, batch, hidden_layers=[1, 2], attn_weight=0.5, attn_queries=8)
        assert "attn" not in pb and parts["attn"] > 1e-6
        assert loss.item() == pytest.approx(base.item() + 0.5 * parts["attn"].item(), rel=1e-5)
        only, _ = e2e_loss(hybrid, teacher, batch, kl_weight=0.0, ce_weight=0.0, hidden_layers=[1],
                           attn_weight=1.0, attn_queries=8)
    only.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0
               for n, p in hybrid.named_parameters() if n.startswith("model.layers.0."))
    assert all(p.grad is None or p.grad.abs().sum() == 0
               for n, p in hybrid.named_parameters() if n.startswith("model.layers.2."))   # above layer 1's attention


def test_without_the_probe_the_term_says_so():
    teacher = tiny_teacher("llama").eval()
    hybrid = convert_model(teacher, "gla,attn,attn").eval()
    with pytest.raises(RuntimeError, match="probe_attention"):
        e2e_loss(hybrid, teacher, {"input_ids": _ids()}, hidden_layers=[1], attn_weight=1.0, attn_queries=4)


def test_kl_of_a_row_against_itself_and_a_shifted_one():
    """KL per row: 0 for equal maps, the closed form for two known distributions over two keys."""
    from hybridize.distill.attention_transfer import Recording

    def rec(qv):
        r = Recording(frozenset([0]))
        r.queries[0] = torch.tensor(qv).view(1, 1, 2, 1)     # [B, H, T, D]: the second query's two logits
        r.keys[0] = torch.tensor([1.0, 0.0]).view(1, 1, 2, 1)
        r.scaling[0] = 1.0
        return r
    rows, keys = torch.tensor([[1]]), torch.ones(1, 1, 2, dtype=torch.bool)
    t, s = rec([0.0, 2.0]), rec([0.0, 0.0])                  # teacher logits (2, 0), student (0, 0)
    pt = torch.tensor([2.0, 0.0]).softmax(0)
    want = (pt * (pt.log() - torch.tensor(0.5).log())).sum()
    assert attention_kl(s, t, [0], rows, keys).item() == pytest.approx(want.item(), rel=1e-6)
    assert attention_kl(t, t, [0], rows, keys).item() == 0.0


@pytest.mark.parametrize("checkpointing", [False, True])
def test_e2e_logs_the_term_and_saves_the_attention_it_loaded_with(tmp_path, checkpointing):
    """Also under gradient checkpointing (stage B's recipes use it): the recompute in the backward runs the
    probe's attention without recording, so it rebuilds the same tensors."""
    import json

    from hybridize.distill.config import E2EConfig
    from hybridize.distill.e2e import e2e
    from tests.distill.helpers import ToyTokenizer, tiny_llama
    from tests.distill.test_train import _cfg

    teacher = tiny_llama(0)
    student = convert_model(tiny_llama(0), "gla,attn,attn")
    cfg = _cfg(E2EConfig, tmp_path, "r", steps=3, attn_weight=1.0, attn_queries=4,
               gradient_checkpointing=checkpointing)
    _, trained = e2e(student, teacher, ToyTokenizer(), cfg)
    rows = [json.loads(l) for l in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [r["attn"] for r in rows if "loss" in r] and all(r["attn"] > 0 for r in rows if "loss" in r)
    assert trained.config._attn_implementation == "sdpa" and teacher.config._attn_implementation == "sdpa"
    assert ATTENTION not in (tmp_path / "r" / "final" / "config.json").read_text()


def test_e2e_refuses_an_attn_weight_without_softmax_layers(tmp_path):
    from hybridize.distill.config import E2EConfig, load_config
    from hybridize.distill.e2e import e2e
    from hybridize.errors import UserError

    teacher = tiny_teacher("llama")
    student = convert_model(teacher, "all", mixer="gla")
    cfg = load_config(E2EConfig, None, {"attn_weight": 1.0, "train": {"run_dir": str(tmp_path / "r")}})
    with pytest.raises(UserError, match="attn_weight > 0 needs"):
        e2e(student, teacher, None, cfg)


def test_gradient_checkpointing_gives_the_same_gradients():
    teacher = tiny_teacher("llama").eval()
    batch = {"input_ids": _ids(), "attention_mask": torch.ones(2, 21, dtype=torch.long)}
    grads = []
    for ckpt in (False, True):
        hybrid = convert_model(teacher, "gla,attn,attn").train()
        if ckpt:
            hybrid.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        with probe_attention(hybrid, teacher):
            torch.manual_seed(0)
            loss, _ = e2e_loss(hybrid, teacher, batch, kl_weight=0.0, ce_weight=0.0, hidden_layers=[1, 2],
                               attn_weight=1.0, attn_queries=8)
            loss.backward()
        grads.append({n: p.grad.clone() for n, p in hybrid.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and any(n.startswith("model.layers.0.") for n in grads[0])
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], atol=1e-6, rtol=1e-5)


def test_repeats_marks_tokens_seen_before_in_their_own_document():
    from hybridize.distill.attention_transfer import repeats

    ids = torch.tensor([[5, 6, 5, 7, 6, 5, 5, 8, 5]])
    doc = torch.tensor([[1, 1, 1, 1, 1, 1, 2, 2, 2]])
    assert repeats(ids, doc).int().tolist() == [[0, 0, 1, 0, 1, 1, 0, 0, 1]]   # the 7th token starts document 2


def test_repeat_rows_are_drawn_only_where_a_token_recurs():
    ids = torch.tensor([[3, 4, 5, 3, 6, 7, 4, 8, 9, 10, 11, 12]])
    rows, keys = sample_queries(None, None, ids.shape, 16, min_keys=1, input_ids=ids)
    assert set(rows[0].tolist()) == {3, 6}
    none_recur = torch.arange(12)[None] + 3
    rows, _ = sample_queries(None, None, ids.shape, 16, min_keys=1, input_ids=none_recur)
    assert len(set(rows[0].tolist())) > 2          # no repeat in the row: any position, as without input_ids


def test_e2e_refuses_an_unknown_attn_rows(tmp_path):
    from hybridize.distill.config import E2EConfig, load_config
    from hybridize.distill.e2e import e2e
    from hybridize.errors import UserError

    teacher = tiny_teacher("llama")
    student = convert_model(teacher, "gla,attn,attn")
    cfg = load_config(E2EConfig, None, {"attn_weight": 1.0, "attn_rows": "copies",
                                        "train": {"run_dir": str(tmp_path / "r")}})
    with pytest.raises(UserError, match="attn_rows='copies'"):
        e2e(student, teacher, None, cfg)


def test_loss_with_repeat_rows():
    teacher = tiny_teacher("llama").eval()
    hybrid = convert_model(teacher, "gla,attn,attn").eval()
    ids = torch.tensor([[3, 4, 5, 3, 6, 7, 4, 8, 9, 3, 11, 12, 5, 4]])
    with probe_attention(hybrid, teacher):
        _, parts = e2e_loss(hybrid, teacher, {"input_ids": ids}, hidden_layers=[1, 2], attn_weight=1.0,
                            attn_queries=4, attn_rows="repeats")
    assert parts["attn"] > 0
