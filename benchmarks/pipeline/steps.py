"""One step of a device pipeline: a `hybridize` command (what a user would type), its output in
`<work>/logs/NAME.log`, skipped when its output already exists, timed into `<work>/steps.jsonl`; a failure ends
the pipeline with the log's last lines. Used by `recovery_variants.py` and `reasoning.py`.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path


def say(line: str) -> None:
    """One whole line per write (pipelines run steps from several threads)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def run_step(work: Path, name: str, args: list[str], done: Path | None = None, env: dict | None = None,
             deadline: float = 0.0, **row) -> None:
    """Run `hybridize ARGS` unless `done` exists. `deadline` (Unix time, 0 = none): past it the step does not
    start and the process exits with code 3, so a step never straddles the end of a device call. `row`: extra
    fields of the step's steps.jsonl line."""
    if done is not None and done.exists():
        say(f"{name}: {done} exists, skipped")
        return
    if deadline and time.time() > deadline:
        say(f"{name}: past the deadline, not started")
        sys.exit(3)
    log = work / "logs" / f"{name}.log"
    t0 = time.perf_counter()
    say(f"{time.strftime('%T')} start {name}")
    with log.open("w") as f:
        r = subprocess.run([sys.executable, "-m", "hybridize.cli", *args], stdout=f, stderr=subprocess.STDOUT,
                           env={**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"})
    took = round(time.perf_counter() - t0, 1)
    with (work / "steps.jsonl").open("a") as f:
        f.write(json.dumps({"step": name, "seconds": took, "exit": r.returncode, **row}) + "\n")
    say(f"{time.strftime('%T')} end {name} ({took} s, exit {r.returncode})")
    if r.returncode != 0:
        msg = f"{name} failed ({log}): " + " | ".join(log.read_text(errors="replace").strip().splitlines()[-4:])
        say(msg)   # a thread's SystemExit is silent
        sys.exit(msg)
