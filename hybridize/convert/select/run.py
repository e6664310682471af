"""`run_select`: measure (or reuse recorded measurements), choose, write the outputs. See the package
docstring for what each criterion measures."""
from __future__ import annotations

import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from hybridize.convert.fingerprint import fingerprint, recorded_source
from hybridize.convert.settings import check_user_settings
from hybridize.convert.sources import load_config
from hybridize.generation.loading import load_model, resolve_device
from .choose import combined_scores, greedy_choice, plan_string, rank_choice, window_choice
from .config import SelectConfig, check_config, measure_settings
from .data import align_data, kl_batches, kl_stream, load_docs, split_docs
from .needle import needle_batches, needle_prompts
from .probe import probe_cost, record_probe
from .record import MD, PLAN, PNG, SelectRecord, atomic_write, save_bars, table_rows, write_md


#: scores a criterion ranks by; combined averages the ranks of these
RANKED = {"kl": ["kl"], "needle": ["needle"], "retrieval": ["retrieval"], "combined": ["kl", "needle", "retrieval"],
          "copying": ["induction"]}


class Session:
    """One run: the loaded teacher, the settings, the record, and what is built lazily (aligned slots,
    teacher probes, needle prompts) so the scoring and the greedy choice share them."""

    def __init__(self, teacher, tokenizer, cfg: SelectConfig, record: SelectRecord, out: Path, device: str,
                 log=print, progress: bool = True):
        self.teacher, self.tokenizer, self.cfg, self.record = teacher, tokenizer, cfg, record
        self.out, self.device, self.log, self.progress = out, device, log, progress
        self.n = teacher.config.num_hidden_layers
        self._slots = self._probes = self._prompts = None

    def prompts(self):
        if self._prompts is None:
            self._prompts = needle_prompts(self.tokenizer, self.cfg.needle_length, self.cfg.needle_samples)
        return self._prompts

    def slots(self) -> dict:
        if self._slots is None:
            self._slots = aligned_slots(self)
        return self._slots

    def probes(self) -> dict:
        if self._probes is None:
            stream = kl_stream(self.tokenizer, self.cfg.text, self.cfg.tokens)
            self._probes = {"kl": record_probe(self.teacher, kl_batches(stream, self.cfg.seq_len), self.device)}
            if self.cfg.needs_needle():
                self._probes["needle"] = record_probe(self.teacher, needle_batches(self.prompts()), self.device)
        return self._probes


def teacher_record(src: str, config) -> dict:
    return {"src": src, "recorded": recorded_source(src), "fingerprint": fingerprint(src),
            "model_type": config.model_type, "num_layers": config.num_hidden_layers}


def prepare(src: str, cfg: SelectConfig, out: Path) -> SelectRecord:
    """Every check that needs no weights, then the record (a resume check against OUT/select.json)."""
    config = load_config(src)
    n = config.num_hidden_layers
    check_config(cfg, n, getattr(config, "max_position_embeddings", None))
    check_user_settings(config, [cfg.mixer] * n, cfg.mixer_settings)
    return SelectRecord(out, teacher_record(src, config), measure_settings(cfg), cfg.overwrite)


def run_select(src: str, cfg: SelectConfig, out: str | Path, log=print, progress: bool = True) -> dict:
    """The whole `select` command; returns the final record (also OUT/select.json)."""
    t0 = time.perf_counter()
    out = Path(out)
    record = prepare(src, cfg, out)
    (out / PLAN).unlink(missing_ok=True)  # present again only when this run has finished
    device = resolve_device(cfg.device)
    teacher, tokenizer = load_model(src, dtype=torch.float32, device=device, need_tokenizer=False)
    teacher.eval().requires_grad_(False)
    log(f"select: {src} ({record.data['teacher']['num_layers']} layers) on {device}, criterion {cfg.criterion}, "
        f"keep {cfg.keep}")
    s = Session(teacher, tokenizer, cfg, record, out, device, log, progress)
    measure(s)
    kept = greedy(s) if cfg.greedy else rank_kept(s)
    record.data["timings_s"] = {**record.data.get("timings_s", {}), "this_run": round(time.perf_counter() - t0, 1)}
    finish(s, kept)
    return record.data


def measure(s: Session) -> None:
    """Fill the record's scores with what the criterion ranks by (recorded layers are skipped)."""
    wanted = RANKED[s.cfg.criterion]
    if "retrieval" in wanted and len(s.record.scores("retrieval")) < s.n:
        # deferred: the measurement modules load only when `hybridize select` runs (this module loads with the CLI)
        from .retrieval import retrieval_scores

        t = time.perf_counter()
        r = retrieval_scores(s.teacher, s.prompts(), s.device, s.progress)
        s.record.data["scores"]["retrieval"] = {str(i): v for i, v in enumerate(r["score"])}
        s.record.put(retrieval_heads=r["head"], **_timed(s.record, "retrieval", t))
    if "induction" in wanted and len(s.record.scores("induction")) < s.n:
        from .copying import copying_scores

        t = time.perf_counter()
        text = kl_stream(s.tokenizer, s.cfg.text, s.cfg.seq_len)[:s.cfg.seq_len]
        r = copying_scores(s.teacher, text, s.device, seed=s.cfg.seed)
        for name in ("induction", "previous_token"):
            s.record.data["scores"][name] = {str(i): v for i, v in enumerate(r[name])}
        s.record.put(induction_heads=r["induction_head"], previous_heads=r["previous_head"],
                     **_timed(s.record, "copying", t))
    if s.cfg.needs_alignment():
        per_layer_costs(s)


