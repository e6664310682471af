"""The embedded default teacher (SmolLM2-135M-Instruct) side by side with hybrids of it (converted,
distilled, ...): GSM8K, S-NIAH-1, prefill/decode speed, one markdown table with a column per model.

The logic is `hybridize.eval.compare` (tested in tests/eval/test_compare.py); this is its command line:

    python -m benchmarks.pipeline.eval_default                           # teacher + in-process conversion
    python -m benchmarks.pipeline.eval_default --model converted=runs/conv --model distilled=runs/dist
    python -m benchmarks.pipeline.eval_default --gsm8k-n 20 --niah-lengths 1k --speed-lengths 1k,2k   # quick
    python -m benchmarks.pipeline.eval_default --help                    # every option
"""
from __future__ import annotations

from hybridize.eval.compare import main

if __name__ == "__main__":
    main()
