"""Packing: positions restart per document and row; packed rows give the same losses as the same
documents unpacked (padded rows with an attention mask), for softmax (sdpa, eager) and linear layers."""
from __future__ import annotations

import pytest
import torch

from hybridize.distill.data import PackedData, pack_docs_exact, pack_rows, pad_docs
from hybridize.distill.e2e import e2e_loss
from hybridize.distill.losses import kl_to_teacher, next_token_mask

from .helpers import tiny_llama, toy_convert


def _docs(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 96, (n,), generator=g).tolist() for n in lengths]


def test_pack_rows_positions_restart():
    ids, pos = pack_rows(_docs([5, 3, 9]), seq_len=6)  # 17 tokens -> 2 rows, tail dropped
    assert ids.shape == (2, 6)
    assert pos.tolist() == [[0, 1, 2, 3, 4, 0], [0, 1, 0, 1, 2, 3]]


def test_packed_data_is_a_function_of_step():
    docs = _docs([7] * 20)
    a = PackedData(docs, seq_len=8, batch_tokens=16, grad_accum=2, seed=3)
    b = PackedData(docs, seq_len=8, batch_tokens=16, grad_accum=2, seed=3)
    for step, micro in [(0, 0), (5, 1), (40, 0)]:  # step 40 wraps several epochs
        assert torch.equal(a.batch(step, micro)["input_ids"], b.batch(step, micro)["input_ids"])
    assert not torch.equal(a.batch(0, 0)["input_ids"], a.batch(0, 1)["input_ids"])
    # every row of one epoch is used once
    n = a.rows_for(8)[0].shape[0]
    rows = [r for s in range(n // 4 + 1) for m in range(2) for r in a.batch(s, m)["input_ids"].view(-1, 8).tolist()]
    first_epoch = {tuple(r) for r in rows[:n]}
    assert len(first_epoch) == len({tuple(r) for r in a.rows_for(8)[0].tolist()})


def test_seq_len_schedule_switches_row_length():
    d = PackedData(_docs([9] * 30), seq_len=8, schedule=[[0, 8], [3, 16]], batch_tokens=32)
    assert d.batch(2, 0)["input_ids"].shape == (1, 32) and d.phase_of(2)[2] == 8
    assert d.phase_of(3)[2] == 16 and d.tokens_per_step(3) == 32


def test_next_token_mask_packed_equals_padded():
    docs = _docs([4, 2, 5])
    p, u = pack_docs_exact(docs), pad_docs(docs)
    assert next_token_mask(p["position_ids"], None, p["input_ids"].shape).sum() == 3 + 1 + 4
    assert next_token_mask(u["position_ids"], u["attention_mask"], u["input_ids"].shape).sum() == 8


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("converted", [False, True])
def test_packed_loss_equals_unpacked(attn, converted):
    teacher = tiny_llama(seed=0, attn=attn)
    student = tiny_llama(seed=1, attn=attn)
    if converted:
        student = toy_convert(student, layers=(0, 2))
    teacher, student = teacher.double(), student.double()  # fp64: compare to 1e-10
    tol = 1e-10 if attn == "sdpa" else 1e-6  # eager runs its softmax in fp32 even for fp64 inputs
    docs = _docs([7, 3, 12, 5])
    packed, padded = pack_docs_exact(docs), pad_docs(docs)
    with torch.no_grad():
        lp, pp = e2e_loss(student, teacher, packed, 1.0, 0.5, 2.0)
        lu, pu = e2e_loss(student, teacher, padded, 1.0, 0.5, 2.0)
    for k in ("kl", "ce"):
        assert abs(float(pp[k]) - float(pu[k])) <= tol * abs(float(pu[k])), (k, pp[k], pu[k])
    assert abs(float(lp) - float(lu)) <= tol * abs(float(lu))
    # and packing really isolates documents: logits of the 2nd doc equal those of it alone
    with torch.no_grad():
        alone = student(input_ids=torch.tensor([docs[1]]), use_cache=False).logits
        full = student(**packed, use_cache=False).logits[:, 7:10]
    assert (full - alone).abs().max() <= tol * alone.abs().max()


def test_packing_without_position_restart_would_leak():
    """Control: the same row with plain 0..T-1 positions gives different logits (the test can fail)."""
    student = toy_convert(tiny_llama(seed=1), layers=(0,))
    docs = _docs([7, 3])
    packed = pack_docs_exact(docs)
    with torch.no_grad():
        a = student(**packed, use_cache=False).logits[:, 7:]
        b = student(input_ids=packed["input_ids"], use_cache=False).logits[:, 7:]
    assert (a - b).abs().max() > 1e-3


def test_kl_zero_for_identical_logits_and_temperature_scaling():
    x = torch.randn(1, 5, 11)
    m = torch.ones(1, 5, dtype=torch.bool)
    assert kl_to_teacher(x, x, m).abs() < 1e-6
    y = torch.randn(1, 5, 11)
    ref = (torch.softmax(y, -1) * (torch.log_softmax(y, -1) - torch.log_softmax(x, -1))).sum(-1).mean()
    assert torch.allclose(kl_to_teacher(x, y, m), ref, rtol=1e-5)


class _Tok:
    """A toy tokenizer: one id per character (ord % 90 + 3); `bos` put first when encoding with special tokens."""

    eos_token_id = 2

    def __init__(self, bos=None):
        self.bos = bos

    def __call__(self, texts, add_special_tokens=True):
        one = isinstance(texts, str)
        out = [[ord(c) % 90 + 3 for c in t] for t in ([texts] if one else texts)]
        if add_special_tokens and self.bos is not None:
            out = [[self.bos] + x for x in out]
        return {"input_ids": out[0] if one else out}


def test_documents_start_with_the_tokenizers_bos():
    from hybridize.distill.data import special_prefix, tokenize_docs
    assert special_prefix(_Tok()) == [] and special_prefix(_Tok(bos=1)) == [1]
    assert tokenize_docs(_Tok(), ["ab", "", "c"]) == [[10, 11, 2], [12, 2]]
    assert tokenize_docs(_Tok(bos=1), ["ab", "c"]) == [[1, 10, 11, 2], [1, 12, 2]]


def test_pack_rows_with_a_prefix_starts_every_row_with_it():
    """A row cut inside a document begins with the BOS too (Gemma-style models need it at every sequence
    start); a row at a document start does not get a second one; no token of the stream is lost or reordered."""
    docs = [[1] + d for d in _docs([9, 4, 13, 6])]          # documents as tokenize_docs makes them
    ids, pos = pack_rows(docs, seq_len=6, prefix=[1])
    assert (ids[:, 0] == 1).all() and (pos[:, 0] == 0).all()
    stream = [t for d in docs for t in d]
    # drop the prefix that rows cut inside a document received, then the stream must come back in order
    rebuilt, k = [], 0
    for r in ids.tolist():
        if stream[k] != 1:        # this row started inside a document: its first id is the added prefix
            r = r[1:]
        rebuilt += r
        k += len(r)
    assert rebuilt == stream[:len(rebuilt)] and len(stream) - len(rebuilt) < 6
    assert all(p2 == 0 for row, prow in zip(ids.tolist(), pos.tolist())
                        for t, p2 in zip(row, prow) if t == 1)   # every BOS starts a sequence
    # without a prefix nothing changes
    a, b = pack_rows(_docs([5, 3, 9]), seq_len=6), pack_rows(_docs([5, 3, 9]), seq_len=6, prefix=())
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
