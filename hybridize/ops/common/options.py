"""Kernel options: every switch that decides which kernel runs (and how), in one object.

`KernelOptions` has one field per switch, with its default and help. The `HYBRIDIZE_*` environment
variables are read here and nowhere else (`KernelOptions.from_env`), so existing users' variables keep
working; the dispatch code reads `current_kernel_options()` instead of `os.environ` or module globals.

Why `ops/common/options.py` (and not e.g. `ops/backend.py`): the switches are not only the backend choice;
they are the tuning and numerics settings of several kernel modules (dispatch, SSE, the fla adapter, our
Triton kernels), and they live beside dispatch in `hybridize.ops.common`, which every op imports.

Precedence, highest first, field by field:

1. explicit config: a model's `HybridConfig.kernel_options` (a dict of the fields it sets, saved in
   config.json; in force while the model's mixers run, gradient-checkpoint recomputation included), then
   a run's `kernel_options.<field>=...` settings (distill stages: in force for the whole run), then an
   enclosing `use_kernel_options(...)` block / `set_kernel_options(...)` in the process;
2. the environment: `HYBRIDIZE_KERNELS`, `HYBRIDIZE_AUTOTUNE_TOP`, ... (read when nothing explicit is set,
   so a variable set at run time counts, as before);
3. the defaults below.

`resolve_kernel_options(overrides)` gives the options a dict of explicit fields puts in force (the current
ones with the dict's fields replaced). A bad value (environment or config) raises `UserError` in one line
that names the variable and the field. Every run's config.yaml records the options in force
(`hybridize.distill.config.save_config`).

Settings read at a kernel's forward are kept for its backward (`gla_bwd`'s products, the fla adapter's
dqkwg choice), so a backward outside the model's forward uses the forward's options. `autotune_top`
patches Triton's autotuner process-wide when fla's kernels are first used (and again when it changes).
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch

from hybridize.errors import UserError

BACKENDS = ("auto", "torch", "gpu")
CCQ_PRODUCTS = ("single", "split", "tf32")
GLA_PRODUCTS = ("single", "split")
FLA_DQKWG = ("torch", "fla")


def _opt(default, help: str, env: str | None = None, choices: tuple | None = None, min: int | None = None):
    return field(default=default, metadata={"help": help, "env": env, "choices": choices, "min": min})


@dataclass(frozen=True)
class KernelOptions:
    """The kernel switches; `help` of each field says what it does (`describe()` lists them)."""

    kernels: str = _opt("auto", "backend: auto (GPU kernels on CUDA tensors, PyTorch otherwise) | torch (the PyTorch "
                                "forms everywhere) | gpu (a missing GPU kernel is an error)", "HYBRIDIZE_KERNELS",
                        BACKENDS)
    autotune_top: int = _opt(0, "cap fla-core's Triton autotuning to the n preferred configs per kernel (0 = full "
                                "tuning; our kernels' short lists are exempt)", "HYBRIDIZE_AUTOTUNE_TOP", min=0)
    ccq_products: str = _opt("single", "CCQ read, bf16 products: single (one bf16 product) | split (hi/lo pair in "
                                       "the forward and dq passes, tf32 in dk) | tf32", "HYBRIDIZE_CCQ_PRODUCTS",
                             CCQ_PRODUCTS)
    ccq_rows: int = _opt(128, "CCQ read: (piece, head) rows the automatic piece length aims at",
                         "HYBRIDIZE_CCQ_ROWS", min=1)
    ccq_segment: int | None = _opt(None, "CCQ read and pieces GLA: fixed piece length in tokens (None = automatic; "
                                         "0 = one piece per sequence)", "HYBRIDIZE_CCQ_SEGMENT")
    ccq_tune_top: int = _opt(0, "CCQ read: keep the first n configs of its autotune lists (0 = all; 1 for tests "
                                "that only check numbers)", "HYBRIDIZE_CCQ_TUNE_TOP", min=0)
    fla_dqkwg: str = _opt("torch", "gated delta backward's chunk_bwd_dqkwg: torch (our batched fp32 replacement, "
                                   "fla issue #640) | fla (fla's own kernel)", "HYBRIDIZE_FLA_DQKWG", FLA_DQKWG)
    gla_products: str = _opt("single", "pieces GLA backward, bf16 products with the carried state: single | split "
                                       "(hi/lo pair)", "HYBRIDIZE_GLA_PRODUCTS", GLA_PRODUCTS)
    gla_dg_anchor: int = _opt(512, "pieces GLA backward: every n tokens of a piece the gates' gradient suffix sum is "
                                   "set to its exact value from the state (a multiple of 16; 0 = never: one sum over "
                                   "each piece, whose rounding grows with the piece's length)",
                              "HYBRIDIZE_GLA_DG_ANCHOR", min=0)
    gla_tune_top: int = _opt(0, "pieces GLA: keep the first n configs of its autotune lists (0 = all; 1 for tests "
                                "that only check numbers)", "HYBRIDIZE_GLA_TUNE_TOP", min=0)
    gla_rows: int = _opt(512, "pieces GLA: (piece, head) rows the automatic piece length aims at",
                         "HYBRIDIZE_GLA_ROWS", min=1)
    sse_gla_pieces: bool = _opt(True, "SSE varlen GLA on CUDA bf16 runs our pieces GLA (false: dispatch's op, "
                                      "fla's chunk_gla)", "HYBRIDIZE_SSE_GLA_PIECES")
    sse_gla_gather: str = _opt("auto", "SSE varlen GLA on CUDA bf16 (the pieces GLA) reads the shared and sparse "
                                       "tensors in place instead of the row packer copying them into the varlen "
                                       "layout: auto (both paths in place without gradient, the shared path "
                                       "with it: the faster in each) | on (both paths in place with gradient "
                                       "too: no packed copies kept for the backward, least activation memory, a "
                                       "slower backward) | shared (only the shared path in place, the sparse rows "
                                       "packed) | off (packed rows everywhere, for benchmarks)",
                               "HYBRIDIZE_SSE_GLA_GATHER", ("auto", "on", "shared", "off"))
    sse_triton: bool = _opt(True, "SSE: our Triton row movers and decode step on CUDA tensors (false: the PyTorch "
                                  "forms on CUDA too, for benchmarks); was `sse.USE_TRITON`")
    sse_fused_step: bool = _opt(True, "SSE on GLA, decode: the front end after the projection matmuls and both "
                                      "paths' state updates in one Triton kernel (false: the separate kernels, for "
                                      "benchmarks)", "HYBRIDIZE_SSE_FUSED_STEP")
    sse_step_finish: bool = _opt(True, "SSE's one-kernel decode step also applies the output norm and gate (two "
                                       "kernels fewer per layer; false: they run after it, for benchmarks)",
                                 "HYBRIDIZE_SSE_STEP_FINISH")
    sse_fused_prefill: bool = _opt(True, "SSE without gradient over several tokens (prefill, evaluation): the fused "
                                         "front end, every projection of x in one matmul and both paths' q/k normed "
                                         "and rotated together (false: one matmul per projection, for benchmarks; "
                                         "decode steps keep the fused front end)", "HYBRIDIZE_SSE_FUSED_PREFILL")
    window_step: bool = _opt(True, "window layer (swa), decode: the ring write, the attention over the sinks and "
                                   "the window and the slot clear as a split-KV Triton kernel on CUDA (false: the "
                                   "PyTorch step, for benchmarks)",
                             "HYBRIDIZE_WINDOW_STEP")
    sse_merged_lowrank: str = _opt("auto", "SSE's one-kernel decode step: the LoRA and gate up-projections merged "
                                           "into the stage-1 matmul (one GEMM per layer fewer, (H + Hk) D + gate "
                                           "widths more weight rows of the hidden size): on | off | auto (merged "
                                           "when that adds at most 4 MiB of weight per layer: small models)",
                                   "HYBRIDIZE_SSE_MERGED_LOWRANK", ("auto", "on", "off"))
    sse_step_lowrank: str = _opt("auto", "SSE's one-kernel decode step, when the up-projections are not merged "
                                         "(sse_merged_lowrank): the LoRA and gate up-projections applied in the step "
                                         "kernel from stage 1's low-rank columns (one GEMM per layer fewer, no weight "
                                         "added; one H100, the 1.7B hybrid compiled: 1.7% faster at 2k x 1, 1.4% at "
                                         "16k x 8) or by a stage-2 GEMM: on | off | auto (in the step at batches up to "
                                         "8, the sizes it was timed at; each of a head's programs reads the weight "
                                         "panels, so larger batches read more)", "HYBRIDIZE_SSE_STEP_LOWRANK",
                                  ("auto", "on", "off"))
    pdl: bool = _opt(True, "decode steps on Hopper or later: programmatic dependent launch (ops/common/pdl.py). "
                           "Our decode kernels are launched before the kernel before them finishes and wait for "
                           "it in-kernel; a compiled step in a CUDA graph gets inductor's PDL kernels (false: plain "
                           "launches, for benchmarks)", "HYBRIDIZE_PDL")
    force_triton: bool = _opt(False, "SSE and the window layer: run our Triton kernels on CPU tensors too (tests "
                                     "under TRITON_INTERPRET=1); was `sse.FORCE_TRITON`")

    def __post_init__(self):
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, _check(f, getattr(self, f.name), f"kernel_options.{f.name}"))

    @classmethod
    def from_env(cls, environ=None) -> "KernelOptions":
        """Defaults, replaced by every `HYBRIDIZE_*` variable that is set (and not empty)."""
        environ = os.environ if environ is None else environ
        kw = {}
        for f in dataclasses.fields(cls):
            var = f.metadata["env"]
            raw = None if var is None else environ.get(var)
            if raw is None or raw.strip() == "":
                continue
            kw[f.name] = _check(f, raw.strip(), f"{var}={raw!r} (kernel_options.{f.name})")
        return cls(**kw)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def replace(self, **changes) -> "KernelOptions":
        return dataclasses.replace(self, **changes)

    @classmethod
    def describe(cls) -> list[tuple[str, object, str | None, str]]:
        """(field, default, environment variable or None, help) of every option."""
        return [(f.name, f.default, f.metadata["env"], f.metadata["help"]) for f in dataclasses.fields(cls)]


_FIELDS = {f.name: f for f in dataclasses.fields(KernelOptions)}


def _kind(f: dataclasses.Field) -> str:
    """"bool", "int" or "str": the field's annotation (a string under `from __future__ import annotations`)."""
    return "bool" if f.type == "bool" else "int" if str(f.type).startswith("int") else "str"


