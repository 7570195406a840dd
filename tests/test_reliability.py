"""Nothing computed is lost: kills, SIGTERM, torn files, bad input, unsafe checkpoints."""
import hashlib
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from loopscale import cli
from loopscale.config import preset
from loopscale.artifacts import load
from loopscale.io import CheckpointError, load_checkpoint
from loopscale.train import train

SMOKE = ["--preset", "smoke", "--set", "model.dropout=0.1", "--set", "train.threads=1",
         "--set", "train.log_every=5", "--set", "train.ckpt_every=10"]


def smoke_cfg(steps):
    return preset("smoke", {"model": {"dropout": 0.1}, "train": {"threads": 1, "log_every": 5,
                                                                  "ckpt_every": 10, "max_steps": steps}})


def train_cmd(data, out, steps, *extra):
    return [sys.executable, "-m", "loopscale.cli", "train", *SMOKE, "--set", f"train.max_steps={steps}",
            "--data", str(data), "--out", str(out), "-q", *extra]


def losses(run):
    return [(r["step"], r["loss"], r["ce"]) for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if "loss" in r]


def digest(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def wait_for_step(run: Path, step: int, proc, timeout=300):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            pytest.fail(f"training ended before step {step}: {proc.stderr.read()}")
        if (run / "state.pt").exists() and (run / "metrics.jsonl").exists() and \
                any(json.loads(l).get("step", 0) >= step for l in (run / "metrics.jsonl").read_text().splitlines()
                    if l.strip().endswith("}")):
            return
        time.sleep(0.05)
    pytest.fail("training did not reach step {step} in time")


@pytest.fixture(scope="module")
def reference(smoke_data, tmp_path_factory):
    """An uninterrupted 150-step run, trained in process."""
    run = tmp_path_factory.mktemp("ref") / "run"
    train(smoke_cfg(150), smoke_data, run, progress=False)
    return run


@pytest.mark.slow  # two training subprocesses each: end to end (make test-fast skips it)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killed_run_resumes_to_the_same_result(sig, smoke_data, reference, tmp_path, cli_env):
    run = tmp_path / "run"
    proc = subprocess.Popen(train_cmd(smoke_data, run, 150), env=cli_env, stderr=subprocess.PIPE, text=True)
    wait_for_step(run, 25, proc)
    proc.send_signal(sig)
    rc = proc.wait(60)
    if sig == signal.SIGTERM:
        assert rc == 143  # preempted: a last checkpoint was written at a step boundary
        assert "resume" in proc.stderr.read()
        state = load_checkpoint(run / "state.pt")
        assert state["step"] >= 25
    else:
        assert rc == -signal.SIGKILL
    assert not (run / "summary.json").exists()
    done = subprocess.run(train_cmd(smoke_data, run, 150), env=cli_env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert losses(run) == losses(reference)
    a = torch.load(reference / "model.pt", weights_only=True)["model"]
    b = torch.load(run / "model.pt", weights_only=True)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_finished_run_is_not_retrained(reference, smoke_data):
    before = digest(reference)
    s = train(smoke_cfg(150), smoke_data, reference, progress=False)
    assert s["status"] == "completed" and digest(reference) == before


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


def _bad_inputs(data, tmp):
    (tmp / "broken.yaml").write_text("model: {readout: rmsnorm\n  loss: [")
    return {
        "unknown preset": (["train", "--preset", "nope"], "unknown preset"),
        "unknown condition value": (["train", *SMOKE, "--set", "model.readout=cosine"], "model.readout"),
        "unknown key": (["train", *SMOKE, "--set", "train.lrr=1"], "train.lrr"),
        "wrong type": (["train", *SMOKE, "--set", "train.batch_size=many"], "train.batch_size"),
        "malformed config": (["train", "--config", str(tmp / "broken.yaml")], "not valid YAML"),
        "vocabulary over uint16": (["prepare-data", *SMOKE, "--set", "data.vocab_size=70000",
                                    "--set", "model.vocab_size=70000"], "uint16"),
        "missing data file": (["prepare-data", *SMOKE, "--set", "data.source=text-files",
                               "--set", f"data.train_file={tmp / 'nope.txt'}",
                               "--set", f"data.validation_file={tmp / 'nope.txt'}"], "nope.txt"),
        "unreachable hub": (["prepare-data", *SMOKE, "--set", "data.source=wikitext-2"], "builtin"),
    }


def test_bad_input_fails_in_one_line_and_touches_nothing(reference, smoke_data, tmp_path, capsys):
    run_before = digest(reference)
    data_before = digest(smoke_data)
    for name, (args, needle) in _bad_inputs(smoke_data, tmp_path).items():
        if args[0] == "train":
            args = [*args, "--data", str(smoke_data), "--out", str(reference)]
        else:
            args = [*args, "--out", str(smoke_data)]
        rc = cli.main(args)
        err = capsys.readouterr().err.strip()
        assert rc != 0, name
        assert len(err.splitlines()) == 1 and err.startswith("loopscale: error:"), (name, err)
        if needle:
            assert needle in err, (name, err)
        assert digest(reference) == run_before, name
        assert digest(smoke_data) == data_before, name


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


def test_diverged_run_is_shown_as_diverged_in_the_aggregate(smoke_data, reference, tmp_path):
    bad = tmp_path / "runs" / "diverged"
    s = train(preset("smoke", {"model": {"readout": "raw"}, "train": {"lr": 1e6, "max_steps": 40}}),
              smoke_data, bad, progress=False)
    assert s["status"] == "diverged"
    out = tmp_path / "results"
    assert cli.main(["report", "tables", "--runs", str(reference), str(bad), "--out", str(out)]) == 0
    import pandas as pd
    runs = pd.read_csv(out / "runs.csv")
    assert len(runs) == 2  # the diverged run is listed, not dropped
    assert runs.astype(str).apply(lambda col: col.str.contains("diverged")).any().any()
    for cell in runs.select_dtypes("number").to_numpy().ravel():  # no inf written as a number
        assert cell != float("inf")
