"""Generic checks usable for ANY mixer through the `Mixer` call contract (see hybridize/mixers/base.py).

Factories
    rel_err(a, b)                         max|a - b| / max|b| (the tolerance measure of every test)
    tiny_config(cls_or_name, **settings)  a small config (hidden 16, 2 heads, 1 KV head, head_dim 8)
    make_mixer(cls_or_name, ...)          a mixer with its parameters perturbed so identity-like
                                          inits (conv taps, norms, gates) cannot hide bugs
    random_hidden(B, T, hidden, ...)      input activations `[B, T, hidden]`
    rope_cos_sin(positions, head_dim)     (cos, sin) `[B, T, D]` like the HF rotary embedding
    cu_seqlens_of(lengths)                `[N+1]` int32 offsets
    left_pad_mask(lengths, T)             `[B, T]` bool, True on the last `lengths[i]` tokens

Checkers (each asserts and returns the worst relative error it saw)
    check_chunk_equals_recurrent   mode="chunk" == mode="recurrent" (outputs and final state)
    check_prefill_then_steps       prefill(first part) + one-token recurrent steps == full forward
    check_varlen_equals_separate   packed `cu_seqlens` input == each document on its own
    check_left_padding             left-padded batch + attention_mask == unpadded rows
    check_padding_keeps_state      a padded token leaves a given state bit-identical
    check_backward                 gradients reach every parameter and are finite
    check_runs_in_dtype            e.g. bf16 forward + backward runs and gives finite output

Mixers that use RoPE get position ids built the way the model builds them (restart at 0 for every
document, count only real tokens under left padding, continue after a prefill).
"""
from __future__ import annotations

import torch

from hybridize.mixers import mixer_class
from hybridize.mixers.base import Mixer, MixerState

FP32_TOL = 1e-5
FP64_TOL = 1e-10


# ---- factories ----------------------------------------------------------------------------------

