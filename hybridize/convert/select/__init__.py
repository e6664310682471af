"""Measured layer selection (`hybridize select`): which K layers of a teacher keep softmax
attention, from measurements on the teacher; the result is a plan in the spelling `convert --layers` takes
("attn=3,9,15,21,27"), plus a per-layer score table and plot.

Criteria (`--criterion`; a higher score keeps softmax):

- `kl` (default): every layer is converted once and all mixers are aligned together for a few steps
  (stage A's layer-local loss, `align.py`); then for each layer i the teacher with ONLY layer i converted
  (to its aligned mixer) is run on training text and scored by KL(teacher || that model), mean nats per
  token, against the teacher's cached activations (`probe.py`). The K costliest layers keep softmax.
  `--greedy` refines this: starting from all layers converted, keep softmax one layer at a time, each time
  the candidate whose return lowers the hybrid's KL most (`choose.py`).
- `needle`: the same one-layer-converted models, scored by the increase of the teacher-forced negative
  log-likelihood of the answer on S-NIAH prompts (`needle.py`): the cost in needle recall, read as the
  answer's NLL rather than greedy-generation accuracy (continuous, and one forward per prompt). Measured
  along with `kl` whenever `--needle-samples` > 0, so the table shows both.
- `retrieval`: no conversion: the teacher's attention on S-NIAH prompts; a layer scores by the attention mass
  its most retrieving head puts on the needle's value tokens from the positions that copy the answer
  (`retrieval.py`).
- `combined`: the mean of a layer's rank percentiles under kl, needle and retrieval (`choose.py`).
- `copying`: no conversion: the teacher's induction heads (attention on the token after an earlier occurrence
  of the current one, on random tokens repeated once); `--windows N` gives the N other layers with the
  strongest previous-token heads sliding-window attention, so the plan reads `attn=...;swa=...`
  (`copying.py`).

Which readings of the literature this implements:
- the `kl` score is the one-layer replacement probe of "Apriel-H1: Towards Efficient Enterprise Reasoning
  Models" (their MIL-Mamba-Replacement: each layer alone replaced by a freshly initialised mixer, briefly
  distilled, ranked by the resulting loss), with the cost measured as KL to the teacher's distribution as in
  "Distilling to Hybrid Attention Models via KL-Guided Layer Selection" (fla's hybrid-distillation). It
  departs from both: the brief training is layer-local attention transfer of all mixers at once (one run,
  not one per layer), and the KL paper scores the other way round (an all-linear student, distilled with
  hidden-state alignment then KL, with ONE layer restored to softmax, ranked by the KL reduction).
- `--greedy` is that paper's greedy addition from the all-converted model, on our aligned (not KL-trained)
  all-converted student and a candidate pool of the best single-layer scores.
- HALO ("Hybrid Linear Attention Done Right", the pipeline behind HypeNet) ranks layers, as we read the
  summaries available to us, by what each one is worth on recall-heavy tasks against general ones; we take
  that idea only: `needle` and `retrieval` are our recall-side signals, and `combined` mixes recall and the
  general (KL) signal by ranks, not by HALO's own formula.

Resuming: scores go to OUT/select.json after every layer and the aligned mixers to OUT/aligned.safetensors;
a rerun with the same teacher and measurement settings measures only what is missing (`record.py`).
"""
from .config import CRITERIA, SelectConfig
from .run import run_select

__all__ = ["CRITERIA", "SelectConfig", "run_select"]
