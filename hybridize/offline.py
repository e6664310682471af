"""No network at run time unless asked: telemetry always off, `datasets` offline unless hub data is named.

What contacted servers with local data and a local model, and the switch that stops it:
- `datasets.load_dataset("json", data_files=...)` on a local file HEADs an S3 URL to count a download
  (`datasets.load.increase_load_count`): HF_UPDATE_DOWNLOAD_COUNTS=0, and HF_DATASETS_OFFLINE=1 when
  no argument names hub data;
- every TRL trainer (`trl.trainer.base_trainer._BaseTrainer._send_telemetry`, so `grpo` and `sft`)
  starts huggingface_hub's telemetry thread: HF_HUB_DISABLE_TELEMETRY=1, the switch
  `huggingface_hub.utils.send_telemetry` checks (transformers' own pings honour it too). wandb and
  other trackers never start: the trainers pass `report_to=[]`.
HF_HUB_OFFLINE is left alone: a model id or alias (`--src qwen3-1.7b`, a recipe's `teacher:`) is a
download the user asked for. A variable the user set wins (`HF_DATASETS_OFFLINE=0` re-allows the hub).
The libraries read these variables when imported, so constants of modules already imported are set too.
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from hybridize.distill.config import find_recipe
from hybridize.eval import math as eval_math
from hybridize.eval.common import data_file
from hybridize.rl import data as rl_data

TELEMETRY_OFF = {"HF_HUB_DISABLE_TELEMETRY": "1", "HF_UPDATE_DOWNLOAD_COUNTS": "0"}
DATASETS_OFFLINE = {"HF_DATASETS_OFFLINE": "1"}
# owner/name of a hub repo, then an optional @config and :split or :config (the loaders' spellings)
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
_FILE_SUFFIXES = (".jsonl", ".json", ".txt", ".parquet", ".csv", ".yaml", ".yml", ".gguf", ".safetensors")
_TRUE = ("1", "true", "yes", "on")


def configure(args: list[str]) -> dict[str, str]:
    """Set the opt-outs for a run of `hybridize <args>`; returns the variables this call set."""
    wanted = dict(TELEMETRY_OFF)
    if not asks_for_hub_data(args):
        wanted.update(DATASETS_OFFLINE)
    set_now = {k: v for k, v in wanted.items() if k not in os.environ}
    os.environ.update(set_now)
    _sync_loaded_modules()
    return set_now


def asks_for_hub_data(args: list[str]) -> bool:
    """Whether any input argument (or a value in the recipe it names) can only be read from the hub."""
    return any(names_hub_data(v) for v in argument_values(args))


def names_hub_data(value: str) -> bool:
    """`owner/name[@config][:split]` that is not a local path, or a built-in set with no local copy."""
    value = value.strip().strip("'\"")
    name = re.split(r"[@:]", value, maxsplit=1)[0]
    if _HUB_ID.fullmatch(name) and not name.endswith(_FILE_SUFFIXES) and not Path(name).expanduser().exists():
        return True
    return _builtin_needs_hub(value)


def argument_values(args: list[str]) -> list[str]:
    """Input values on a command line: `key=value` / `--opt=value` right sides and list items, the next
    token after an option, and the recipe's strings; outputs (`run_dir=runs/x`, `--out`) are not inputs."""
    out: list[str] = []
    for i, arg in enumerate(args):
        key, value = arg.split("=", 1) if "=" in arg else (args[i - 1] if i else "", arg)
        if key in ("-r", "--recipe"):  # a recipe name looks like owner/name: read the recipe instead
            out += _recipe_strings(value)
        elif not _is_output(key):
            out += [v for v in value.strip("[]").split(",") if v]
    return out


def _is_output(key: str) -> bool:
    return key in ("-o", "--out", "--output-dir") or key.rsplit(".", 1)[-1] in ("run_dir", "output_dir", "out")


def _recipe_strings(name: str) -> list[str]:
    """Every input string (and list item) in a recipe YAML; nothing when it does not resolve (the command says so)."""
    try:
        import yaml

        data = yaml.safe_load(find_recipe(name).read_text(encoding="utf-8"))
    except Exception:
        return []
    found: list[str] = []

    def walk(x, key: str = "") -> None:
        if isinstance(x, dict):
            for k, v in x.items():
                walk(v, str(k))
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v, key)
        elif isinstance(x, str) and not _is_output(key):
            found.append(x)

    walk(data)
    return found


def _builtin_needs_hub(value: str) -> bool:
    """A built-in prompt / evaluation set (`gsm8k`, `math500`, ...) whose local copy is missing but that
    has a hub fallback: naming it asks for the hub, as before."""
    key = value.lower()
    sources = []
    rl_key = rl_data._ALIASES.get(key, key)
    if rl_key in rl_data.TRAIN_SETS:
        rel, hub, *_ = rl_data.TRAIN_SETS[rl_key]
        sources.append((rel, hub))
    eval_key = eval_math._ALIASES.get(key, key)
    if eval_key in eval_math.DATASETS:
        spec = eval_math.DATASETS[eval_key]
        sources.append((spec.local, spec.hub))
    return any(hub and data_file(rel) is None for rel, hub in sources)


def _sync_loaded_modules() -> None:
    """Give modules imported before `configure` the values they would have read from the environment."""
    env = os.environ
    if "huggingface_hub.constants" in sys.modules:
        constants = sys.modules["huggingface_hub.constants"]
        if env.get("HF_HUB_DISABLE_TELEMETRY", "").lower() in _TRUE:
            constants.HF_HUB_DISABLE_TELEMETRY = True
    if "datasets.config" in sys.modules:
        config = sys.modules["datasets.config"]
        if env.get("HF_UPDATE_DOWNLOAD_COUNTS", "").lower() in ("0", "false", "no", "off"):
            config.HF_UPDATE_DOWNLOAD_COUNTS = False
        if env.get("HF_DATASETS_OFFLINE", "").lower() in _TRUE:
            config.HF_HUB_OFFLINE = config.HF_DATASETS_OFFLINE = True
