"""Settings of `hybridize select` and their checks against the teacher's config (bad input -> one UserError
line, before the teacher loads)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from hybridize.errors import UserError

CRITERIA = ("kl", "needle", "retrieval", "combined", "copying")
#: text that evaluates models (held-out perplexity of `eval recovery`, `distill data.eval`): never selects
EVALUATION_TEXTS = ("python-reference",)
#: tokens kept free after a needle prompt for its teacher-forced answer
ANSWER_ROOM = 16


@dataclass
class SelectConfig:
    """What `hybridize select` measures and how it chooses (see `hybridize.convert.select`)."""

    keep: int = 5
    criterion: str = "kl"
    mixer: str = "sse"
    mixer_settings: dict = field(default_factory=dict)
    greedy: bool = False
    windows: int = 0              # copying: this many of the other layers get sliding windows (`swa`)
    steps: int = 150              # layer-local alignment steps (all mixers at once)
    lr: float = 3e-3
    align_seq_len: int = 512
    align_batch_tokens: int = 2048
    tokens: int = 16384           # tokens the KL of each layer is measured on
    seq_len: int = 2048           # row length of those tokens
    text: str = "python-docs"     # training text (alignment and KL), never evaluation text
    needle_length: int = 2048     # S-NIAH prompt length (tokens, the answer excluded)
    needle_samples: int = 4
    greedy_tokens: int = 4096     # the KL tokens each greedy trial is measured on (a prefix of `tokens`)
    greedy_candidates: int = 12   # layers tried at each greedy step: the best by single-layer KL
    seed: int = 0
    device: str = "auto"
    overwrite: bool = False

    def needs_alignment(self) -> bool:
        """kl / needle / combined convert layers (aligned mixers); retrieval and copying read the teacher only."""
        return self.criterion not in ("retrieval", "copying")

    def needs_needle(self) -> bool:
        return self.needle_samples > 0


#: settings that change a measurement: a rerun with other values cannot reuse the recorded scores
MEASURE_KEYS = ("mixer", "mixer_settings", "steps", "lr", "align_seq_len", "align_batch_tokens", "tokens", "seq_len",
                "text", "needle_length", "needle_samples", "greedy_tokens", "greedy_candidates", "seed")


def measure_settings(cfg: SelectConfig) -> dict:
    d = asdict(cfg)
    return {k: d[k] for k in MEASURE_KEYS}


def check_config(cfg: SelectConfig, num_layers: int, context: int | None) -> None:
    """Every check that needs only the teacher's layer count and context length."""
    if cfg.criterion not in CRITERIA:
        raise UserError(f"--criterion {cfg.criterion!r}: choose one of {', '.join(CRITERIA)}")
    if not 1 <= cfg.keep < num_layers:
        raise UserError(f"--keep {cfg.keep}: choose 1 to {num_layers - 1} softmax layers (the teacher has "
                        f"{num_layers} layers and at least one must be converted)")
    if cfg.windows and cfg.criterion != "copying":
        raise UserError(f"--windows picks layers by their previous-token heads, which --criterion copying measures; "
                        f"it does not apply to --criterion {cfg.criterion}")
    if not 0 <= cfg.windows <= num_layers - cfg.keep:
        raise UserError(f"--windows {cfg.windows}: choose 0 to {num_layers - cfg.keep} (the layers left after "
                        f"--keep {cfg.keep} of {num_layers})")
    if cfg.greedy and cfg.criterion != "kl":
        raise UserError(f"--greedy refines the kl choice; it does not apply to --criterion {cfg.criterion}")
    if cfg.text.strip().lower() in EVALUATION_TEXTS:
        raise UserError(f"--text {cfg.text}: that is evaluation text (held-out perplexity); select on training "
                        "text such as python-docs")
    _check_positive(cfg)
    _check_lengths(cfg, context)
    if cfg.criterion in ("needle", "retrieval", "combined") and cfg.needle_samples < 1:
        raise UserError(f"--criterion {cfg.criterion} needs S-NIAH prompts: --needle-samples must be >= 1")


def _check_positive(cfg: SelectConfig) -> None:
    for name, value, low in (("--steps", cfg.steps, 0), ("--tokens", cfg.tokens, 1), ("--seq-len", cfg.seq_len, 2),
                             ("--align-seq-len", cfg.align_seq_len, 2), ("--needle-samples", cfg.needle_samples, 0),
                             ("--greedy-tokens", cfg.greedy_tokens, 1),
                             ("--greedy-candidates", cfg.greedy_candidates, 1)):
        if value < low:
            raise UserError(f"{name} {value} must be >= {low}")
    if not cfg.lr > 0:
        raise UserError(f"--lr {cfg.lr} must be > 0")
    if cfg.tokens < cfg.seq_len:
        raise UserError(f"--tokens {cfg.tokens} is less than one row of --seq-len {cfg.seq_len}")
    if cfg.align_batch_tokens < cfg.align_seq_len:
        raise UserError(f"--align-batch-tokens {cfg.align_batch_tokens} is less than one row of --align-seq-len "
                        f"{cfg.align_seq_len}")


def _check_lengths(cfg: SelectConfig, context: int | None) -> None:
    if not context:
        return
    for name, value in (("--seq-len", cfg.seq_len), ("--align-seq-len", cfg.align_seq_len)):
        if value > context:
            raise UserError(f"{name} {value} is longer than the teacher's context ({context} tokens)")
    if cfg.needs_needle() and cfg.needle_length + ANSWER_ROOM > context:
        raise UserError(f"--needle-length {cfg.needle_length} does not fit the teacher's context ({context} tokens) "
                        f"with {ANSWER_ROOM} tokens for the answer: use at most {context - ANSWER_ROOM}")
