"""A converted checkpoint loads in tools that never `import hybridize` (lm-eval `--model hf`, TRL scripts):
config.json carries an `auto_map` naming `modeling_hybridize.py`, saved beside the weights, so
`AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)` works in a fresh process (issue 29).

Each check runs a fresh Python (no hybridize imported before the load), with its own transformers
module cache so nothing is left in ~/.cache."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import AutoModelForCausalLM

from hybridize.convert.convert import convert_model
from hybridize.modeling import AUTO_MAP, REMOTE_CODE_FILE

from .convert.common import perturb_new_parameters, tiny_teacher

IDS = [[5, 17, 33, 8, 61, 42, 9, 70, 12, 3, 88, 24]]

# a fresh process: load through the Auto classes only, then record what happened
LOAD = textwrap.dedent("""
    import json, sys
    import torch
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM
    d, out = sys.argv[1], sys.argv[2]
    report = {"imported_before": "hybridize" in sys.modules}
    try:
        AutoModelForCausalLM.from_pretrained(d)
        report["plain"] = "loaded"
    except Exception as e:
        report["plain"] = f"{type(e).__name__}: {e}"
    model = AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True).eval()
    report["class"] = type(model).__module__ + "." + type(model).__name__
    with torch.no_grad():
        torch.save(model(torch.tensor({ids})).logits, out + "/logits.pt")
    model.save_pretrained(out + "/resaved")
    json.dump(report, open(out + "/report.json", "w"))
""").replace("{ids}", repr(IDS))

# a fresh process in which `import hybridize` fails as if it were not installed
NOT_INSTALLED = textwrap.dedent("""
    import sys

    class NoHybridize:
        def find_spec(self, name, path=None, target=None):
            if name == "hybridize" or name.startswith("hybridize."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    sys.meta_path.insert(0, NoHybridize())
    from transformers import AutoModelForCausalLM
    try:
        AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)
    except ImportError as e:
        print("IMPORT-ERROR", e)
""")


def _run(script: str, *args, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_MODULES_CACHE": str(cwd / "hf_modules"), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-c", script, *map(str, args)], cwd=cwd, env=env, text=True,
                          capture_output=True, stdin=subprocess.DEVNULL, timeout=600)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny converted Llama (SSE every other layer, mixer parameters perturbed) and its logits `[1, T, V]`."""
    d = tmp_path_factory.mktemp("ckpt")
    hybrid = convert_model(tiny_teacher("llama"), "2:1", mixer="sse").eval()
    perturb_new_parameters(hybrid)
    hybrid.save_pretrained(d / "model")
    with torch.no_grad():
        logits = hybrid(torch.tensor(IDS)).logits
    return d / "model", logits


def test_saved_config_names_the_module_saved_beside_it(checkpoint):
    d, _ = checkpoint
    assert json.loads((d / "config.json").read_text())["auto_map"] == AUTO_MAP
    assert "from hybridize.modeling import" in (d / REMOTE_CODE_FILE).read_text()
    # in a process that imported hybridize the auto_map changes nothing: the local classes load it
    assert type(AutoModelForCausalLM.from_pretrained(d)).__module__ == "hybridize.modeling"


def test_fresh_process_loads_with_trust_remote_code_and_matches(checkpoint, tmp_path):
    d, logits = checkpoint
    r = _run(LOAD, d, tmp_path, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["imported_before"] is False
    assert report["class"] == "hybridize.modeling.HybridForCausalLM"
    # without trust_remote_code: transformers' own line asking for it, not "does not recognize this architecture"
    assert "trust_remote_code" in report["plain"] and "does not recognize" not in report["plain"]
    assert torch.equal(torch.load(tmp_path / "logits.pt", weights_only=True), logits)
    # saving the loaded model again keeps the route (no copy of hybridize/modeling.py, same auto_map)
    resaved = tmp_path / "resaved"
    assert json.loads((resaved / "config.json").read_text())["auto_map"] == AUTO_MAP
    assert (resaved / REMOTE_CODE_FILE).is_file() and not (resaved / "modeling.py").exists()


def test_without_hybridize_installed_the_error_says_pip_install(checkpoint, tmp_path):
    d, _ = checkpoint
    r = _run(NOT_INSTALLED, d, cwd=tmp_path)
    assert "IMPORT-ERROR" in r.stdout, r.stdout + r.stderr[-3000:]
    assert "pip install hybridize" in r.stdout
