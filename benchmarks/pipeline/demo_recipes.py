"""Which step budget and settings should `hybridize demo` use? Runs the demo under several override sets
and prints held-out perplexity per stage side by side (rows appended to --out as each run ends).

The demo's budgets are in steps, so the quality of a setting does not depend on the device: a GPU
explores the settings quickly, and the CPU then times the chosen one. Variants are data (VARIANTS);
every run reuses the first run's training text, so they differ only in their settings.

    python -m benchmarks.pipeline.demo_recipes --teacher default --variants base,rows512 --out runs/recipes
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from hybridize.distill.demo import demo_config, run_demo

#: override sets; "base" is DemoConfig's defaults (since 2026-11-25 those of "a300_b80_lr2x"; the variants
#: written before then are relative to the earlier defaults A200/B60, lr 2e-3/3e-4, which "old" restores)
VARIANTS: dict[str, dict] = {
    "base": {},
    "old": {"align_steps": 200, "e2e_steps": 60, "align_lr": 2e-3, "e2e_lr": 3e-4},
    "rows512": {"batch_tokens": 512},
    "seq512": {"seq_len": 512, "batch_tokens": 512},
    "b_all": {"e2e_params": "all", "e2e_lr": 1e-4},
    "b_all_rows512": {"batch_tokens": 512, "e2e_params": "all", "e2e_lr": 1e-4},
    "a_lr5e-3_rows512": {"batch_tokens": 512, "align_lr": 5e-3},
    "a100_b150_all": {"align_steps": 100, "e2e_steps": 150, "e2e_params": "all", "e2e_lr": 1e-4},
    "a100_b150_all_rows512": {"align_steps": 100, "e2e_steps": 150, "e2e_params": "all", "e2e_lr": 1e-4,
                              "batch_tokens": 512},
    "x4_all_rows512": {"align_steps": 400, "e2e_steps": 240, "e2e_params": "all", "e2e_lr": 1e-4,
                       "batch_tokens": 512},
    "sse_n2_rows512": {"batch_tokens": 512, "mixer_settings": {"chunk_size": 16, "num_partitions": 2}},
    "gla_rows512": {"mixer": "gla", "mixer_settings": {}, "batch_tokens": 512},
    "gla_rows256": {"mixer": "gla", "mixer_settings": {}, "batch_tokens": 256},
    "rows256": {"batch_tokens": 256},
    "lr2x": {"align_lr": 4e-3, "e2e_lr": 6e-4},
    "lr2x_b1e-3": {"align_lr": 4e-3, "e2e_lr": 1e-3},
    "a240_b80_lr2x": {"align_steps": 240, "e2e_steps": 80, "align_lr": 4e-3, "e2e_lr": 6e-4},
    "n2_lr2x": {"align_lr": 4e-3, "e2e_lr": 6e-4, "mixer_settings": {"chunk_size": 16, "num_partitions": 2}},
    "lr3x": {"align_lr": 6e-3, "e2e_lr": 9e-4},
    "a300_b80": {"align_steps": 300, "e2e_steps": 80},
    "a300_b80_lr2x": {"align_steps": 300, "e2e_steps": 80, "align_lr": 4e-3, "e2e_lr": 6e-4},
    "a300_b80_lr3x": {"align_steps": 300, "e2e_steps": 80, "align_lr": 6e-3, "e2e_lr": 9e-4},
    "a260_b70_lr2x": {"align_steps": 260, "e2e_steps": 70, "align_lr": 4e-3, "e2e_lr": 6e-4},
    "rows256_a150_b40_lr2x": {"batch_tokens": 256, "align_steps": 150, "e2e_steps": 40, "align_lr": 4e-3,
                              "e2e_lr": 6e-4},
    "rows512_a120_b40_lr2x": {"batch_tokens": 512, "align_steps": 120, "e2e_steps": 40, "align_lr": 4e-3,
                              "e2e_lr": 6e-4},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--teacher", default="default")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default="runs/recipes")
    ap.add_argument("--set", nargs="*", default=[], help="overrides applied to every variant (key=value)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    train_text = ""
    for name in args.variants.split(","):
        over = {"out": str(out / name), "teacher": args.teacher,
                **{k: json.dumps(v) if isinstance(v, dict) else v for k, v in VARIANTS[name].items()}}
        if train_text:
            over["train_text"] = train_text
        t0 = time.perf_counter()
        s = run_demo(demo_config([f"{k}={v}" for k, v in over.items()] + args.set))
        train_text = train_text or str(out / name / "data" / "train.jsonl")
        row = {"variant": name, "settings": VARIANTS[name], "perplexity": s["perplexity"],
               "ratio": s["ratio_to_teacher"], "align": s["align"], "e2e": s["e2e"], "chat": s["chat"]["student"],
               "wall_s": round(time.perf_counter() - t0, 1)}
        with (out / "recipes.jsonl").open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"RESULT {name}: " + json.dumps({k: round(v, 2) for k, v in s["perplexity"].items()}), flush=True)


if __name__ == "__main__":
    main()
