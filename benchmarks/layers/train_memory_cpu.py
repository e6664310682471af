"""Peak host memory of one training forward + backward of a hybrid on the CPU, by sequence length, and the
autograd state each source line saves (the torch reference ops are the CPU training path).

    python -m benchmarks.layers.train_memory_cpu --model <hybrid folder> --lengths 256 512 1024 --saved-at 512

Mixer and attention parameters train (stage B's `params=mixer`), everything else is frozen; the loss is a
log-sum-exp of the logits, enough to run the whole backward. Peak RSS is the process's high-water mark, so
lengths run in increasing order.
"""
from __future__ import annotations

import argparse
import collections
import resource
import traceback

import torch

from hybridize.generation.loading import load_model


def peak_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6   # kB on Linux


def saved_by_line(model, T: int, top: int = 8) -> list[tuple[str, float]]:
    """GB of tensors autograd saves in one forward of T tokens, by the innermost hybridize/transformers line."""
    total, seen = collections.Counter(), set()

    def pack(t):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            frames = [f for f in traceback.extract_stack() if "hybridize" in f.filename or "transformers" in f.filename]
            where = f"{frames[-1].filename.split('/')[-1]}:{frames[-1].lineno} {frames[-1].name}" if frames else "?"
            total[where] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=torch.randint(100, 1000, (1, T)), position_ids=torch.arange(T)[None])
    return [(k, v / 1e9) for k, v in total.most_common(top)] + [("total", sum(total.values()) / 1e9)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a converted / distilled hybrid folder")
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024])
    p.add_argument("--saved-at", type=int, default=0, help="also list the saved autograd state by line at this length")
    p.add_argument("--layout", default="", choices=("", "masking", "varlen", "auto"),
                   help="SSE layers' training layout for this run (default: the checkpoint's; auto takes varlen from "
                        "its varlen_min_len, 1,024 tokens)")
    a = p.parse_args(argv)
    model, _ = load_model(a.model, dtype="float32", device="cpu")
    model.train()
    if a.layout:
        for m in model.modules():   # the mixers' own config object: the layout is read at each forward
            if hasattr(getattr(m, "config", None), "varlen_min_len"):
                m.config.layout = a.layout
    for n, prm in model.named_parameters():
        prm.requires_grad_("mixer" in n or "self_attn" in n)
    print(f"loaded: peak {peak_gb():.2f} GB")
    print("| tokens | peak GB after forward | after backward |\n| ---: | ---: | ---: |")
    for T in sorted(a.lengths):
        out = model(input_ids=torch.randint(100, 1000, (1, T)), position_ids=torch.arange(T)[None])
        fwd = peak_gb()
        out.logits.float().logsumexp(-1).mean().backward()
        print(f"| {T} | {fwd:.2f} | {peak_gb():.2f} |")
        del out
    if a.saved_at:
        print(f"\nsaved autograd state at {a.saved_at} tokens:")
        for where, gb in saved_by_line(model, a.saved_at):
            print(f"  {gb:7.3f} GB  {where}")


if __name__ == "__main__":
    main()
