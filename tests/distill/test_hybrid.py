"""The stages on models made by the project's converter (tiny random Llama teacher, real mixers)."""
from __future__ import annotations

import pytest
import torch

from hybridize.convert.convert import convert_model
from hybridize.distill.align import LayerAligner, TeacherTap
from hybridize.distill.data import pack_docs_exact, pad_docs
from hybridize.distill.e2e import e2e_loss
from hybridize.distill.models import converted_layers, select_trainable

from .helpers import tiny_llama


def _docs(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 96, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("mixer", ["sse", "gla", "gdn"])
def test_packed_equals_unpacked_on_converted_model(mixer):
    teacher = tiny_llama(0).double()
    student = convert_model(teacher, "2:1", mixer=mixer)  # layers 0, 1 converted, 2 softmax
    docs = _docs([7, 3, 12, 5])
    with torch.no_grad():
        lp, pp = e2e_loss(student, teacher, pack_docs_exact(docs), 1.0, 0.5, 1.5)
        lu, pu = e2e_loss(student, teacher, pad_docs(docs), 1.0, 0.5, 1.5)
    for k in pu:
        assert abs(float(pp[k]) - float(pu[k])) <= 1e-10 * max(abs(float(pu[k])), 1e-12), (k, pp[k], pu[k])


def test_align_step_on_sse_matches_teacher_attention_when_exact():
    """TeacherTap + LayerAligner: the targets are the teacher attention outputs, and feeding the
    teacher's own attention as the 'student' gives zero loss (the plumbing passes the right inputs)."""
    teacher = tiny_llama(0).double()
    batch = pack_docs_exact(_docs([6, 9]))
    tap = TeacherTap(teacher, [0, 2])
    records = tap.run(batch)
    tap.close()
    same = LayerAligner({i: teacher.model.layers[i].self_attn for i in (0, 2)}, "mse")
    loss, _ = same(records)
    assert float(loss) == 0.0
    student = convert_model(teacher, "2:1", mixer="sse").train()  # SSE returns aux only in training
    conv = converted_layers(student)
    assert sorted(conv) == [0, 1]
    names = select_trainable(student, "mixer")
    assert names and all(n.startswith(("model.layers.0.self_attn.", "model.layers.1.self_attn.")) for n in names)
    tap = TeacherTap(teacher, [0, 1])
    aligner = LayerAligner({i: conv[i] for i in (0, 1)}, "nmse")
    loss, parts = aligner(tap.run(batch))
    tap.close()
    assert "aux" in parts  # SSE's balance loss is part of the stage A objective
    loss.backward()
    grads = {n for n, p in student.named_parameters() if p.grad is not None}
    assert grads and grads <= set(names)
    assert any("router" in n or "lora" in n or "gate" in n for n in grads), sorted(grads)[:8]


def test_align_checkpointing_gives_the_same_loss_and_gradients():
    """`gradient_checkpointing=true` in stage A recomputes each SSE adapter in the backward: same loss, same
    aux loss, same gradient on every parameter (the router's included) as keeping the activations."""
    teacher = tiny_llama(0).double()
    student = convert_model(teacher, "2:1", mixer="sse").train().double()
    conv = converted_layers(student)
    select_trainable(student, "mixer")
    tap = TeacherTap(teacher, [0, 1])
    records = tap.run(pack_docs_exact(_docs([6, 9])))
    tap.close()
    grads, losses, kept = [], [], []
    for ckpt in (False, True):
        student.zero_grad(set_to_none=True)
        saved = []

        def pack(t):
            saved.append(t.numel())
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss, parts = LayerAligner({i: conv[i] for i in (0, 1)}, "nmse", checkpoint=ckpt)(records)
        kept.append(sum(saved))
        loss.backward()
        losses.append((float(loss), float(parts["aux"])))
        grads.append({n: p.grad.clone() for n, p in student.named_parameters() if p.grad is not None})
    assert losses[0] == losses[1]
    assert kept[1] < kept[0] / 3, kept  # the mixers' activations are not kept for the backward
    assert grads[0].keys() == grads[1].keys() and any("router" in n for n in grads[0])
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-12, atol=1e-14, msg=n)
