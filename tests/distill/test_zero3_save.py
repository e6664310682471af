"""Stage B under ZeRO-3 in one process (train.deepspeed=ds_zero3.json, the shipped file): held-out perplexity at the
end, then final/. The end's forward leaves ZeRO-3's prefetched parameters in flight, and gathering them for the
save failed ("Cannot partition a param in flight": first seen on two H200s in the long-context stage) until
`zero3_gathered` settled the engine's prefetches first. The model is SmolLM2-shaped (hidden 576, a tied head,
4 layers, a smaller vocabulary): the shipped file's "auto" thresholds then partition and prefetch as they do for
the real one, where a 32-wide test model keeps every parameter whole. DeepSpeed initialises torch.distributed,
so the run happens in a subprocess (this file run as a script), as in test_scale.py."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.distill.test_scale import HAS_DS, RECIPES, run_worker


@pytest.mark.skipif(not HAS_DS, reason="deepspeed is not installed (pip install deepspeed)")
def test_zero3_saves_final_after_a_held_out_evaluation(tmp_path):
    res = run_worker(__file__, tmp_path, timeout=600)
    assert res["steps"] == [1, 2] and res["ppl_rows"] == 2, res     # scored at the start and at the end
    assert res["final"] and res["final_vs_start"] > 0, res          # final/ whole, and trained


def _worker(tmp: Path) -> None:
    import deepspeed.comm.torch as ds_comm
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from hybridize.convert.convert import convert_model
    from hybridize.distill.config import E2EConfig, load_config
    from hybridize.distill.e2e import e2e
    from hybridize.distill.models import load_student
    from tests.distill.helpers import ToyTokenizer, write_texts

    ds_comm.build_shm_op = lambda: None   # the shared-memory all-reduce op is for several CPU ranks
    torch.set_num_threads(2)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=576, intermediate_size=1536, num_hidden_layers=4,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=512,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    teacher = LlamaForCausalLM(cfg).eval()
    convert_model(teacher, "3:1", mixer="sse").save_pretrained(tmp / "student")
    run = load_config(E2EConfig, None, {
        "student": str(tmp / "student"),
        "train": {"run_dir": str(tmp / "run"), "max_steps": 2, "progress": False, "save_every": 0,
                  "warmup_steps": 1, "lr": 1e-3, "deepspeed": str(RECIPES / "ds_zero3.json")},
        "data": {"train": str(write_texts(tmp / "train.jsonl", n=40)), "seq_len": 32, "batch_tokens": 64,
                 "eval": str(write_texts(tmp / "eval.jsonl", n=40, seed=1)), "eval_tokens": 256}})
    student, _ = load_student(run.student)
    e2e(student, teacher, ToyTokenizer(), run)
    rows = [json.loads(x) for x in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
    final = tmp / "run" / "final"
    saved = (final / "model.safetensors").is_file()
    diff = 0.0
    if saved:
        from safetensors.torch import load_file
        a, b = load_file(final / "model.safetensors"), load_file(tmp / "student" / "model.safetensors")
        diff = max((a[k].float() - b[k].float()).abs().max().item() for k in b)
    print("RESULT " + json.dumps({"steps": [r["step"] for r in rows if "loss" in r],
                                  "ppl_rows": sum("ppl" in r for r in rows), "final": saved,
                                  "final_vs_start": diff}), flush=True)


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "worker":
    _worker(Path(sys.argv[2]))
