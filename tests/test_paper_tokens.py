"""The paper-exact token stream, checked against the official release's own outputs.

The oracle is ``tests/fixtures/official/`` (or the fixture set LOOPSCALE_OFFICIAL_FIXTURES
names, see tests/official.py): the official ``build_dataset()`` id streams (``token_ids/``),
the official tokenizer state and its probe strings, and the checkpoints the official trainer
wrote (every ``*/last.pt`` found there); vocabulary size, count floor and ``<unk>`` id are read
from them. No network.
"""
import os

os.environ["HF_DATASETS_OFFLINE"] = "1"  # before anything imports datasets

import json
import random
import re
from pathlib import Path

import pytest
import torch

from loopscale import data as D
from loopscale.data import DataError
from official import CHECKPOINTS, OFFICIAL, VISIBLE, checkpoint_config

TOKEN_IDS = OFFICIAL / "token_ids"
SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")  # the official RegexTokenizer's, first in its itos


def _json(path: Path):
    return json.loads(path.read_text(encoding="utf-8"))


def _rows(split: str) -> list[str]:
    """The official loader's rows of a split: the corpus rows minus the "" rows."""
    return [r for r in _json(OFFICIAL / "corpus" / "rows" / f"{split}.json") if r]


@pytest.fixture(scope="module")
def official_state() -> dict:
    return _json(TOKEN_IDS / "tokenizer.json")


@pytest.fixture(scope="module")
def official_tok(official_state):
    return D.paper_tokenizer(official_state["itos"], official_state["pattern"])


def _unk(root: Path = OFFICIAL) -> int:
    """The official <unk> id (its place in the fixture tokenizer's itos)."""
    return _json(root / "token_ids" / "tokenizer.json")["itos"].index("<unk>")


def _data_config(root: Path = OFFICIAL) -> dict:
    """The `data` section the official build_dataset() ran with (every checkpoint's config)."""
    ckpts = sorted(root.glob("*/last.pt"))
    (data,) = {json.dumps(checkpoint_config(c.parent)["data"], sort_keys=True) for c in ckpts}
    return json.loads(data)


def _pieces(pre_tokenizer, text: str) -> list[str]:
    return [p for p, _ in pre_tokenizer.pre_tokenize_str(text)]


# ---------------------------------------------------------------- the pre-tokenizer = re.findall
ALL_CHARS = [chr(c) for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF]


def test_paper_pre_tokenizer_equals_re_findall_on_every_code_point():
    """Every character Python can hold, each followed by an ASCII letter, a space or nothing
    in turn: the pieces equal re.findall's (non-ASCII letters/digits dropped, Python's \\s)."""
    pt, regex = D.paper_pre_tokenizer(), re.compile(D.WORD_PATTERN)
    seps = ("a", " ", "")
    text = "".join(c + seps[i % 3] for i, c in enumerate(ALL_CHARS))
    assert _pieces(pt, text) == regex.findall(text)


@pytest.mark.slow
@pytest.mark.parametrize("sep", ["", "a", " ", "\u00e9"])
def test_paper_pre_tokenizer_equals_re_findall_on_every_code_point_between(sep):
    """The same for every code point between the same separator: runs, letters, spaces."""
    text = sep.join(ALL_CHARS)
    assert _pieces(D.paper_pre_tokenizer(), text) == re.findall(D.WORD_PATTERN, text)


@pytest.mark.parametrize("text, pieces", [
    ("caf\u00e9", ["caf"]),
    ("Z\u00fcrich", ["Z", "rich"]),  # a skipped character ends the run it sits in
    ("a \u6771\u4eac b", ["a", " ", " ", "b"]),  # so are whitespace runs either side of it
    ("e\u0301t\u00e9", ["e", "\u0301", "t"]),  # a combining mark is not \w in Python: a piece
    ("x\u00b2 \u00bd \u0663", ["x", " ", " "]),  # superscript two, one half, Arabic-Indic 3: \w
    ("a\x0b\x1c\x1d\x85\xa0\u3000b", ["a", "\x0b\x1c\x1d\x85\xa0\u3000", "b"]),  # Python's \s
    ("snake_case __x", ["snake_case", " ", "__x"]),
    ("<unk> <pad>", ["<", "unk", ">", " ", "<", "pad", ">"]),
    ("\u20ac 4 @.@ 50 \u2013", ["\u20ac", " ", "4", " ", "@", ".", "@", " ", "50", " ", "\u2013"]),
])
def test_paper_pre_tokenizer_hard_cases(text, pieces):
    assert re.findall(D.WORD_PATTERN, text) == pieces  # the case is stated right
    assert _pieces(D.paper_pre_tokenizer(), text) == pieces


