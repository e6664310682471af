"""Split-KV ("flash-decoding") softmax attention for ONE query token per row over a static KV buffer.

Why: a decode step of the fast rollout loop (`hybridize.generation.fast`) reads a `[B, Hkv, L_buf, D]`
key/value buffer of which only a per-row key range is valid. HF's masked `F.scaled_dot_product_attention`
with q_len = 1 cannot split the key length across programs and, with a mask, drops to a slow backend
(~1.25 ms per layer at B=8, 16k keys, Qwen3-1.7B shapes on an H100, against a ~0.17 ms memory floor).
Here phase 1 runs one program per (KV split, row, KV head): it loads each key/value block once for
all `G = Hq / Hkv` query heads of the group (GQA without repeating K/V) and keeps a running
(max, sum, acc) in fp32; phase 2 combines the splits per (row, query head).

Visible keys: row `b` attends to buffer positions `j` with `lo_b <= j < hi_b`, where
`hi_b = min(length_b, L_buf)` (positions >= length are future slots), `lo_b = start_b` (left padding:
keys before `start_b` are padding) raised to `hi_b - window` when a sliding window is given (the
query at position `hi_b - 1` sees `window` keys including itself, HF's rule `j > pos - window`).
`length` and `start` are device tensors, so one CUDA graph serves every decode step: programs only
loop over the visible blocks of their split, so work follows the real length, not `L_buf`, while the
split count depends on `L_buf` (and B, Hkv, the GPU) only. A row with no visible key returns zeros
(a softmax over nothing; never happens in decoding, where the current token is always visible).

Precision: scores, softmax statistics and the output accumulator are fp32; as in flash attention and
HF's eager path the probabilities are rounded to the value dtype before the P @ V product (bf16 in,
bf16 P); fp32 inputs use IEEE fp32 dots (no TF32). Output in q's dtype.

`attn_decode_reference` is a plain PyTorch masked softmax with the same contract (fp32 math, fp64
for fp64 inputs): the CPU path and the tests' reference. The Triton part is defined only when triton
imports, so the reference works without it.
"""
from __future__ import annotations

import os

import torch

from hybridize.ops.common.pdl import pdl_args

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference still works
    triton = None
    tl = None

LOG2E = 1.4426950408889634


# ---------------------------------------------------------------------------------------------
# shared argument handling
# ---------------------------------------------------------------------------------------------
def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int, int, int]:
    if q.dim() != 3 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"expected q [B, Hq, D] and k, v [B, Hkv, L, D] of one shape, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    B, Hq, D = q.shape
    Bk, Hkv, L, Dk = k.shape
    if Bk != B or Dk != D or Hq % Hkv:
        raise ValueError(f"q [B, Hq, D] = {tuple(q.shape)} does not fit k/v [B, Hkv, L, D] = {tuple(k.shape)}: "
                         "same B and D, Hq a multiple of Hkv")
    return B, Hq, Hkv, L, D


def _length_tensor(length, B: int, device) -> torch.Tensor:
    """`length` (int, or a tensor with 1 or B elements) as a flat integer device tensor."""
    if not torch.is_tensor(length):
        return torch.full((1,), int(length), dtype=torch.int64, device=device)
    length = length.reshape(-1)
    if length.numel() not in (1, B) or length.is_floating_point():
        raise ValueError(f"length must be an int or an integer tensor with 1 or B={B} elements, "
                         f"got {tuple(length.shape)} {length.dtype}")
    return length


def _start_tensor(start, B: int, device) -> torch.Tensor:
    if start is None:
        return torch.zeros(B, dtype=torch.int64, device=device)
    start = start.reshape(-1)
    if start.numel() != B or start.is_floating_point():
        raise ValueError(f"start must be an integer tensor [B={B}], got {tuple(start.shape)} {start.dtype}")
    return start


def _window(window) -> int:
    if window is None:
        return 0
    if int(window) < 1:
        raise ValueError(f"sliding window must be >= 1 or None, got {window}")
    return int(window)


