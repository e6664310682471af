"""What Triton's autotuner picked for our kernels, and how close the other configs came: read from its disk cache.

    python -m benchmarks.ops.autotune_picks [--cache ~/.triton/cache] [--kernels _dk_kernel,_dq_kernel] [--top 6]

Our autotuned kernels keep their picks on disk (`triton_utils.autotuned`: `cache_results=True`), one
`<kernel>.autotune.json` per kernel source, key and config list, with the time of every config it benchmarked. This
prints, per file, the kernel, its key (the constexpr flags and buckets it was tuned for) and its fastest `--top` configs
in ms, fastest first, so one device call that runs a benchmark also tells which tile each pass ran and what the next
best cost (the benchmark's own table gives only the kernel's time). Reads files only: no GPU needed.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.timing import md_table


def picks(cache: Path, kernels: tuple[str, ...] = (), top: int = 6) -> list[dict]:
    """One record per autotune file under `cache`: kernel, key, and its `top` fastest configs as (config, ms)."""
    out = []
    for path in sorted(cache.glob("*/*.autotune.json")):
        name = path.name.split(".")[0]
        if kernels and name not in kernels:
            continue
        data = json.loads(path.read_text())
        rows = []
        for cfg, timing in data.get("configs_timings", []):
            ms = timing[0] if isinstance(timing, list) else timing
            tiles = ", ".join(f"{k}={v}" for k, v in cfg["kwargs"].items())
            rows.append((float(ms), f"{tiles}, w{cfg['num_warps']} s{cfg['num_stages']}"))
        rows.sort()
        out.append(dict(kernel=name, key=data.get("key", []), configs=[(c, ms) for ms, c in rows[:top]],
                        file=str(path)))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cache", default=str(Path.home() / ".triton" / "cache"), help="Triton's cache folder")
    ap.add_argument("--kernels", default="", help="only these kernels (comma-separated names, e.g. _dk_kernel)")
    ap.add_argument("--top", type=int, default=6, help="configs listed per file, fastest first")
    ap.add_argument("--out", default="", help="also write the records as JSON")
    args = ap.parse_args(argv)
    cache = Path(args.cache).expanduser()
    if not cache.is_dir():
        raise SystemExit(f"autotune_picks: no Triton cache at {cache}; pass --cache")
    recs = picks(cache, tuple(k for k in args.kernels.split(",") if k), args.top)
    if not recs:
        raise SystemExit(f"autotune_picks: no *.autotune.json under {cache} (nothing autotuned with cache_results)")
    rows = [[r["kernel"], " ".join(str(k) for k in r["key"] if not str(k).startswith("torch."))]
            + ["; ".join(f"{c}: {ms:.3f}" for c, ms in r["configs"])] for r in recs]
    print(md_table(["kernel", "key (dtypes left out)", f"fastest {args.top} configs, ms"], rows))
    if args.out:
        Path(args.out).write_text(json.dumps(recs, indent=1))


if __name__ == "__main__":
    main()
