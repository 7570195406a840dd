"""The paper-exact token stream, checked against the official release's own outputs.

The oracle is ``tests/fixtures/official/``: the official ``build_dataset()`` id streams
(``token_ids/``), the official tokenizer state and its probe strings, and the checkpoints the
official trainer wrote (every ``*/last.pt`` found there). No network.
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

OFFICIAL = Path(__file__).parent / "fixtures" / "official"
TOKEN_IDS = OFFICIAL / "token_ids"
CHECKPOINTS = sorted(OFFICIAL.glob("*/last.pt"))


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
    vocab = official_tok.get_vocab()
    assert [vocab[s] for s in ("<pad>", "<bos>", "<eos>", "<unk>")] == [0, 1, 2, 3]
    assert official_tok.get_added_tokens_decoder() == {}
    assert official_tok.encode("<unk>").ids == [official_tok.token_to_id(p) or 3 for p in ("<", "unk", ">")]


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