def visible_range(length, start, window, B: int, L: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(lo, hi) `[B]` int64: row b sees buffer positions lo <= j < hi (see the module docstring)."""
    hi = _length_tensor(length, B, device).to(torch.int64).expand(B).clamp(max=L)
    lo = _start_tensor(start, B, device).to(torch.int64).clamp(min=0)
    w = _window(window)
    if w:
        lo = torch.maximum(lo, hi - w)
    return lo, hi


# ---------------------------------------------------------------------------------------------
# reference (CPU path, tests)
# ---------------------------------------------------------------------------------------------
def attn_decode_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length, start=None,
                          window: int | None = None, scale: float | None = None) -> torch.Tensor:
    """Masked softmax attention of one query per row: q `[B, Hq, D]`, k/v `[B, Hkv, L, D]` (query head i
    reads KV head i // (Hq / Hkv)), `length` int or `[1]`/`[B]`, `start` `[B]` or None -> `[B, Hq, D]`
    in q's dtype. fp32 math (fp64 for fp64 inputs)."""
    B, Hq, Hkv, L, D = _check(q, k, v)
    G = Hq // Hkv
    scale = D ** -0.5 if scale is None else scale
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    lo, hi = visible_range(length, start, window, B, L, q.device)
    j = torch.arange(L, device=q.device)
    vis = (j[None, :] >= lo[:, None]) & (j[None, :] < hi[:, None])               # [B, L]
    s = torch.einsum("bhgd,bhld->bhgl", q.to(ct).reshape(B, Hkv, G, D), k.to(ct)) * scale
    s = s.masked_fill(~vis[:, None, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1)
    p = torch.where(vis.any(dim=1)[:, None, None, None], p, torch.zeros((), dtype=ct, device=q.device))
    # masked values are never read (as in the kernel): NaN in an unused slot must not leak through 0 * NaN
    o = torch.einsum("bhgl,bhld->bhgd", p, v.to(ct).masked_fill(~vis[:, None, :, None], 0))
    return o.reshape(B, Hq, D).to(q.dtype)


# ---------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _attend_block(b_q, k_base, v_base, j0, s_hi, stride_kl, stride_vl, o_d, m_d, b_m, b_l, b_acc, qk_scale,
                      BLOCK_N: tl.constexpr, IEEE: tl.constexpr, ring_g=0, ring_slot=-1, window=1, sinks=0,
                      RING: tl.constexpr = False):
        """Online-softmax update with the key block [j0, j0 + BLOCK_N) (keys >= s_hi masked). RING: a window
        layer's ring state (`triton_window_step.py`), where slot j is also masked unless the query of rank
        `ring_g` reads it: sink j once ring_g >= j + 1 + window, ring slot j once filled, and never `ring_slot`
        (the one the query's own key goes to); a block may then have no visible key."""
        o_n = j0 + tl.arange(0, BLOCK_N)
        m_n = o_n < s_hi
        if RING:
            need = tl.where(o_n < sinks, o_n + 1 + window, o_n - sinks + 1)
            m_n = m_n & (ring_g >= need) & (o_n != ring_slot)
        # keys loaded transposed [BLOCK_D, BLOCK_N]: no in-register transpose for the dot
        b_kt = tl.load(k_base + o_n[None, :] * stride_kl + o_d[:, None],
                       mask=m_d[:, None] & m_n[None, :], other=0.0)
        if IEEE:
            b_s = tl.dot(b_q, b_kt, input_precision="ieee")
        else:
            b_s = tl.dot(b_q, b_kt)
        b_s = tl.where(m_n[None, :], b_s * qk_scale, float("-inf"))   # [BLOCK_G, BLOCK_N]
        m_new = tl.maximum(b_m, tl.max(b_s, axis=1))   # finite unless RING: every block has a visible key
        if RING:   # nothing visible yet: keep the stats at zero (no inf - inf)
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(b_m - m_new)
        b_p = tl.exp2(b_s - m_new[:, None])
        b_l = b_l * alpha + tl.sum(b_p, axis=1)
        b_v = tl.load(v_base + o_n[:, None] * stride_vl + o_d[None, :],
                      mask=m_n[:, None] & m_d[None, :], other=0.0)
        if IEEE:
            b_pv = tl.dot(b_p, b_v.to(tl.float32), input_precision="ieee")
        else:
            b_pv = tl.dot(b_p.to(b_v.dtype), b_v)
        return m_new, b_l, b_acc * alpha[:, None] + b_pv

    @triton.jit
    def _attn_decode_partial(q, k, v, start, length, m_out, l_out, acc_out, qk_scale,
                             stride_qb, stride_qh, stride_kb, stride_kh, stride_kl,
                             stride_vb, stride_vh, stride_vl, stride_len,
                             L, Hkv, G, window, chunk, S,
                             D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr,
                             BLOCK_N: tl.constexpr, IEEE: tl.constexpr, LOOP_WHILE: tl.constexpr,
                             PDL: tl.constexpr = False):
        """One (split, row b, KV head h): running softmax stats of the G query heads of the group over
        the visible keys of the split, in log2 units (scores pre-multiplied by log2(e))."""
        if PDL:   # launched before the previous kernel finished (ops/common/pdl.py): wait for its outputs
            tl.extra.cuda.gdc_wait()
        i_s, i_bh = tl.program_id(0), tl.program_id(1)
        i_b = i_bh // Hkv
        i_h = i_bh % Hkv
        b64 = i_b.to(tl.int64)
        hi = tl.minimum(tl.load(length + i_b * stride_len).to(tl.int64), L)
        lo = tl.maximum(tl.load(start + i_b).to(tl.int64), 0)
        if window > 0:
            lo = tl.maximum(lo, hi - window)
        s_lo = tl.maximum(lo, i_s.to(tl.int64) * chunk)
        s_hi = tl.minimum(hi, (i_s.to(tl.int64) + 1) * chunk)

        o_g = tl.arange(0, BLOCK_G)
        o_d = tl.arange(0, BLOCK_D)
        m_g, m_d = o_g < G, o_d < D
        heads = i_h * G + o_g                                          # query heads of this group
        p_q = q + b64 * stride_qb + heads[:, None] * stride_qh + o_d[None, :]
        b_q = tl.load(p_q, mask=m_g[:, None] & m_d[None, :], other=0.0)   # [BLOCK_G, BLOCK_D]
        k_base = k + b64 * stride_kb + i_h.to(tl.int64) * stride_kh
        v_base = v + b64 * stride_vb + i_h.to(tl.int64) * stride_vh

        b_m = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
        b_l = tl.zeros([BLOCK_G], dtype=tl.float32)
        b_acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
        if LOOP_WHILE:   # the interpreter cannot take tensor bounds in range() (numpy >= 2)
            j0 = s_lo
            while j0 < s_hi:
                b_m, b_l, b_acc = _attend_block(b_q, k_base, v_base, j0, s_hi, stride_kl, stride_vl, o_d, m_d,
                                                b_m, b_l, b_acc, qk_scale, BLOCK_N, IEEE)
                j0 += BLOCK_N
        else:            # a for loop, so the compiler pipelines the K/V loads
            for j0 in range(s_lo, s_hi, BLOCK_N):
                b_m, b_l, b_acc = _attend_block(b_q, k_base, v_base, j0, s_hi, stride_kl, stride_vl, o_d, m_d,
                                                b_m, b_l, b_acc, qk_scale, BLOCK_N, IEEE)

        rows = (b64 * Hkv * G + heads) * S + i_s                         # index into [B, Hq, S]
        tl.store(m_out + rows, b_m, mask=m_g)
        tl.store(l_out + rows, b_l, mask=m_g)
        tl.store(acc_out + rows[:, None] * D + o_d[None, :], b_acc, mask=m_g[:, None] & m_d[None, :])

    @triton.jit
    def _attn_decode_combine(m_in, l_in, acc_in, o, stride_ob, stride_oh, Hq, S,
                             D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
                             ks=None, vs=None, seen=None, G=1, L=1, window=1, sinks=0, CLEAR: tl.constexpr = False,
                             PDL: tl.constexpr = False):
        """One (row, query head): merge the splits' (max, sum, acc); zeros when no key was visible. CLEAR (a window
        layer's step, `triton_window_step.py`): the group's first query head also zeroes the ring slot of rank
        seen + 2 - window in the contiguous state ks, vs `[B, Hkv, L, D]`, the key that has just left every band
        (phase 1, which read it, has finished)."""
        if PDL:
            tl.extra.cuda.gdc_wait()
        i_bh = tl.program_id(0).to(tl.int64)
        o_s = tl.arange(0, BLOCK_S)
        o_d = tl.arange(0, BLOCK_D)
        m_s, m_d = o_s < S, o_d < D
        b_m = tl.load(m_in + i_bh * S + o_s, mask=m_s, other=float("-inf"))
        b_l = tl.load(l_in + i_bh * S + o_s, mask=m_s, other=0.0)
        b_acc = tl.load(acc_in + (i_bh * S + o_s[:, None]) * D + o_d[None, :],
                        mask=m_s[:, None] & m_d[None, :], other=0.0)
        m_all = tl.max(b_m, axis=0)
        m_all = tl.where(m_all == float("-inf"), 0.0, m_all)           # no visible key: avoid inf - inf
        w = tl.exp2(b_m - m_all)                                        # 0 for empty splits
        den = tl.sum(w * b_l, axis=0)
        num = tl.sum(w[:, None] * b_acc, axis=0)
        out = tl.where(den > 0, num / tl.where(den > 0, den, 1.0), 0.0)
        i_b = i_bh // Hq
        i_h = i_bh % Hq
        tl.store(o + i_b * stride_ob + i_h * stride_oh + o_d, out, mask=m_d)
        if CLEAR:
            dead = sinks + (tl.load(seen + i_b) + 1) % window
            p = (((i_b * (Hq // G) + i_h // G) * L + dead) * D + o_d).to(tl.int64)
            first = m_d & (i_h % G == 0)
            tl.store(ks + p, tl.zeros([BLOCK_D], dtype=ks.dtype.element_ty), mask=first)
            tl.store(vs + p, tl.zeros([BLOCK_D], dtype=vs.dtype.element_ty), mask=first)


_SM_COUNT: dict = {}


def sm_count(device) -> int:
    """The GPU's multiprocessor count (cached per device); 4 off CUDA (the interpreter: a few splits, so the
    combine path is exercised)."""
    if device.type != "cuda":
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def num_splits(L: int, B: int, Hkv: int, device, block_n: int = 64) -> int:
    """KV splits for a buffer of length `L`: about 4 programs per SM in phase 1, at least 256 keys per
    split. Depends only on the shapes and the GPU, so a captured CUDA graph stays valid."""
    want = -(-4 * sm_count(device) // max(1, B * Hkv))
    return max(1, min(want, -(-L // max(256, block_n))))


def split_plan(L: int, S: int, block_n: int, B: int, Hq: int, D: int, device):
    """(slots per split, a whole number of blocks; the split count it gives; the splits' fp32 partial stats: max and
    sum `[B, Hq, S]`, accumulator `[B, Hq, S, D]`) for about `S` splits of `L` slots."""
    S = max(1, min(int(S), max(1, -(-L // block_n))))
    chunk = -(-(-(-L // S)) // block_n) * block_n                 # ceil(L / S) rounded up to a block
    S = max(1, -(-L // chunk))
    f32 = dict(dtype=torch.float32, device=device)
    return chunk, S, (torch.empty(B, Hq, S, **f32), torch.empty(B, Hq, S, **f32), torch.empty(B, Hq, S, D, **f32))


def combine(m: torch.Tensor, lsum: torch.Tensor, acc: torch.Tensor, o: torch.Tensor, **clear) -> None:
    """Phase 2: merge the splits' partials into o `[B, Hq, D]`; `clear`: `_attn_decode_combine`'s CLEAR arguments (the
    window step's)."""
    B, Hq, S, D = acc.shape
    _attn_decode_combine[(B * Hq,)](m, lsum, acc, o, o.stride(0), o.stride(1), Hq, S, D=D,
                                    BLOCK_D=max(16, triton.next_power_of_2(D)),
                                    BLOCK_S=max(2, triton.next_power_of_2(S)), num_warps=4, **pdl_args(o.device),
                                    **clear)


def launch_settings(kv_bytes: int) -> tuple[int, int]:
    """(keys per block, pipeline stages) of phase 1 for K/V of `kv_bytes` bytes an element. 16-bit: 128 keys in 3
    stages, the fastest of the sweep on an H100 at the 1.7B shape's 16k x 8 (2.91 TB/s, 1.20x the former 64 keys in
    2 stages) and at 1k x 1 of both shapes (1.25x / 1.36x); fp32 (tests, fp32 checks): 64 keys in 2 stages, as 128 in
    3 stages need more shared memory than an H100 has."""
    return (128, 3) if kv_bytes <= 2 else (64, 2)


@torch.compiler.disable   # opaque to torch.compile: dynamo re-types its Python scalars (fp32 -> fp64)
def attn_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length, start=None,
                window: int | None = None, scale: float | None = None, splits: int | None = None,
                block_n: int | None = None, num_warps: int = 4, num_stages: int | None = None) -> torch.Tensor:
    """Triton split-KV attention, same contract as `attn_decode_reference`: q `[B, Hq, D]`, k/v
    `[B, Hkv, L, D]` (any strides with a unit last stride), `length` int or device tensor `[1]`/`[B]`,
    `start` `[B]` or None, `window` None or >= 1 -> `[B, Hq, D]` in q's dtype. `splits` overrides
    `num_splits` (tests). No host synchronisation: safe inside CUDA-graph capture once compiled.
    Launch settings (None: `launch_settings`) are the fastest of `benchmarks/ops/attn_decode.py`'s sweep on an H100
    for 16-bit K/V."""
    if triton is None:
        raise ImportError("attn_decode needs triton; use attn_decode_reference on machines without it")
    B, Hq, Hkv, L, D = _check(q, k, v)
    auto_n, auto_stages = launch_settings(k.element_size())
    block_n, num_stages = block_n or auto_n, num_stages or auto_stages
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("attn_decode needs a unit stride on the head dim of q, k and v (call .contiguous())")
    if k.dtype != v.dtype:
        raise ValueError(f"k and v must share a dtype, got {k.dtype} and {v.dtype}")
    G = Hq // Hkv
    scale = D ** -0.5 if scale is None else float(scale)
    dev = q.device
    length = _length_tensor(length, B, dev)
    start = _start_tensor(start, B, dev)
    w = _window(window)
    block_n = max(16, triton.next_power_of_2(block_n))
    S = splits if splits is not None else num_splits(L, B, Hkv, dev, block_n)
    chunk, S, (m, lsum, acc) = split_plan(L, S, block_n, B, Hq, D, dev)
    BLOCK_D = max(16, triton.next_power_of_2(D))
    BLOCK_G = max(16, triton.next_power_of_2(G))                 # tl.dot needs >= 16 rows
    ieee = q.dtype == torch.float32 or k.dtype == torch.float32
    qk = q if q.dtype == k.dtype else q.to(k.dtype)
    _attn_decode_partial[(S, B * Hkv)](
        qk, k, v, start, length, m, lsum, acc, scale * LOG2E,
        qk.stride(0), qk.stride(1), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), 0 if length.numel() == 1 else length.stride(0),
        L, Hkv, G, w, chunk, S,
        D=D, BLOCK_D=BLOCK_D, BLOCK_G=BLOCK_G, BLOCK_N=block_n, IEEE=ieee,
        LOOP_WHILE=os.environ.get("TRITON_INTERPRET") == "1", num_warps=num_warps, num_stages=num_stages,
        **pdl_args(dev))
    o = torch.empty(B, Hq, D, dtype=q.dtype, device=dev)
    combine(m, lsum, acc, o)
    return o


# ---------------------------------------------------------------------------------------------
# GPU check + timing: python -m hybridize.ops.attn_decode.triton_split_kv
# ---------------------------------------------------------------------------------------------
def _bench(B: int = 8, Hq: int = 16, Hkv: int = 8, D: int = 128, L: int = 16640, T: int = 16384) -> None:
    """Correctness against the reference and timing against HF-style masked sdpa at Qwen3-1.7B
    shapes (bf16, one left-padded row, the last `L - T` buffer slots future), for a few launch
    configs (block_n, num_warps, num_stages); the first is `attn_decode`'s default."""
    from triton.testing import do_bench

    torch.manual_seed(0)
    dev = torch.device("cuda")
    q = torch.randn(B, Hq, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(B, Hkv, L, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    start = torch.zeros(B, dtype=torch.int64, device=dev)
    start[0] = T // 8
    length = torch.full((1,), T, dtype=torch.int64, device=dev)
    ref = attn_decode_reference(q, k, v, length, start).float()
    lo, hi = visible_range(length, start, None, B, L, dev)
    j = torch.arange(L, device=dev)
    mask = ((j >= lo[:, None]) & (j < hi[:, None]))[:, None, None, :]

    def sdpa():   # what HF does at q_len 1 with a mask: the GQA group packed into the query
        qq = q.reshape(B, Hkv, Hq // Hkv, D)
        return torch.nn.functional.scaled_dot_product_attention(qq, k, v, attn_mask=mask)

    floor = 2 * k.numel() * k.element_size() * (T / L) / 3.35e12 * 1e3
    print(f"B={B} Hq={Hq} Hkv={Hkv} D={D} L_buf={L} length={T} bf16, splits={num_splits(L, B, Hkv, dev)}; "
          f"masked sdpa {do_bench(sdpa):.3f} ms; H100 HBM floor ~{floor:.3f} ms")
    for bn, warps, stages in ((128, 4, 3), (64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 8, 2), (64, 8, 3)):
        kw = dict(block_n=bn, num_warps=warps, num_stages=stages)
        try:
            err = ((attn_decode(q, k, v, length, start, **kw).float() - ref).abs().max() / ref.abs().max()).item()
            t = do_bench(lambda: attn_decode(q, k, v, length, start, **kw))
            print(f"  triton block_n={bn} warps={warps} stages={stages}: {t:.3f} ms, max rel err {err:.1e}")
        except Exception as e:  # e.g. out of shared memory for a large config
            print(f"  triton block_n={bn} warps={warps} stages={stages}: failed ({type(e).__name__}: {e})")


if __name__ == "__main__":
    _bench()