def test_paper_pre_tokenizer_random_mixtures():
    pt, regex = D.paper_pre_tokenizer(), re.compile(D.WORD_PATTERN)
    rng = random.Random(0)
    pool = [chr(c) for c in range(0x250)] + list(" \n\t\x0b\x1c\x85\xa0\u2028\u3000_aZ9\u00e9\u0301\u00b2\u6771\u20ac")
    for _ in range(200):
        text = "".join(rng.choice(pool) for _ in range(200))
        assert _pieces(pt, text) == regex.findall(text), repr(text)


# ---------------------------------------------------------------- paper_tokenizer
def test_paper_tokenizer_probes_equal_the_official_tokenizer(official_tok):
    probe = _json(TOKEN_IDS / "tokenizer_probe.json")
    assert probe["probes"]
    for p in probe["probes"]:
        assert _pieces(official_tok.pre_tokenizer, p["text"]) == p["pieces"], p["text"]
        assert official_tok.encode(p["text"]).ids == p["ids"], p["text"]
        assert official_tok.decode(p["ids"]) == p["decoded"], p["text"]
    rows = probe["first_train_rows"]
    assert official_tok.encode("\n\n".join(rows)).ids[:len(probe["first_train_ids"])] == probe["first_train_ids"]


def test_paper_tokenizer_specials_are_plain_vocabulary(official_tok):
    vocab, itos = official_tok.get_vocab(), _json(TOKEN_IDS / "tokenizer.json")["itos"]
    assert itos[:len(SPECIALS)] == list(SPECIALS)
    assert [vocab[s] for s in SPECIALS] == [itos.index(s) for s in SPECIALS]
    assert official_tok.get_added_tokens_decoder() == {}
    assert official_tok.encode("<unk>").ids == [official_tok.token_to_id(p) or _unk() for p in ("<", "unk", ">")]


def test_paper_tokenizer_survives_a_json_round_trip(official_tok, official_state):
    from tokenizers import Tokenizer
    text = "\n\n".join(_rows("validation"))
    again = Tokenizer.from_str(official_tok.to_str())
    assert again.encode(text).ids == official_tok.encode(text).ids
    assert [t for t, _ in sorted(again.get_vocab().items(), key=lambda kv: kv[1])] == official_state["itos"]


@pytest.mark.parametrize("ckpt", CHECKPOINTS, ids=lambda p: p.parent.name)
def test_paper_tokenizer_from_every_checkpoint_encodes_the_official_validation_stream(ckpt):
    state = torch.load(ckpt, map_location="cpu", weights_only=True)["tokenizer"]
    assert state["kind"] == "regex"
    tok = D.paper_tokenizer(state["itos"], state["pattern"])
    ids = D.encode_text(tok, "\n\n".join(_rows("validation"))).tolist()
    assert ids == _json(TOKEN_IDS / "validation_ids.json")


def test_fixture_checkpoints_are_found():
    assert len(CHECKPOINTS) >= 1


@pytest.mark.parametrize("itos, pattern, match", [
    (["<pad>", "<bos>", "<eos>", "<unk>", "a"], r"\w+|\s+", "cannot be reproduced"),
    (["<bos>", "<pad>", "<eos>", "<unk>", "a"], D.WORD_PATTERN, "must start with"),
    (["<pad>", "<bos>", "<eos>", "<unk>", "a", "a"], D.WORD_PATTERN, "twice"),
    (["<pad>", "<bos>", "<eos>", "<unk>", 5], D.WORD_PATTERN, "list of strings"),
    ("<pad><bos>", D.WORD_PATTERN, "list of strings"),
])
def test_paper_tokenizer_refuses_what_it_cannot_reproduce(itos, pattern, match):
    with pytest.raises(DataError, match=match) as e:
        D.paper_tokenizer(itos, pattern)
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------- the paper's stream, end to end
def _official_stream(fit_rows: list[str], rows: list[str], vocab_size: int, min_frequency: int) -> list[int]:
    """A plain restatement of the official algorithm (RegexTokenizer.from_texts + encode of the
    "\\n\\n"-joined rows), written for this test with Python's re and a Counter."""
    from collections import Counter
    counts = Counter(p for r in fit_rows for p in re.findall(D.WORD_PATTERN, r))
    specials = list(SPECIALS)
    kept = sorted((t for t, c in counts.items() if c >= min_frequency), key=lambda t: (-counts[t], t))
    stoi = {t: i for i, t in enumerate(specials + kept[:vocab_size - len(specials)])}
    return [stoi.get(p, stoi["<unk>"]) for p in re.findall(D.WORD_PATTERN, "\n\n".join(rows))]


