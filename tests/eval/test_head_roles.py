"""benchmarks/pipeline/head_roles.py: the two head probes on attention maps whose answer is known."""
import torch

from benchmarks.pipeline.head_roles import induction_scores, previous_token_scores


def test_a_head_on_the_previous_token_scores_one_and_a_uniform_head_less():
    T = 40
    prev = torch.zeros(T, T)
    prev[0, 0] = 1
    prev[torch.arange(1, T), torch.arange(T - 1)] = 1
    uniform = torch.tril(torch.ones(T, T))
    uniform = uniform / uniform.sum(-1, keepdim=True)
    s = previous_token_scores([torch.stack([prev, uniform])], skip=4)
    assert s.shape == (1, 2)
    assert s[0, 0] == 1 and s[0, 1] < 0.1


def test_an_induction_head_reads_the_token_after_the_earlier_occurrence():
    start, period = 1, 10
    T = start + 2 * period
    ind = torch.zeros(T, T)
    for t in range(T):
        src = t - period + 1 if t >= start + period else t   # the second copy reads the first copy's next token
        ind[t, src] = 1
    prev = torch.zeros(T, T)
    prev[0, 0] = 1
    prev[torch.arange(1, T), torch.arange(T - 1)] = 1
    s = induction_scores([torch.stack([ind, prev])], start, period)
    assert s[0, 0] == 1 and s[0, 1] == 0
