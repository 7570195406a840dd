"""A run resumes to the same result after SIGKILL or SIGTERM, and a finished run is kept, not
retrained (rundir.py; the paper's runs of Section 4 are long enough to be preempted)."""
import hashlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from loopscale.io import load_checkpoint
from loopscale.train import train

from run_support import smoke_cfg


SMOKE = ["--preset", "smoke", "--set", "model.dropout=0.1", "--set", "train.threads=1",
         "--set", "train.log_every=5", "--set", "train.ckpt_every=10"]


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


# ---------------------------------------------------------------------------
# signals: a finished run is never retrained, an orphan trainer never outlives snakemake
# ---------------------------------------------------------------------------
def _digest(run: Path) -> dict:
    import hashlib
    return {n: hashlib.sha256((run / n).read_bytes()).hexdigest() for n in ("model.pt", "summary.json")}


def test_a_finished_run_whose_outputs_snakemake_deleted_is_kept(finished_run, smoke_data, caplog):
    from loopscale.config import preset
    from loopscale.train import train
    cfg = preset("smoke", {"train": {"threads": 1, "max_steps": 10, "log_every": 5}})
    before = _digest(finished_run)
    (finished_run / "model.pt").unlink()  # what --rerun-incomplete does to a job it thinks unfinished
    (finished_run / "summary.json").unlink()
    t0 = time.time()
    with caplog.at_level("INFO", logger="loopscale.train"):
        s = train(cfg, smoke_data, finished_run, progress=False)
    assert s["status"] == "completed" and _digest(finished_run) == before
    assert "kept the finished run" in caplog.text
    assert (finished_run / "model.pt").stat().st_mtime >= t0 - 1  # newer than the job's inputs


def test_only_a_finished_run_of_the_same_settings_is_kept(finished_run, smoke_data):
    from loopscale.config import preset
    from loopscale.train import train
    (finished_run / "model.pt").unlink()
    (finished_run / "summary.json").unlink()
    other = preset("smoke", {"train": {"threads": 1, "max_steps": 6, "log_every": 5}})
    s = train(other, smoke_data, finished_run, progress=False)
    assert s["steps"] == 6
    # a deleted model.pt alone (summary.json still there) retrains, as documented
    (finished_run / "model.pt").unlink()
    s = train(other, smoke_data, finished_run, progress=False)
    assert s["steps"] == 6 and json.loads((finished_run / "summary.json").read_text())["steps"] == 6
