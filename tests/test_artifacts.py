"""A finished run is a self-contained artifact: safetensors, tokenizer files, load, export, generate."""
import json
import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer

import loopscale
from loopscale import cli
from loopscale.artifacts import load
from loopscale.cli import main
from loopscale.io import CheckpointError, load_checkpoint

ARTIFACT_FILES = ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@pytest.fixture(scope="module")
def run(smoke_run, tmp_path_factory):
    """The session's smoke run (conftest.py), copied: test_export_* delete and rewrite its files."""
    return shutil.copytree(smoke_run, tmp_path_factory.mktemp("artifact-run") / "run")


def test_training_writes_the_artifact_and_load_gives_the_same_logits(run):
    for name in ARTIFACT_FILES + ("model.pt", "config.json", "loopscale.json", "modeling_loopscale.py"):
        assert (run / name).is_file(), name
    model, tok, cfg = loopscale.load(run)
    ref, _, _ = loopscale.load(run / "model.pt")
    idx = torch.tensor([tok.encode("The state of the Union is strong.").ids])
    with torch.no_grad():
        for k, (a, b) in enumerate(zip(model(idx, n_loops=5), ref(idx, n_loops=5))):
            torch.testing.assert_close(model.logits(a, k == 4), ref.logits(b, k == 4), rtol=0, atol=0)
    assert cfg.model == ref.cfg and not model.training


