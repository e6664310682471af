"""Text generation and model loading shared by the stages above it (eval, rl, distill, convert).

- `loading`: `load_model(src, dtype, device) -> (model, tokenizer)` on top of the source resolution of
  `hybridize.convert.sources` (the embedded default, GGUF files, local and hub checkpoints), and the one
  dtype-name table `DTYPES`;
- `batched`: `generate` for lists of prompts: jobs sorted by prompt length, left-padded into
  `input_ids` / `attention_mask` `[B, T]` batches, each row cut at its own EOS;
- `fast`: the static-buffer decode loop (`FastGenerator`): `[B, Hkv, L_buf, D]` key/value buffers for softmax
  layers, fixed-size recurrent states for mixer layers, one decode step captured as a CUDA graph on GPU;
  same tokens as `model.generate`;
- `profile`: where the time of one fast decode step goes (kernels per step and per layer type, `torch.profiler`).

Nothing here imports the stages (eval, rl, distill) or a CLI. Submodules are imported by name
(`hybridize.generation.fast`); this package imports nothing so `hybridize --help` stays fast.
"""