def per_layer_costs(s: Session) -> None:
    """KL (and needle NLL increase) of the teacher with each layer alone converted to its aligned mixer."""
    needle = s.cfg.needs_needle()
    todo = [i for i in range(s.n) if i not in s.record.scores("kl") or (needle and i not in s.record.scores("needle"))]
    if not todo:
        return
    slots, probes, t = s.slots(), s.probes(), time.perf_counter()
    for i in tqdm(todo, desc="score layers (one converted at a time)", disable=not s.progress):
        scores = s.record.data["scores"]
        scores.setdefault("kl", {})[str(i)] = probe_cost(s.teacher, probes["kl"], {i: slots[i]}, s.device)["kl"]
        if needle:
            scores.setdefault("needle", {})[str(i)] = probe_cost(s.teacher, probes["needle"], {i: slots[i]},
                                                                 s.device)["nll"]
        s.record.write()
    s.record.put(**_timed(s.record, "score_layers", t))


def aligned_slots(s: Session) -> dict:
    """Every layer's mixer slot, aligned now (then saved) or loaded from OUT/aligned.safetensors."""
    # deferred: the measurement modules load only when `hybridize select` runs (this module loads with the CLI)
    from .align import ALIGN_STATE, align_slots, converted_slots, load_slots, save_slots

    cfg = s.cfg
    slots = converted_slots(s.teacher, s.tokenizer, cfg.mixer, cfg.mixer_settings, cfg.seed)
    state = s.out / ALIGN_STATE
    if state.is_file():
        load_slots(slots, state)
        s.log(f"select: aligned mixers loaded from {state}")
        return slots
    t, nmse = time.perf_counter(), {}
    if cfg.steps:
        docs = load_docs(s.tokenizer, cfg.text, cfg.tokens + max(cfg.steps * cfg.align_batch_tokens, cfg.align_seq_len))
        data = align_data(split_docs(docs, cfg.tokens, cfg.text)[1], cfg.align_seq_len, cfg.align_batch_tokens,
                          cfg.seed)
        nmse = align_slots(s.teacher, slots, data, cfg.steps, cfg.lr, s.device, s.progress)
    s.out.mkdir(parents=True, exist_ok=True)
    save_slots(slots, state)
    if nmse:
        s.record.data["scores"]["align_nmse"] = {str(i): v for i, v in nmse.items()}
    s.record.put(**_timed(s.record, "align", t))
    return slots


def rank_kept(s: Session) -> list[int]:
    """The layers with the highest score (criterion kl / needle / retrieval) or combined rank."""
    wanted = RANKED[s.cfg.criterion]
    if len(wanted) == 1:
        return rank_choice(s.record.scores(wanted[0]), s.cfg.keep)
    combined = combined_scores({c: s.record.scores(c) for c in wanted})
    s.record.data["scores"]["combined"] = {str(i): v for i, v in combined.items()}
    return rank_choice(combined, s.cfg.keep)


def greedy(s: Session) -> list[int]:
    """Greedy addition of kept layers on the first `greedy_tokens` KL tokens (`choose.greedy_choice`)."""
    done = s.record.data["greedy"]
    if len(done) >= s.cfg.keep:
        return sorted(step["layer"] for step in done[:s.cfg.keep])
    slots, probe = s.slots(), s.probes()["kl"].head(s.cfg.greedy_tokens)
    bar = tqdm(total=s.cfg.keep, initial=len(done), desc="greedy (keep one more softmax layer)", disable=not s.progress)

    def cost(kept: list[int]) -> float:
        return probe_cost(s.teacher, probe, {i: slots[i] for i in range(s.n) if i not in kept}, s.device)["kl"]

    def on_step(step: dict) -> None:
        done.append(step)
        s.record.write()
        bar.update(1)

    kept = greedy_choice(cost, s.record.scores("kl"), s.cfg.keep, s.cfg.greedy_candidates, list(done), on_step)
    bar.close()
    return kept


def finish(s: Session, kept: list[int]) -> None:
    """The choice into select.json, then select.md, select.png and (last) plan.txt."""
    windows = window_choice(s.record.scores("previous_token"), kept, s.cfg.windows)
    plan = plan_string(kept, windows)
    s.record.put(criterion=s.cfg.criterion, keep=s.cfg.keep, use_greedy=s.cfg.greedy, chosen=kept, plan=plan,
                 windows=len(windows), window_layers=windows, mixer=s.cfg.mixer, device=s.device)
    rows = table_rows(s.record.data, kept)
    write_md(s.out / MD, s.record.data, rows)
    save_bars(s.out / PNG, s.record.data, rows)
    atomic_write(s.out / PLAN, plan + "\n")


def _timed(record: SelectRecord, name: str, t0: float) -> dict:
    return {"timings_s": {**record.data.get("timings_s", {}), name: round(time.perf_counter() - t0, 1)}}