def _bin(data_dir: Path, split: str) -> list[int]:
    return D.load_split(data_dir, split).tolist()


def _fixture_cfg(layout: str, root: Path = OFFICIAL, **kw):
    """The fixture corpus with the official config's vocabulary cap and count floor."""
    from loopscale.config import DataConfig
    corpus = root / "corpus"
    if layout == "hf":
        kw = {"source": "wikitext-103", "hf_dataset": str(corpus / "hf"), **kw}
    else:
        kw.update(source="text-files", train_file=str(corpus / "train.txt"),
                  validation_file=str(corpus / "validation.txt"), test_file=str(corpus / "test.txt"))
    data = _data_config(root)
    return DataConfig(vocab_size=data["max_vocab_size"], min_frequency=data["min_token_freq"],
                      tokenization="paper", **kw)


@pytest.mark.parametrize("layout", ["hf", "txt"])
def test_prepare_data_writes_the_official_streams(layout, tmp_path, official_state):
    """prepare-data in the paper mode, from the parquet folder (datasets.load_dataset on a local
    Salesforce/wikitext-layout folder) and from the one-row-per-line text files: the token
    files equal the official build_dataset() streams id for id, the vocabulary its itos. (The
    text files' whitespace-only row is left out; its piece "   \\n" is below the vocabulary
    cut and the boundary around it one <unk> either way, so the streams agree.)"""
    out = tmp_path / "data"
    meta = D.prepare_data(_fixture_cfg(layout), out, show_progress=False)
    for split in ("train", "validation"):
        assert _bin(out, split) == _json(TOKEN_IDS / f"{split}_ids.json"), split
    tok = D.load_tokenizer(out)
    assert [t for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])] == official_state["itos"]
    assert meta["tokenization"] == "paper"
    # the counts meta.json records, from the official streams and the official pieces
    for split in ("train", "validation"):
        ids, rows = _json(TOKEN_IDS / f"{split}_ids.json"), _rows(split)
        if layout == "txt":  # a text file's whitespace-only line is no row (the Hub's WikiText rule)
            rows = [r for r in rows if r.strip()]
        stats = meta["stats"][split]
        assert stats["tokens"] == len(ids) and stats["unk"] == ids.count(_unk())
        assert stats["rows"] == len(rows) and stats["words"] == sum(len(r.split()) for r in rows)
        joined = re.findall(D.WORD_PATTERN, "\n\n".join(rows))
        itos = set(official_state["itos"])
        assert stats["boundary_unk"] == sum(1 for p in joined if "\n\n" in p and p not in itos) > 0
        assert stats["tokens_per_word"] == pytest.approx(len(ids) / stats["words"], abs=1e-6)


def test_local_hf_folders_of_the_same_name_are_not_confused(tmp_path):
    """Two local folders both called hf with the same card: each gives its own rows (datasets'
    shared cache would hand the second the first one's rows)."""
    pq = pytest.importorskip("pyarrow.parquet")
    import shutil
    other = tmp_path / "other" / "hf"
    shutil.copytree(OFFICIAL / "corpus" / "hf", other)
    part = other / "wikitext-103-raw-v1" / "validation-00000-of-00001.parquet"
    table = pq.read_table(part)
    pq.write_table(table.slice(0, 5), part)
    first = D.load_corpus(_fixture_cfg("hf"))
    second = D.load_corpus(_fixture_cfg("hf", hf_dataset=str(other)))
    assert first["validation"] == _rows("validation")
    assert second["validation"] == [r for r in table.column("text").to_pylist()[:5] if r]
    assert second["train"] == first["train"]