_SWITCH = {"1": "on", "true": "on", "yes": "on", "0": "off", "false": "off", "no": "off"}


def _check(f: dataclasses.Field, value, where: str):
    """`value` as the field's type (strings from the environment or a command line parsed), or UserError."""
    choices, low, kind = f.metadata["choices"], f.metadata["min"], _kind(f)
    try:
        if value is None:
            if f.default is not None:
                raise ValueError
            return None
        if kind == "bool":
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if kind == "int":
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            value = int(value)
            if low is not None and value < low:
                raise UserError(f"{where}: must be >= {low}, got {value}")
            return value
        if choices is not None and {"on", "off"} <= set(choices):
            # a switch with more settings than two ("auto"): booleans are on / off, so a config that recorded it
            # when it was a bool (sse_merged_lowrank before 582b1cc) and `=1` / `=0` in the environment still work
            value = _SWITCH.get(str(value).strip().lower(), value)
        value = str(value)
        if choices is not None and value not in choices:
            raise UserError(f"{where}: must be one of {' | '.join(choices)}, got {value!r}")
        return value
    except (TypeError, ValueError):
        expected = {"bool": "true/false", "int": "an integer", "str": "a string"}[kind]
        raise UserError(f"{where}: expected {expected}, got {value!r}") from None


# ---- the options in force ------------------------------------------------------------------------

