"""How long the pieces of the CCQ read and the pieces GLA are: `piece_len`, the rule alone.

Both kernels cut every sequence of the flat token axis into pieces (`triton_utils.make_pieces`) so that B * H rows
alone (often 16) do not leave most SMs idle. The rule lives here, apart from the kernels, because it imports no
Triton: machines without it (CI, CPU installs) can still read and test it.
"""
from __future__ import annotations

from hybridize.ops.common.options import current_kernel_options


def _next_power_of_2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def piece_len(B, T, H, longest, rows: int | None = None):
    """Piece length: ~kernel option `ccq_rows` (`HYBRIDIZE_CCQ_ROWS`, default 128) (piece, head) rows so that
    B * H alone (often 16) does not leave most SMs idle, clamped to 512..4096 tokens (shorter pieces cost more
    in the prefix scan and the per-piece sums than they gain, longer ones idle SMs; H100 sweeps in
    benchmarks/RESULTS.md). A forward alone used 64 rows while its tile was tuned once for every shape; with
    the tiles tuned per length and rows bucket (`_launch`) 128 rows measured faster for it too (read forward
    4k 0.110 against 0.133 ms, 16k 0.376 against 0.495). The option `ccq_segment=<n>`
    (`HYBRIDIZE_CCQ_SEGMENT`) overrides (0: one piece per sequence). `rows`: the target instead of `ccq_rows`
    (the pieces GLA passes its own, `gla_rows`). `longest`: the longest sequence; None when one piece would
    hold it whole."""
    opts = current_kernel_options()
    if opts.ccq_segment is not None:
        n = opts.ccq_segment
    else:
        rows = opts.ccq_rows if rows is None else int(rows)
        n = min(4096, max(512, _next_power_of_2(-(-(B * T * H) // rows))))
    return None if n <= 0 or n >= longest else n


__all__ = ["piece_len"]
