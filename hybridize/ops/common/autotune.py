"""Cap Triton's autotuner to the `top` most preferred configs of every kernel.

fla-core tunes each kernel over up to ~36 configs the first time it sees a new autotune key (head
count, head dims, dtype, varlen flag, ...; for most kernels not the sequence length): 45-205 s per op
on an H100. `limit_autotune(top)` keeps only the `top` configs closest to num_warps=4, num_stages=2
(stable order otherwise) after the kernel's own pruning, so a new key costs a few compilations.
With top >= 2 a config that fails to compile is still survived (Triton times it as inf).
The price is a possibly slower config than full tuning; `benchmarks/RESULTS.md` says which was used.
Winning configs are cached on disk by Triton (`cache_results`, fla's default), so later processes
reuse them. The kernel option `autotune_top=<n>` (`HYBRIDIZE_AUTOTUNE_TOP=<n>`, `hybridize.ops.common.options`)
applies this when the fla adapter first loads fla (and again when the option changes); 0 disables.
Our own kernels with a short, curated config list set `full_tune = True` on their autotuner and are left alone.
"""
from __future__ import annotations

import math

from hybridize.ops.common.options import current_kernel_options

_ORIGINAL = None


def _rank(cfg) -> tuple:
    return (abs(math.log2(max(cfg.num_warps, 1)) - 2), abs(cfg.num_stages - 2))


def limit_autotune(top: int) -> None:
    """Patch `triton.runtime.autotuner.Autotuner.prune_configs` to keep the `top` preferred configs."""
    global _ORIGINAL
    from triton.runtime.autotuner import Autotuner

    if _ORIGINAL is None:
        _ORIGINAL = Autotuner.prune_configs
    if top <= 0:
        Autotuner.prune_configs = _ORIGINAL
        return
    original = _ORIGINAL

    def prune_configs(self, kwargs):
        configs = original(self, kwargs)
        if len(configs) <= top or getattr(self, "full_tune", False):
            return configs
        return sorted(configs, key=_rank)[:top]

    Autotuner.prune_configs = prune_configs


def limit_from_options() -> int:
    """Apply the kernel option `autotune_top` (`HYBRIDIZE_AUTOTUNE_TOP`); returns the cap in force (0 = none).
    0 leaves an autotuner never capped untouched and restores a capped one."""
    top = current_kernel_options().autotune_top
    if top > 0 or _ORIGINAL is not None:
        limit_autotune(top)
    return top