def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max|a - b| / max|b| in fp64 (0 when both are all zero)."""
    a, b = a.detach().double(), b.detach().double()
    if a.shape != b.shape:
        raise AssertionError(f"shape mismatch {tuple(a.shape)} vs {tuple(b.shape)}")
    ref = b.abs().max().item() if b.numel() else 0.0
    diff = (a - b).abs().max().item() if a.numel() else 0.0
    return diff / ref if ref > 0 else diff


def state_rel_err(a: MixerState | None, b: MixerState | None) -> float:
    """Worst `rel_err` over the tensors of two states of the same class (0 for two Nones)."""
    if a is None and b is None:
        return 0.0
    if a is None or b is None or type(a) is not type(b):
        raise AssertionError(f"state mismatch: {type(a).__name__} vs {type(b).__name__}")
    ta, tb = a.tensors(), b.tensors()
    if len(ta) != len(tb):
        raise AssertionError(f"states hold {len(ta)} vs {len(tb)} tensors")
    return max([rel_err(x, y) for x, y in zip(ta, tb)], default=0.0)


def cat_states(states: list[MixerState]) -> MixerState:
    """Stack per-sequence states (dim 0) into one batch state (`map` visits tensors in `tensors()` order)."""
    parts = [s.tensors() for s in states]
    counter = iter(range(len(parts[0])))

    def stack(_):
        i = next(counter)
        return torch.cat([p[i] for p in parts], dim=0)
    return states[0].map(stack)


def _resolve(cls_or_name) -> type[Mixer]:
    return mixer_class(cls_or_name) if isinstance(cls_or_name, str) else cls_or_name


def tiny_config(cls_or_name, **settings):
    """Small config of a mixer class: hidden 16, 2 query heads sharing 1 KV head (GQA), head_dim 8."""
    cls = _resolve(cls_or_name)
    base = dict(hidden_size=16, num_heads=2, num_kv_heads=1, head_dim=8, chunk_size=16)
    return cls.config_class.from_dict({**base, **settings})


@torch.no_grad()
def perturb_(module: torch.nn.Module, scale: float = 0.1, seed: int = 1) -> torch.nn.Module:
    """Add N(0, scale^2) to every parameter, so identity inits (conv taps, norm weights) are broken."""
    gen = torch.Generator().manual_seed(seed)
    for p in module.parameters():
        p.add_(torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.dtype) * scale)
    return module


def make_mixer(cls_or_name, dtype: torch.dtype = torch.float32, seed: int = 0, perturb: float = 0.1,
               **settings) -> Mixer:
    """Build a tiny mixer (see `tiny_config`), run `reset_new_parameters`, perturb it, cast to `dtype`."""
    torch.manual_seed(seed)
    cls = _resolve(cls_or_name)
    m = cls(tiny_config(cls, **settings))
    m.reset_new_parameters()
    if perturb:
        perturb_(m, perturb, seed + 1)
    return m.to(dtype)


def random_hidden(B: int, T: int, hidden: int, dtype: torch.dtype = torch.float32, seed: int = 0,
                  requires_grad: bool = False) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, hidden, generator=gen).to(dtype)
    return x.requires_grad_(requires_grad)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, base: float = 10000.0,
                 dtype: torch.dtype = torch.float32):
    """positions `[B, T]` -> (cos, sin) `[B, T, head_dim]`, the HF Llama rotary layout."""
    inv = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim)
    ang = positions.double().unsqueeze(-1) * inv
    emb = torch.cat([ang, ang], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def cu_seqlens_of(lengths: list[int]) -> torch.Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    out[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    return out


def left_pad_mask(lengths: list[int], T: int) -> torch.Tensor:
    """`[B, T]` bool, True on the last `lengths[i]` positions of row i."""
    ar = torch.arange(T)
    return torch.stack([ar >= T - n for n in lengths])


# ---- calling a mixer ----------------------------------------------------------------------------

def _pos_kw(mixer: Mixer, positions: torch.Tensor, dtype) -> dict:
    if not getattr(mixer.config, "use_rope", False):
        return {}
    return {"position_embeddings": rope_cos_sin(positions, mixer.config.head_dim, dtype=dtype)}


def call(mixer: Mixer, x: torch.Tensor, positions: torch.Tensor | None = None, **kw):
    """mixer(x, **kw) adding RoPE tables when the mixer uses RoPE (positions default 0..T-1)."""
    B, T, _ = x.shape
    if positions is None:
        positions = torch.arange(T).expand(B, T)
    return mixer(x, **_pos_kw(mixer, positions, x.dtype), **kw)


def _assert_small(err: float, tol: float, what: str) -> None:
    assert err < tol, f"{what}: relative error {err:.3e} >= {tol:.1e}"


def _default_tol(x: torch.Tensor) -> float:
    return FP64_TOL if x.dtype == torch.float64 else FP32_TOL


# ---- generic checks -----------------------------------------------------------------------------

@torch.no_grad()
def check_chunk_equals_recurrent(mixer: Mixer, x: torch.Tensor, state: MixerState | None = None,
                                 tol: float | None = None, **kw) -> float:
    """`mode="chunk"` and `mode="recurrent"` agree on outputs and final state (extra kwargs passed on)."""
    tol = _default_tol(x) if tol is None else tol
    a = call(mixer, x, state=state, output_state=True, mode="chunk", **kw)
    b = call(mixer, x, state=state, output_state=True, mode="recurrent", **kw)
    err = max(rel_err(a.hidden, b.hidden), state_rel_err(a.state, b.state))
    _assert_small(err, tol, "chunk vs recurrent")
    return err


@torch.no_grad()
def check_prefill_then_steps(mixer: Mixer, x: torch.Tensor, split: int, tol: float | None = None,
                             step_mode: str = "recurrent") -> float:
    """Full chunked forward == chunked prefill of x[:, :split] then one-token steps in `step_mode`."""
    tol = _default_tol(x) if tol is None else tol
    B, T, _ = x.shape
    pos = torch.arange(T).expand(B, T)
    full = call(mixer, x, pos, output_state=True, mode="chunk")
    out = call(mixer, x[:, :split], pos[:, :split], output_state=True, mode="chunk")
    hs, st = [out.hidden], out.state
    for t in range(split, T):
        o = call(mixer, x[:, t:t + 1], pos[:, t:t + 1], state=st, output_state=True, mode=step_mode)
        hs.append(o.hidden)
        st = o.state
    err = max(rel_err(torch.cat(hs, 1), full.hidden), state_rel_err(st, full.state))
    _assert_small(err, tol, f"prefill({split}) + {T - split} {step_mode} steps vs full")
    return err


@torch.no_grad()
def check_varlen_equals_separate(mixer: Mixer, lengths: list[int], dtype: torch.dtype = torch.float32,
                                 mode: str = "chunk", initial_state: MixerState | None = None,
                                 tol: float | None = None, seed: int = 0) -> float:
    """Packed documents (B=1, cu_seqlens) give each document's own outputs and final state.

    `initial_state`, if given, has one row per document."""
    hidden = mixer.config.hidden_size
    x = random_hidden(1, sum(lengths), hidden, dtype, seed)
    tol = _default_tol(x) if tol is None else tol
    cu = cu_seqlens_of(lengths)
    pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    packed = call(mixer, x, pos, state=initial_state, cu_seqlens=cu, output_state=True, mode=mode)
    hs, sts = [], []
    for i, n in enumerate(lengths):
        s0 = None if initial_state is None else initial_state.map(lambda t, i=i: t[i:i + 1])
        o = call(mixer, x[:, cu[i]:cu[i + 1]], state=s0, output_state=True, mode=mode)
        hs.append(o.hidden)
        sts.append(o.state)
    err = max(rel_err(packed.hidden, torch.cat(hs, 1)), state_rel_err(packed.state, cat_states(sts)))
    _assert_small(err, tol, f"varlen {lengths} vs separate ({mode})")
    return err


@torch.no_grad()
def check_left_padding(mixer: Mixer, lengths: list[int], T: int | None = None,
                       dtype: torch.dtype = torch.float32, mode: str = "chunk",
                       tol: float | None = None, seed: int = 0, compare_state: bool = True) -> float:
    """A left-padded batch with `attention_mask` gives, on real tokens, each unpadded row's outputs,
    and (if `compare_state`) the same final state (padding never touches the state)."""
    T = max(lengths) if T is None else T
    hidden = mixer.config.hidden_size
    # garbage in the padded slots: it must not leak
    x = random_hidden(len(lengths), T, hidden, dtype, seed) * 3
    tol = _default_tol(x) if tol is None else tol
    mask = left_pad_mask(lengths, T)
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    batch = call(mixer, x, pos, attention_mask=mask, output_state=True, mode=mode)
    err = 0.0
    for i, n in enumerate(lengths):
        row = call(mixer, x[i:i + 1, T - n:], output_state=True, mode=mode)
        err = max(err, rel_err(batch.hidden[i:i + 1, T - n:], row.hidden))
        if compare_state and batch.state is not None:
            err = max(err, state_rel_err(batch.state.map(lambda t, i=i: t[i:i + 1]), row.state))
    _assert_small(err, tol, f"left padding {lengths} vs unpadded rows ({mode})")
    return err


@torch.no_grad()
def check_padding_keeps_state(mixer: Mixer, x: torch.Tensor, mode: str = "recurrent") -> None:
    """Run a prefix, then one more token with attention_mask False: the state must be bit-identical.

    Every state tensor is compared, the short-conv window included (base.ShortConv still shifts
    on padded tokens, so mixers with short_conv fail this today; left padding is unaffected)."""
    B, T, _ = x.shape
    pre = call(mixer, x[:, :-1], output_state=True, mode="chunk")
    pad = torch.zeros(B, 1, dtype=torch.bool)
    pos = torch.full((B, 1), T - 1)
    out = call(mixer, x[:, -1:] * 5, pos, state=pre.state, attention_mask=pad, output_state=True, mode=mode)
    for a, b in zip(out.state.tensors(), pre.state.tensors()):
        assert torch.equal(a, b.to(a.dtype)), "a padded token changed the state"


def check_backward(mixer: Mixer, x: torch.Tensor, mode: str = "chunk", allow_unused: tuple[str, ...] = (),
                   **kw) -> None:
    """loss = sum(out^2) backpropagates finite gradients into x and every parameter
    (names starting with an entry of `allow_unused` may get none)."""
    mixer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    out = call(mixer, x, mode=mode, **kw)
    loss = out.hidden.float().pow(2).sum()
    if out.aux_loss is not None:
        loss = loss + out.aux_loss
    loss.backward()
    assert x.grad is not None and torch.isfinite(x.grad).all(), "input gradient missing or not finite"
    for name, p in mixer.named_parameters():
        if not p.requires_grad or name.startswith(allow_unused):
            continue
        assert p.grad is not None, f"no gradient reached {name}"
        assert torch.isfinite(p.grad).all(), f"non-finite gradient in {name}"


def check_runs_in_dtype(mixer: Mixer, x: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                        mode: str = "chunk") -> torch.Tensor:
    """Forward + backward in `dtype` runs, keeps the dtype, and gives finite values; returns the output."""
    m = mixer.to(dtype)
    xd = x.detach().to(dtype).requires_grad_(True)
    out = call(m, xd, output_state=True, mode=mode)
    assert out.hidden.dtype == dtype, f"output dtype {out.hidden.dtype}, expected {dtype}"
    assert torch.isfinite(out.hidden.float()).all(), "non-finite output"
    out.hidden.float().sum().backward()
    assert xd.grad is not None and torch.isfinite(xd.grad.float()).all()
    return out.hidden
