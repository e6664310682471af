"""The long-context stage (issue 22, part 3): whole articles as documents, several sources in one mix, the
recipe's schedule reaching the default's 8k context, and a tiny run of `distill e2e -r smollm2-135m/long`."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from hybridize.distill.config import E2EConfig, load_config
from hybridize.distill.data import load_texts, shared_data, wikitext_articles
from hybridize.errors import UserError

from .test_cli import app  # noqa: F401  (the fixture)
from .helpers import tiny_llama

WIKITEXT = (" \n = Alpha = \n \n Alpha text one . \n \n = = History = = \n \n Alpha history . \n"
            " \n = Beta = \n \n Beta text . \n \n = = = Sub = = = \n \n Beta sub . \n")


def test_wikitext_articles_split_at_titles_not_sections():
    arts = wikitext_articles(WIKITEXT)
    assert [a.split("\n")[0] for a in arts] == [" = Alpha = ", " = Beta = "]
    assert "Alpha history" in arts[0] and "Beta sub" in arts[1] and "Beta" not in arts[0]


def test_txt_document_modes_and_source_lists(tmp_path):
    txt = tmp_path / "wiki.txt"
    txt.write_text(WIKITEXT)
    js = tmp_path / "more.jsonl"
    js.write_text("\n".join(json.dumps({"text": f"doc {i}"}) for i in range(3)) + "\n")
    by_line = load_texts(str(txt))
    assert len(by_line) > 4 and all("\n" not in t for t in by_line)
    assert load_texts(str(txt), txt_document="file") == [WIKITEXT]
    para = tmp_path / "para.txt"
    para.write_text("one a\ntwo a\n\nthree b\n\nfour c\n")
    assert load_texts(str(para), txt_document="paragraph") == ["one a\ntwo a", "three b", "four c\n"]
    both = load_texts([str(txt), str(js)], txt_document="wikitext")
    assert len(both) == 5 and both[0].startswith(" = Alpha = ") and both[2:] == ["doc 0", "doc 1", "doc 2"]
    with pytest.raises(UserError, match="txt_document"):
        load_texts(str(txt), txt_document="chapter")
    with pytest.raises(UserError, match="empty list"):
        load_texts([])


def test_long_recipe_reaches_the_default_context_on_whole_articles():
    c = load_config(E2EConfig, "smollm2-135m/long", [])
    assert c.data.seq_len_schedule[-1][1] == 8192 and c.data.seq_len_schedule[0] == [0, 2048]
    assert c.data.txt_document == "wikitext" and isinstance(c.data.train, list)
    assert c.data.eval == "python-reference"  # held out: in no training mix
    assert not any("test" in s or "haystack" in s for s in c.data.train)  # evaluation text stays out
    assert c.data.batch_tokens >= 8192  # one full-length row per micro-batch at least


def test_long_recipe_sources_are_long_articles():
    if shared_data("general_text") is None or shared_data("wikitext2") is None:
        pytest.skip("../shared/data (general_text, wikitext2) is not here")
    c = load_config(E2EConfig, "smollm2-135m/long", [])
    texts = load_texts([str(shared_data(s.split("data/", 1)[1])) for s in c.data.train], txt_document="wikitext")
    assert 80 <= len(texts) <= 100  # 30 wiki_demo articles + 60 wikitext-2 valid articles
    assert sorted(len(t) for t in texts)[len(texts) // 2] > 10_000  # median over 10k characters (~2.5k tokens)


def test_tiny_run_of_the_long_recipe_packs_articles(app, tmp_path):  # noqa: F811
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from hybridize.convert.convert import convert_model

    vocab = {w: i for i, w in enumerate(["<pad>", "<eos>", "=", ".", "[UNK]"] + [f"w{i}" for i in range(80)])}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", pad_token="<pad>")
    teacher = tiny_llama(0)
    teacher.save_pretrained(tmp_path / "teacher")
    convert_model(teacher, "2:1", mixer="sse").save_pretrained(tmp_path / "student")
    for d in ("teacher", "student"):
        fast.save_pretrained(tmp_path / d)
    txt = tmp_path / "articles.txt"
    txt.write_text("".join(f" \n = w{a} = \n \n " + " ".join(f"w{(a * 13 + j) % 80}" for j in range(40 + 9 * a))
                           + " . \n" for a in range(12)))
    r = CliRunner().invoke(app, [
        "distill", "e2e", "-r", "smollm2-135m/long", f"student={tmp_path / 'student'}",
        f"teacher={tmp_path / 'teacher'}", f"train.run_dir={tmp_path / 'long'}", f"data.train=[{txt}]",
        "data.eval=", "data.seq_len_schedule=[[0,32],[2,64]]", "data.batch_tokens=128", "train.max_steps=3",
        "train.mixed_precision=no", "train.progress=false", "train.save_every=0"])
    assert r.exit_code == 0, r.output + repr(r.exception)
    lines = [json.loads(x) for x in (tmp_path / "long" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines if "step" in m] == [1, 2, 3]
    assert (tmp_path / "long" / "final" / "config.json").is_file()
