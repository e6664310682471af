"""Forward+backward time of every mixer's chunked form vs its recurrent (per-token) form on CPU.

One layer at the embedded default's shape (hidden 576, 9 heads, 3 KV heads, head_dim 64), batch 1,
fp32. Prints a markdown table (also written to --out) with the ratio recurrent / chunk side by side.

    python -m benchmarks.layers.mixers_cpu --lengths 512 2048 --threads 2
"""
from __future__ import annotations

import argparse
import platform
import time

import torch

from benchmarks.timing import md_header
from hybridize.mixers import build_mixer, mixer_names

SHAPE = dict(hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64)


def rope(T: int, dim: int, base: float = 10000.0):
    """(cos, sin) `[1, T, dim]` as the HF rotary embedding makes them (for mixers that keep RoPE)."""
    inv = 1.0 / base ** (torch.arange(0, dim, 2).float() / dim)
    ang = torch.outer(torch.arange(T).float(), inv)
    emb = torch.cat([ang, ang], dim=-1)[None]
    return emb.cos(), emb.sin()


def time_fwd_bwd(mixer, x, mode: str, repeats: int) -> float:
    best = float("inf")
    pos = rope(x.shape[1], SHAPE["head_dim"]) if mixer.config.use_rope else None
    for _ in range(repeats):
        xi = x.detach().requires_grad_(True)
        t0 = time.perf_counter()
        out = mixer(xi, position_embeddings=pos, mode=mode).hidden
        out.float().pow(2).mean().backward()
        best = min(best, time.perf_counter() - t0)
        mixer.zero_grad(set_to_none=True)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--mixers", nargs="+", default=mixer_names())
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--skip-recurrent-above", type=int, default=4096,
                    help="skip the per-token form above this length (it is a Python loop)")
    ap.add_argument("--out", default=None, help="also write the table to this file")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    header = (f"CPU: {platform.processor() or platform.machine()}, {args.threads} threads, torch {torch.__version__}, "
              f"fp32, batch 1, {SHAPE}")
    rows = [md_header(["mixer", "T", "chunk fwd+bwd (s)", "recurrent fwd+bwd (s)", "recurrent / chunk"], "lrrrr")]
    print(header)
    for name in args.mixers:
        mixer = build_mixer(name, **SHAPE).train()
        for T in args.lengths:
            x = torch.randn(1, T, SHAPE["hidden_size"]) * 0.5
            t_chunk = time_fwd_bwd(mixer, x, "chunk", args.repeats)
            if T <= args.skip_recurrent_above:
                t_rec = time_fwd_bwd(mixer, x, "recurrent", args.repeats)
                row = f"| {name} | {T} | {t_chunk:.3f} | {t_rec:.3f} | {t_rec / t_chunk:.1f}x |"
            else:
                row = f"| {name} | {T} | {t_chunk:.3f} | skipped | - |"
            rows.append(row)
            print(row, flush=True)
    table = "\n".join([header, "", *rows])
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