_CURRENT: KernelOptions | None = None          # set explicitly (use_kernel_options / set_kernel_options)
_ENV_VARS = tuple(f.metadata["env"] for f in dataclasses.fields(KernelOptions) if f.metadata["env"])
_ENV_CACHE: tuple[tuple, KernelOptions | None] = ((), None)   # (raw values, options) of the last env read


def _env_options() -> KernelOptions:
    global _ENV_CACHE
    raw = tuple(os.environ.get(v) for v in _ENV_VARS)
    if _ENV_CACHE[1] is None or _ENV_CACHE[0] != raw:
        _ENV_CACHE = (raw, KernelOptions.from_env())
    return _ENV_CACHE[1]


def current_kernel_options() -> KernelOptions:
    """The options in force: the explicit ones if set, else the environment's (read live) over the defaults."""
    if _CURRENT is not None:
        return _CURRENT
    if _ENV_CACHE[1] is not None and torch.compiler.is_compiling():
        return _ENV_CACHE[1]   # a traced region reads no environment: the last options read
    return _env_options()


def triton_kernels_apply(x: torch.Tensor, opts: KernelOptions, enabled: bool) -> bool:
    """Our Triton kernels may run on x: `enabled` (the op's own option), not fp64, option `kernels` not "torch", a
    CUDA tensor (or option `force_triton`: tests run the kernels on CPU tensors under TRITON_INTERPRET=1), and triton
    importable (checked without importing it)."""
    if not enabled or x.dtype == torch.float64 or opts.kernels == "torch":
        return False
    return (x.is_cuda or opts.force_triton) and importlib.util.find_spec("triton") is not None


