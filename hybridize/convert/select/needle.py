"""S-NIAH prompts for selection: RULER's single needle in repeated noise (`s-niah-1`, built by
`hybridize.eval.niah.build_sample`), each followed by its answer, teacher-forced, with the token positions
that matter to a retrieval:

- `value_tokens`: the needle's VALUE (the number after "... is:") inside the haystack;
- `answer_positions`: the positions whose next token is an answer token (the last prompt token and the
  answer tokens but the last), i.e. where a model must copy the value.

The noise haystack keeps every evaluation text out of selection; the seeds differ from `eval niah` /
`eval recovery`'s (`SEED_OFFSET`), so the prompts selected on are not the prompts scored later. Depths spread
evenly: sample k of n puts the needle at depth (k + 0.5) / n.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridize.errors import UserError
from hybridize.eval.common import has_chat_template
from hybridize.eval.niah import build_sample, get_task

TASK = "s-niah-1"
SEED_OFFSET = 1000


@dataclass
class NeedlePrompt:
    input_ids: list[int]         # prompt + answer
    prompt_len: int
    value_tokens: list[int]      # positions of the needle's value in the haystack
    answer: str

    @property
    def answer_positions(self) -> list[int]:
        return list(range(self.prompt_len - 1, len(self.input_ids) - 1))


def needle_prompts(tokenizer, length: int, samples: int, task: str = TASK,
                   flag: str = "--needle-length") -> list[NeedlePrompt]:
    """`samples` prompts of at most `length` tokens plus the answer " <value>". `task`: selection uses s-niah-1
    (noise haystack); `eval needle-attention` may name s-niah-2 / -3 (essay haystack, evaluation text). `flag`:
    the caller's option for `length`, named in the error when the prompt does not fit."""
    chat = has_chat_template(tokenizer)
    out = []
    for k in range(samples):
        try:
            s = build_sample(tokenizer, get_task(task), length, (k + 0.5) / samples, seed=SEED_OFFSET + k, chat=chat)
        except ValueError as e:  # the prompt without haystack is longer than `length`
            raise UserError(f"{flag} {length}: {e}") from None
        answer_ids = tokenizer(" " + s.answers[0], add_special_tokens=False)["input_ids"]
        out.append(NeedlePrompt(list(s.input_ids) + list(answer_ids), len(s.input_ids),
                                value_tokens(tokenizer, s, chat), s.answers[0]))
    return out


def value_tokens(tokenizer, sample, chat: bool) -> list[int]:
    """Token positions (in `sample.input_ids`) that overlap the characters of the first needle's value."""
    enc = tokenizer(sample.prompt, add_special_tokens=not chat, return_offsets_mapping=True)
    if list(enc["input_ids"]) != list(sample.input_ids):
        raise UserError("the tokenizer encodes the needle prompt differently with offsets; cannot locate the needle")
    start = sample.prompt.index(sample.needle) + sample.needle.rindex(sample.answers[0])
    end = start + len(sample.answers[0])
    pos = [t for t, (a, b) in enumerate(enc["offset_mapping"]) if a < end and b > start]
    if not pos:
        raise UserError("the needle's value was not found among the prompt's tokens")
    return pos


def needle_batches(prompts: list[NeedlePrompt]) -> list[dict]:
    """One batch per prompt for `probe.record_probe`: ids `[1, T]`, the answer positions as `mask`, the next
    tokens as `targets` (the NLL of the answer)."""
    out = []
    for p in prompts:
        ids = torch.tensor([p.input_ids])
        mask = torch.zeros_like(ids, dtype=torch.bool)
        mask[0, p.answer_positions] = True
        targets = torch.roll(ids, -1, dims=1)
        targets[0, -1] = 0
        out.append({"input_ids": ids, "mask": mask, "targets": targets})
    return out