def test_paper_mode_on_text_files_hard_cases(tmp_path):
    """Non-ASCII letters dropped, Python-only whitespace, a literal <unk>, CRLF and
    whitespace-only lines (left out, as the Hub's WikiText rows leave them out)."""
    from loopscale.config import DataConfig
    train = (" = Caf\u00e9 Z\u00fcrich = \r\n \r\n The caf\u00e9 is in Z\u00fcrich , near \u6771\u4eac . \n"
             "   \n a\x0bb\x1cc\x85d \u00e9\u0301 <unk> don 't \n\n The caf\u00e9 . \n")
    valid = " The caf\u00e9 is near Z\u00fcrich . \n \n a <unk> b"
    (tmp_path / "t.txt").write_text(train, encoding="utf-8", newline="")
    (tmp_path / "v.txt").write_text(valid, encoding="utf-8", newline="")
    cfg = DataConfig(source="text-files", train_file=str(tmp_path / "t.txt"), validation_file=str(tmp_path / "v.txt"),
                     vocab_size=40, min_frequency=1)
    assert cfg.tokenization == "paper"  # the default
    corpus = D.load_corpus(cfg)
    assert corpus["train"] == [" = Caf\u00e9 Z\u00fcrich = \n", " The caf\u00e9 is in Z\u00fcrich , near \u6771\u4eac . \n",
                               " a\x0bb\x1cc\x85d \u00e9\u0301 <unk> don 't \n", " The caf\u00e9 . \n"]
    assert corpus["validation"] == [" The caf\u00e9 is near Z\u00fcrich . \n", " a <unk> b"]
    D.prepare_data(cfg, tmp_path / "d", show_progress=False)
    fit = corpus["train"] + corpus["validation"]
    for split in ("train", "validation"):
        assert _bin(tmp_path / "d", split) == _official_stream(fit, corpus[split], 40, 1)


def test_paper_mode_on_the_builtin_corpus(tmp_path):
    """The speeches' non-blank lines are the rows; max_documents counts speeches; the stream is
    the official algorithm's, every paragraph boundary an <unk>."""
    from loopscale.config import DataConfig
    cfg = DataConfig(max_documents=2, vocab_size=300, min_frequency=2)
    speeches = D.load_corpus(DataConfig(max_documents=2, tokenization="joined"))
    corpus = D.load_corpus(cfg)
    for split in ("train", "validation"):
        assert len(speeches[split]) == 2
        # the same lines as the joined rule keeps, each with its own "\n" (a file's last line may lack one)
        assert [r.rstrip("\n") for r in corpus[split]] == [line for doc in speeches[split] for line in doc.split("\n\n")]
        assert sum(not r.endswith("\n") for r in corpus[split]) <= len(speeches[split])  # a speech's last line
        assert all(r.strip() and "\n" not in r[:-1] for r in corpus[split])
    meta = D.prepare_data(cfg, tmp_path / "d", show_progress=False)
    fit = corpus["train"] + corpus["validation"]
    for split in ("train", "validation"):
        assert _bin(tmp_path / "d", split) == _official_stream(fit, corpus[split], 300, 2)
        assert meta["stats"][split]["boundary_unk"] == len(corpus[split]) - 1


# ---------------------------------------------------------------- settings and errors
@pytest.mark.parametrize("overrides, match", [
    ({"tokenization": "official"}, r"data\.tokenization: unknown value 'official'; choose one of paper, joined"),
    ({"tokenizer": "bpe"}, r"data\.tokenization=paper .* set data\.tokenization=joined"),
    ({"hf_dataset": "corpus/hf"}, r"data\.hf_dataset .* needs data\.source=wikitext-103"),
])
def test_data_settings_are_validated(overrides, match):
    from loopscale.config import ConfigError, preset
    with pytest.raises(ConfigError, match=match) as e:
        preset("smoke", {"data": overrides})
    assert "\n" not in str(e.value)


def test_presets_use_the_paper_stream():
    from loopscale.config import MODEL_PRESETS, preset
    # the paper stream everywhere the tokenizer is the paper's word-level one; a BPE tokenizer
    # (the Ouro track's presets) needs the joined rule
    assert {name: preset(name).data.tokenization for name in MODEL_PRESETS} == \
        {name: "joined" if preset(name).data.tokenizer == "bpe" else "paper" for name in MODEL_PRESETS}
    assert "paper" in {preset(name).data.tokenization for name in MODEL_PRESETS if name.startswith("paper")}
    assert preset("smoke", {"data": {"tokenization": "joined"}}).data.tokenization == "joined"