def set_kernel_options(opts: KernelOptions | None) -> KernelOptions | None:
    """Make `opts` current for the process (None: back to the environment); returns the explicit ones before."""
    global _CURRENT
    if opts is not None and not isinstance(opts, KernelOptions):
        raise TypeError(f"expected KernelOptions or None, got {type(opts).__name__}")
    before, _CURRENT = _CURRENT, opts
    return before


@contextmanager
def use_kernel_options(opts: KernelOptions | dict | None = None, **changes) -> Iterator[KernelOptions]:
    """Within the block `opts` (a KernelOptions, or a dict of fields over the current ones) plus `changes`
    are in force; the options before are restored after."""
    new = opts if isinstance(opts, KernelOptions) else resolve_kernel_options(opts)
    if changes:
        new = new.replace(**check_overrides(changes))
    before = set_kernel_options(new)
    try:
        yield new
    finally:
        set_kernel_options(before)


def _field(name: str) -> dataclasses.Field:
    if name not in _FIELDS:
        raise UserError(f"unknown kernel option {name!r}; known: {', '.join(_FIELDS)}")
    return _FIELDS[name]


def check_overrides(overrides: dict | None, where: str = "kernel_options") -> dict:
    """A dict of explicit fields, checked and parsed (unknown field or bad value: UserError)."""
    if overrides is None:
        return {}
    if not isinstance(overrides, dict):
        raise UserError(f"{where} must be a mapping of option: value, got {overrides!r}")
    return {k: _check(_field(k), v, f"{where}.{k}") for k, v in overrides.items()}


def resolve_kernel_options(overrides: dict | None = None) -> KernelOptions:
    """The current options with the explicit fields of `overrides` replaced (explicit > environment > defaults)."""
    base = current_kernel_options()
    checked = check_overrides(overrides)
    return base.replace(**checked) if checked else base


def with_run_kernel_options(fn):
    """Decorator for a run entry point `fn(cfg, ...)`: the options of `cfg.kernel_options` (explicit fields
    over the current ones) are in force for the call, and config.yaml written by it records them."""
    @functools.wraps(fn)
    def wrapper(cfg, *args, **kwargs):
        with use_kernel_options(resolve_kernel_options(getattr(cfg, "kernel_options", None))):
            return fn(cfg, *args, **kwargs)
    return wrapper
