"""Stage B's hidden-state term: the inputs of the student's softmax layers against the teacher's."""
from __future__ import annotations

import pytest
import torch

from hybridize.convert.convert import convert_model
from hybridize.distill.e2e import e2e_loss, hidden_error, softmax_layer_indices
from tests.convert.common import tiny_teacher


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 90, (2, 13), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    return {"input_ids": ids, "attention_mask": mask}


def test_hidden_term_is_zero_for_the_teachers_own_layers_and_positive_after_a_converted_one():
    teacher = tiny_teacher("llama")
    same = convert_model(teacher, "none", mixer="gla").eval()
    hybrid = convert_model(teacher, "gla,attn,attn").eval()
    assert softmax_layer_indices(hybrid) == [1, 2] and softmax_layer_indices(teacher) == []
    b = _batch()
    _, parts0 = e2e_loss(same, teacher, b, hidden_weight=1.0, hidden_layers=softmax_layer_indices(same))
    assert parts0["hidden"] < 1e-10
    base, p_base = e2e_loss(hybrid, teacher, b)
    loss, parts = e2e_loss(hybrid, teacher, b, hidden_weight=0.5, hidden_layers=[1, 2])
    assert "hidden" not in p_base and parts["hidden"] > 1e-4
    assert loss.item() == pytest.approx(base.item() + 0.5 * parts["hidden"].item(), rel=1e-5)


def test_hidden_term_trains_the_converted_layer_below_a_kept_one():
    teacher = tiny_teacher("llama")
    hybrid = convert_model(teacher, "gla,attn,attn").train()
    loss, _ = e2e_loss(hybrid, teacher, _batch(), kl_weight=0.0, ce_weight=0.0, hidden_weight=1.0,
                       hidden_layers=[1])
    loss.backward()
    grads = [p.grad for n, p in hybrid.named_parameters() if n.startswith("model.layers.0.")]
    assert any(g is not None and g.abs().sum() > 0 for g in grads)
    assert all(p.grad is None or p.grad.abs().sum() == 0
               for n, p in hybrid.named_parameters() if n.startswith("model.layers.2."))   # above layer 1's input


def test_hidden_error_counts_only_masked_tokens():
    h_t = (torch.ones(1, 3, 2), torch.ones(1, 3, 2))
    h_s = (torch.ones(1, 3, 2), torch.tensor([[[1.0, 1.0], [1.0, 1.0], [5.0, 5.0]]]))
    assert hidden_error(h_s, h_t, [1], torch.tensor([[1, 1, 0]])) == 0
    assert hidden_error(h_s, h_t, [1], None) == pytest.approx(32 / 6)


def test_e2e_refuses_a_hidden_weight_without_softmax_layers(tmp_path):
    from hybridize.distill.config import E2EConfig, load_config
    from hybridize.distill.e2e import e2e
    from hybridize.errors import UserError

    teacher = tiny_teacher("llama")
    student = convert_model(teacher, "all", mixer="gla")
    cfg = load_config(E2EConfig, None, {"hidden_weight": 1.0, "train": {"run_dir": str(tmp_path / "r")}})
    with pytest.raises(UserError, match="hidden_weight > 0 needs"):
        e2e(student, teacher, None, cfg)
