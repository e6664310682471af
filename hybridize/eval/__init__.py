"""Evaluation suite: one module per task, each usable from Python and from `hybridize eval <task>`.

- `math`: AIME24/25, MATH-500, AMC23, OlympiadBench, GSM8K or any problem/answer JSONL; avg@k, pass@k;
  the pure answer helpers `extract_answer`, `is_correct`, `format_ok` (reused by the GRPO rewards)
- `arith`: generated arithmetic by level (1-6), train/test disjoint by operand triple; a `math` dataset name
- `niah`: RULER-style needle-in-a-haystack (S-NIAH-1/2/3, multi-key/value/query), token-exact lengths/depths
- `mqar`: multi-query associative recall, train-from-scratch comparison of token mixers
- `perplexity`: perplexity vs context length and loss by position (length extrapolation)
- `kv_probe`: the key-value regression probe of "Rethinking Key-Value Relationships in Linear Attention"
- `speed`: prefill/decode throughput, cache size and peak memory, models side by side
- `common`: model loading, generation, result files, tables and plots
- `cli`: the typer commands (`register(app)`)

Submodules are imported on use, so `import hybridize.eval` stays cheap.
"""