def test_safetensors_stores_the_tied_head_once(run):
    model, _, _ = loopscale.load(run)
    with safe_open(str(run / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        meta = f.metadata()
        assert set(meta) == {"format", "weights_sha256", "config_fingerprint"} and meta["format"] == "pt"
        assert sum(f.get_tensor(k).numel() for k in keys) == model.num_params()
    assert keys == set(model.state_dict()) and "tok_emb.weight" in keys
    assert not any("head" in k for k in keys)


def test_tokenizer_files_carry_the_special_tokens(run, smoke_data):
    assert (run / "tokenizer.json").read_bytes() == (smoke_data / "tokenizer.json").read_bytes()
    tok = Tokenizer.from_file(str(run / "tokenizer.json"))
    text = "We the people, in order to form a more perfect Union."
    ids = tok.encode(text).ids
    assert ids[:4] == [tok.token_to_id(w) for w in ("We", " ", "the", " ")]
    if tok.get_added_tokens_decoder():  # data.tokenization=joined: literal specials encode to their ids
        assert tok.encode(tok.decode(ids, skip_special_tokens=False)).ids == ids  # <unk>s included
    else:  # paper: the specials are plain vocabulary, and decoding drops them as the official decode does
        assert 3 in ids and tok.decode(ids) == "".join(tok.id_to_token(i) for i in ids if i > 3)
    conf = json.loads((run / "tokenizer_config.json").read_text())
    special = json.loads((run / "special_tokens_map.json").read_text())
    roles = {"pad_token": "<pad>", "bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>"}
    assert special == roles
    assert conf["tokenizer_class"] == "PreTrainedTokenizerFast" and conf["model_max_length"] == 32
    assert {k: conf[k] for k in roles} == roles
    for i, name in enumerate(("<pad>", "<bos>", "<eos>", "<unk>")):  # ids as the tokenizer has them
        assert conf["added_tokens_decoder"][str(i)]["content"] == name == tok.id_to_token(i)
        assert conf["added_tokens_decoder"][str(i)]["special"] is True


def test_export_rebuilds_the_artifact_of_an_older_run(run, smoke_data, tmp_path, capsys):
    before = {n: (run / n).read_bytes() for n in ARTIFACT_FILES}
    for n in ARTIFACT_FILES:
        (run / n).unlink()
    assert main(["export", str(run), "--data", str(smoke_data)]) == 0
    assert {n: (run / n).read_bytes() for n in ARTIFACT_FILES} == before  # byte for byte
    # the tokenizer of other data is refused, naming why
    other = tmp_path / "other"
    other.mkdir()
    (other / "tokenizer.json").write_bytes(before["tokenizer.json"].replace(b'"<unk>"', b'"<UNK>"', 1))
    assert main(["export", str(run), "--data", str(other)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not the tokenizer" in err[0]
    assert main(["export", str(tmp_path)]) == 2


def test_generate_command(run, capsys):
    assert main(["generate", "--run", str(run), "--prompt", "The Congress", "--max-new-tokens", "8",
                 "--loops", "5"]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("The Congress") and "8 tokens at k=5 (K_train=3)" in out.err
    assert "mean loops/token 5.00" in out.err
    assert main(["generate", "--run", str(run), "--prompt", "The", "--halt", "margin"]) == 2  # not calibrated
    assert "loopscale eval halting" in capsys.readouterr().err
    assert main(["generate", "--run", str(run), "--prompt", "The", "--max-new-tokens", "6",
                 "--halt", "margin", "--threshold", "0"]) == 0
    assert "mean loops/token 1.33" in capsys.readouterr().err  # (3 + 5 * 1) / 6


def test_load_is_lazy_and_exported():
    code = "import sys, loopscale; assert 'torch' not in sys.modules; loopscale.load; assert 'torch' in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_export_upgrades_an_older_layout_run(run, tmp_path):
    """A run written before loopscale.json (config.json held the record, no Hugging Face
    files): load reads it as it is; export rewrites it in the current layout from model.pt."""
    import shutil
    old = tmp_path / "old"
    shutil.copytree(run, old)
    record = json.loads((old / "loopscale.json").read_text())
    for name in ("loopscale.json", "modeling_loopscale.py", "model.safetensors"):
        (old / name).unlink()
    (old / "config.json").write_text(json.dumps(record))
    model, _, cfg = loopscale.load(old)  # from model.pt
    assert main(["export", str(old)]) == 0
    assert json.loads((old / "loopscale.json").read_text())["data"] == record["data"]
    assert json.loads((old / "config.json").read_text())["model_type"] == "loopscale"
    again, _, cfg2 = loopscale.load(old)
    assert cfg2 == cfg
    for a, b in zip(model.state_dict().values(), again.state_dict().values()):
        assert torch.equal(a, b)


def test_readers_of_the_run_record_find_it_in_loopscale_json(run):
    """report and the eval data check read loopscale.json (config.json is the Hugging Face config)."""
    from loopscale.report.runs import find_run_dirs
    from loopscale.report.runs import load_run
    r = load_run(run)
    assert r.status == "completed" and r.config["model"]["readout"] == "final_norm"
    assert r.data["tokenizer_sha256"] and r.env["loopscale"]
    assert find_run_dirs([str(run)]) == [run]


SMOKE = ["--preset", "smoke", "--set", "model.dropout=0.1", "--set", "train.threads=1",
         "--set", "train.log_every=5", "--set", "train.ckpt_every=10"]


def test_truncated_checkpoints_give_a_clear_error(reference, tmp_path, smoke_data, capsys):
    bad = tmp_path / "model.pt"
    bad.write_bytes((reference / "model.pt").read_bytes()[:5000])
    with pytest.raises(CheckpointError, match="truncated or corrupted"):
        load(bad)
    # a torn resumable state: the train command names the file and exits non-zero
    run = tmp_path / "run"
    run.mkdir()
    (run / "state.pt").write_bytes(b"PK\x03\x04 not a real zip")
    rc = cli.main(["train", *SMOKE, "--data", str(smoke_data), "--out", str(run), "-q"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and str(run / "state.pt") in err and len(err.splitlines()) == 1


class _Exploit:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_checkpoint_that_runs_code_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    evil = tmp_path / "model.pt"
    torch.save({"model": {}, "config": {}, "payload": _Exploit()}, evil)
    with pytest.raises(CheckpointError, match="refused"):
        load_checkpoint(evil)
    raw = tmp_path / "raw.pkl"
    raw.write_bytes(pickle.dumps(_Exploit()))
    with pytest.raises(CheckpointError):
        load_checkpoint(raw)
    assert not (tmp_path / "PWNED").exists()


def test_checkpoint_of_another_shape_is_refused(reference, tmp_path):
    ck = torch.load(reference / "model.pt", weights_only=True)
    ck["config"]["model"]["d_model"] = 64  # claims a wider model than its weights
    torch.save(ck, tmp_path / "model.pt")
    with pytest.raises(CheckpointError, match="does not match"):
        load(tmp_path / "model.pt")