def test_cli_refuses_a_missing_hf_folder_in_one_line(tmp_path, capsys):
    from loopscale import cli
    rc = cli.main(["prepare-data", "--preset", "smoke", "--set", "data.source=wikitext-103",
                   "--set", f"data.hf_dataset={tmp_path / 'nowhere'}", "--out", str(tmp_path / "d")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "data.hf_dataset: folder not found" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "d").exists()


# ---------------------------------------------------------------- token counts and steps
def _official_steps(n_tokens: int, seq_len: int, stride: int, batch: int, epochs: int) -> int:
    """The official trainer: TextChunkDataset starts, a DataLoader without drop_last."""
    starts = range(0, max(1, n_tokens - seq_len - 1 + 1), stride)
    return -(-len(starts) // batch) * epochs


@pytest.mark.parametrize("n", [300, 257, 258, 10_000, 103_000_000, 211_000_000])
def test_train_steps_counts_the_official_windows(n):
    for seq, stride, batch, epochs in ((256, 128, 64, 4), (256, 128, 32, 4), (32, 16, 16, 1)):
        steps = D.train_steps(n, seq, stride, batch, epochs)
        assert steps["official"] == _official_steps(n, seq, stride, batch, epochs)
        assert steps["windows"] == len(D.train_window_starts(n, seq, stride)) if n > seq else True
        assert steps["loopscale"] == max(1, epochs * (steps["windows"] // batch))


def test_data_stats_cli(tmp_path, capsys):
    from loopscale import cli
    out = tmp_path / "data"
    D.prepare_data(_fixture_cfg("txt"), out, show_progress=False)
    capsys.readouterr()
    rc = cli.main(["data-stats", "--data", str(out), "--preset", "smoke", "--out", str(tmp_path / "s.json")])
    printed = json.loads(capsys.readouterr().out)
    assert rc == 0 and printed == _json(tmp_path / "s.json")
    n = len(_json(TOKEN_IDS / "train_ids.json"))
    assert printed["paper_steps"]["44m"]["official"] == _official_steps(n, 256, 128, 64, 4)
    assert printed["paper_steps"]["129m"]["official"] == _official_steps(n, 256, 128, 32, 4)
    assert printed["run_steps"]["loopscale"] == 30  # the smoke preset's train.max_steps
    assert printed["splits"]["validation"]["unk"] == _json(TOKEN_IDS / "validation_ids.json").count(_unk())
    # a directory prepared before the statistics existed: one line, exit 2
    meta = _json(out / "meta.json")
    del meta["stats"]
    (out / "meta.json").write_text(json.dumps(meta))
    assert cli.main(["data-stats", "--data", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "no token statistics" in err and len(err.splitlines()) == 1


def test_committed_token_counts_match_the_official_streams():
    """benchmarks/token-counts.json (benchmarks/token_counts.py): its fixture-corpus figures in
    the paper mode are the official streams' own counts, and its steps follow from them. The
    record measures this repository's copy, tests/fixtures/official, whichever set the other
    tests are pointed at."""
    record = _json(Path(__file__).parents[1] / "benchmarks" / "token-counts.json")
    paper = record["official-fixture"]["paper"]
    assert paper["vocab_size"] == _data_config(VISIBLE)["max_vocab_size"]
    for split in ("train", "validation"):
        ids = _json(VISIBLE / "token_ids" / f"{split}_ids.json")
        assert paper["splits"][split]["tokens"] == len(ids) and paper["splits"][split]["unk"] == ids.count(_unk(VISIBLE))
    n = paper["splits"]["train"]["tokens"]
    assert paper["paper_steps"]["44m"]["official"] == _official_steps(n, 256, 128, 64, 4)
    projected = record["wikitext-103-projection"]
    assert projected["projection"] is True
    assert projected["paper_steps"]["44m"]["official"] == _official_steps(projected["tokens"], 256, 128, 64, 4)


def test_prepare_data_with_a_checkpoints_tokenizer_writes_the_official_streams(tmp_path, capsys):
    """The converter's path: the tokenizer of an official checkpoint, saved as tokenizer.json and
    given to `loopscale prepare-data --tokenizer`, encodes the corpus to the official streams."""
    from loopscale import cli
    state = torch.load(CHECKPOINTS[0], map_location="cpu", weights_only=True)["tokenizer"]
    path = tmp_path / "tokenizer.json"
    D.paper_tokenizer(state["itos"], state["pattern"]).save(str(path))
    corpus = OFFICIAL / "corpus"
    rc = cli.main(["prepare-data", "--preset", "smoke", "--set", "data.source=text-files",
                   "--set", f"data.train_file={corpus / 'train.txt'}",
                   "--set", f"data.validation_file={corpus / 'validation.txt'}",
                   "--tokenizer", str(path), "--out", str(tmp_path / "d")])
    assert rc == 0, capsys.readouterr().err
    for split in ("train", "validation"):
        assert _bin(tmp_path / "d", split) == _json(TOKEN_IDS / f"{split}_ids.json")
