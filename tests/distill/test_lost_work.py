"""Issue 29, lost work: bad step counts fail at parse time, `export -o` and `distill` refuse to replace a
folder they did not write, the NaN guard names a checkpoint from before the divergence, `--resume`
honours a new train.lr (and refuses settings it cannot change), and resuming never unpickles code."""
from __future__ import annotations

import pytest

from hybridize.distill.config import AlignConfig, E2EConfig, SFTStageConfig, load_config
from hybridize.errors import UserError


def _one_line(e: BaseException) -> str:
    msg = str(e)
    assert isinstance(e, UserError) and "\n" not in msg, repr(e)
    return msg


# ---- 5: counts checked at parse time -----------------------------------------------------------------

@pytest.mark.parametrize("cls, override, key", [
    (E2EConfig, "train.max_steps=-5", "train.max_steps"),
    (E2EConfig, "train.max_steps=0", "train.max_steps"),
    (AlignConfig, "train.grad_accum=0", "train.grad_accum"),
    (AlignConfig, "train.warmup_steps=-1", "train.warmup_steps"),
    (E2EConfig, "data.seq_len=0", "data.seq_len"),
    (E2EConfig, "data.batch_tokens=-8", "data.batch_tokens"),
    (E2EConfig, "train.save_every=-1", "train.save_every"),
    (E2EConfig, "train.lr=-1e-4", "train.lr"),
    (E2EConfig, "lora.r=0", "lora.r"),
    (SFTStageConfig, "batch_size=0", "batch_size"),
    (SFTStageConfig, "max_length=-1", "max_length"),
])
def test_bad_counts_fail_at_parse_time(cls, override, key):
    with pytest.raises(UserError) as e:
        load_config(cls, None, [override])
    assert _one_line(e.value).startswith(f"{key} must be >=")


def test_zero_where_zero_means_off_still_parses():
    c = load_config(E2EConfig, None, ["train.save_every=0", "train.warmup_steps=0", "train.max_grad_norm=0",
                                      "data.max_docs=0", "train.threads=0", "train.max_steps=1"])
    assert (c.train.save_every, c.train.warmup_steps, c.train.max_steps) == (0, 0, 1)
