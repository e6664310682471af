"""From per-layer scores to the K layers that keep softmax attention.

- rank: the K highest scores (a score is a cost of converting, or an attention mass: higher = keep);
  ties go to the lower layer index.
- combined: each criterion's scores become rank percentiles (0 = lowest layer, 1 = highest) and a layer's
  combined score is their mean. Ranks, not values, because the scales differ by orders of magnitude (KL in
  nats with a heavy tail at the first layers, NLL increases, attention mass in [0, 1]).
- greedy (`greedy_choice`): start from every layer converted; at each step try keeping each candidate
  (the `candidates` best by single-layer KL, not yet kept) softmax, measure the KL of the resulting hybrid
  and keep the one with the lowest; K steps. This is the greedy addition of "Distilling to Hybrid Attention
  Models via KL-Guided Layer Selection", restricted to a candidate pool so it costs K x candidates
  evaluations instead of K x L.
"""
from __future__ import annotations

from typing import Callable


def rank_choice(scores: dict[int, float], keep: int) -> list[int]:
    """The `keep` layers with the highest scores, sorted by index."""
    order = sorted(scores, key=lambda i: (-scores[i], i))
    return sorted(order[:keep])


def rank_percentiles(scores: dict[int, float]) -> dict[int, float]:
    """{layer: rank / (n - 1)} with rank 0 for the lowest score (ties share the mean rank)."""
    order = sorted(scores, key=lambda i: scores[i])
    n = len(order)
    out: dict[int, float] = {}
    k = 0
    while k < n:
        j = k
        while j + 1 < n and scores[order[j + 1]] == scores[order[k]]:
            j += 1
        for m in range(k, j + 1):
            out[order[m]] = (k + j) / 2 / max(n - 1, 1)
        k = j + 1
    return out


def combined_scores(per_criterion: dict[str, dict[int, float]]) -> dict[int, float]:
    """Mean rank percentile over the criteria (every criterion must score the same layers)."""
    pct = [rank_percentiles(s) for s in per_criterion.values()]
    layers = sorted(pct[0])
    return {i: sum(p[i] for p in pct) / len(pct) for i in layers}


def greedy_choice(cost: Callable[[list[int]], float], single: dict[int, float], keep: int, candidates: int,
                  done: list[dict], on_step: Callable[[dict], None]) -> list[int]:
    """Greedy addition of kept layers; `cost(kept)` = KL of the hybrid keeping `kept` softmax. `done`: steps
    recorded before (a resumed run continues after them); `on_step` records each new step."""
    steps = list(done[:keep])
    pool = sorted(single, key=lambda i: (-single[i], i))[:candidates]
    while len(steps) < keep:
        kept = [s["layer"] for s in steps]
        trials = {c: cost(kept + [c]) for c in pool if c not in kept}
        if not trials:  # the pool is used up: fill from the single-layer ranking
            c = next(i for i in sorted(single, key=lambda i: (-single[i], i)) if i not in kept)
            trials = {c: cost(kept + [c])}
        best = min(trials, key=lambda c: (trials[c], c))
        step = {"step": len(steps) + 1, "layer": best, "kl": trials[best],
                "tried": {str(c): v for c, v in trials.items()}}
        steps.append(step)
        on_step(step)
    return sorted(s["layer"] for s in steps)


def plan_string(kept: list[int], windows: list[int] = ()) -> str:
    """The explicit plan spelling: `kept` keep softmax, `windows` get sliding-window attention, every other layer
    gets the mixer."""
    plan = "attn=" + ",".join(str(i) for i in sorted(kept))
    return plan + (";swa=" + ",".join(str(i) for i in sorted(windows)) if windows else "")


def window_choice(previous_token: dict[int, float], kept: list[int], windows: int) -> list[int]:
    """The `windows` layers outside `kept` with the strongest previous-token heads."""
    return rank_choice({i: v for i, v in previous_token.items() if i not in kept}, windows) if windows else []
