"""The run directory (rundir.py): a retrain leaves nothing of the old run, a trainer stops with its
parent, a lost peer rank is never recorded as a result, and every writer (train, ouro-import,
export, convert-paper) takes the run's lock and leaves the old run whole when it fails."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import loopscale
from loopscale import cli
from loopscale.cli import main
from loopscale.io import run_lock

from cli_support import refused_in_one_line as one_line_error
from ouro_support import HF_TINY, published_tensors, word_tokenizer, write_hf
from run_support import tree


# ---------------------------------------------------------------------------
# a run that starts over leaves nothing of the previous one
# ---------------------------------------------------------------------------
SMOKE = ["--preset", "smoke", "--set", "train.threads=1", "--set", "train.log_every=5", "--set", "train.ckpt_every=5"]


def _train_cmd(data, out, *extra):
    return [sys.executable, "-m", "loopscale.cli", "train", *SMOKE, "--data", str(data), "--out", str(out), "-q",
            *extra]


def _wait_for_state(run: Path, proc, timeout=120):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            pytest.fail(f"training ended early: {proc.stderr.read()}")
        if (run / "state.pt").exists():
            return
        time.sleep(0.05)
    pytest.fail("no state.pt in time")


def test_sigterm_during_a_retrain_leaves_no_finished_looking_mix(finished_run, smoke_data, cli_env):
    from loopscale.report.runs import load_run
    run = finished_run
    proc = subprocess.Popen(_train_cmd(smoke_data, run, "--set", "train.max_steps=100000", "--set", "train.lr=0.002",
                                       "--no-resume"), env=cli_env, stderr=subprocess.PIPE, text=True)
    _wait_for_state(run, proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 143
    left = sorted(p.relative_to(run).as_posix() for p in run.rglob("*") if p.is_file())
    for gone in ("summary.json", "model.pt", "model.safetensors", "tokenizer.json", "eval/depth.json",
                 "eval/halting.json", "config.json"):  # config.json: the Hugging Face config of a finished artifact
        assert gone not in left, left
    assert json.loads((run / "loopscale.json").read_text())["config"]["train"]["lr"] == 0.002
    r = load_run(run)
    assert r.status == "failed" and not r.evals  # never shown as the old, completed run


def test_a_retrain_of_a_run_whose_outputs_were_deleted_drops_the_old_artifacts(finished_run, smoke_data, capsys):
    # what Snakemake does when a run's settings change: deletes model.pt and summary.json, reruns
    run = finished_run
    (run / "model.pt").unlink()
    (run / "summary.json").unlink()
    (run / "eval" / "notes.txt").write_text("mine")  # not a run file: kept
    rc = cli.main(["train", *SMOKE, "--set", "train.max_steps=5", "--set", "train.lr=0.002",
                   "--data", str(smoke_data), "--out", str(run), "-q"])
    assert rc == 0, capsys.readouterr().err
    assert not (run / "eval" / "depth.json").exists() and (run / "eval" / "notes.txt").read_text() == "mine"
    cfg = json.loads((run / "loopscale.json").read_text())["config"]
    assert cfg["train"]["lr"] == 0.002 and json.loads((run / "summary.json").read_text())["steps"] == 5


PARENT = """
import subprocess, sys, time
child = subprocess.Popen(sys.argv[1:])
print(child.pid, flush=True)
time.sleep(600)
"""


def test_the_trainer_stops_when_its_parent_is_killed(smoke_data, tmp_path, cli_env):
    run = tmp_path / "run"
    cmd = _train_cmd(smoke_data, run, "--set", "train.max_steps=100000", "--stop-with-parent")
    parent = subprocess.Popen([sys.executable, "-c", PARENT, *cmd], env=cli_env, stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    _wait_for_state(run, parent)
    parent.kill()  # SIGKILL: the parent gets no chance to stop its child
    parent.wait()
    t0 = time.time()
    while time.time() - t0 < 30:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.kill(child, signal.SIGKILL)
        pytest.fail("the trainer outlived its parent")
    from loopscale.io import load_checkpoint, run_lock
    assert load_checkpoint(run / "state.pt")["step"] > 0  # stopped as on SIGTERM: resumable
    with run_lock(run, "test"):  # and its lock is free
        pass


@pytest.mark.parametrize("error", ["DistBackendError", "gloo"])
def test_a_lost_peer_rank_fails_the_job_and_is_never_recorded(tmp_path, smoke_data, monkeypatch, error):
    import torch.distributed as dist

    import loopscale.train as T

    def lost(*a, **k):
        if error == "gloo":
            raise RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:4711")
        raise dist.DistBackendError("NCCL communicator was aborted on rank 0")
    monkeypatch.setattr(T, "train", lost)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError):
        cli.main(["train", *SMOKE, "--data", str(smoke_data), "--out", str(tmp_path / "run"), "--record-failure"])
    assert not (tmp_path / "run" / "summary.json").exists()
    # a crash of the run itself is still its result
    monkeypatch.setattr(T, "train", lambda *a, **k: (_ for _ in ()).throw(ValueError("a bug")))
    (tmp_path / "run").mkdir()
    assert cli.main(["train", *SMOKE, "--data", str(smoke_data), "--out", str(tmp_path / "run"),
                     "--record-failure"]) == 0
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "failed"


# ---------------------------------------------------------------------------
# the writers of a run directory: the run lock, --force, an atomic swap (io.write_run)
# ---------------------------------------------------------------------------
class TestRunWriters:
    def test_ouro_import_refuses_a_finished_run_without_force(self, hf_dir, tmp_path, capsys):
        run = tmp_path / "run"
        assert main(["ouro-import", str(hf_dir), "--out", str(run)]) == 0
        (run / "eval").mkdir()
        (run / "eval" / "depth.json").write_text("{}")
        before = tree(run)
        other = write_hf(tmp_path / "other", HF_TINY, published_tensors(HF_TINY, seed=1))
        word_tokenizer(HF_TINY["vocab_size"], prefix="x").save(str(other / "tokenizer.json"))
        one_line_error(capsys, ["ouro-import", other, "--out", run], "--force")
        assert tree(run) == before
        assert main(["ouro-import", str(other), "--out", str(run), "--force"]) == 0
        assert not (run / "eval").exists()  # nothing of the old run stays
        assert json.loads((run / "summary.json").read_text())["imported_from"] == str(other.resolve())
        assert "x1" in loopscale.load(run)[1].get_vocab()  # the swapped-in run is whole: its files agree
        assert not list(tmp_path.glob(".run.new-*"))

    def test_ouro_import_is_refused_while_a_trainer_holds_the_run(self, hf_dir, tmp_path, capsys):
        run = tmp_path / "run"
        run.mkdir()
        with run_lock(run, "loopscale train"):
            one_line_error(capsys, ["ouro-import", hf_dir, "--out", run], "in use by loopscale train")
        assert sorted(p.name for p in run.iterdir()) in ([], [".lock"])

    def test_export_is_refused_while_a_trainer_holds_the_run(self, hf_dir, tmp_path, capsys):
        run = tmp_path / "run"
        assert main(["ouro-import", str(hf_dir), "--out", str(run)]) == 0
        before = tree(run)
        with run_lock(run, "loopscale train"):
            one_line_error(capsys, ["export", run], "in use by loopscale train")
        assert tree(run) == before

    def test_a_failed_forced_import_leaves_the_old_run(self, hf_dir, tmp_path, capsys, monkeypatch):
        run = tmp_path / "run"
        assert main(["ouro-import", str(hf_dir), "--out", str(run)]) == 0
        before = tree(run)
        from loopscale import artifacts

        def disk_full(*a, **k):
            raise OSError(28, "No space left on device")
        monkeypatch.setattr(artifacts, "save_weights", disk_full)
        other = write_hf(tmp_path / "other", HF_TINY, published_tensors(HF_TINY, seed=1))
        one_line_error(capsys, ["ouro-import", other, "--out", run, "--force"], "No space left")
        assert tree(run) == before
        assert not list(tmp_path.glob(".run.new-*"))

    def test_convert_paper_force_on_a_full_disk_keeps_the_old_run(self, tmp_path, capsys, monkeypatch):
        from official import CHECKPOINTS

        from loopscale import convert
        run = tmp_path / "run"
        assert main(["convert-paper", str(CHECKPOINTS[0]), "--out", str(run)]) == 0
        before = tree(run)
        assert before

        def disk_full(path, obj):
            raise OSError(28, "No space left on device", str(path))
        monkeypatch.setattr(convert, "atomic_torch_save", disk_full)
        one_line_error(capsys, ["convert-paper", CHECKPOINTS[-1], "--out", run, "--force"], "No space left")
        assert tree(run) == before
        assert loopscale.load(run)[2].model.readout  # still a whole, verified run


# ---------------------------------------------------------------------------
# the trainer stops with its parent from its first instant
# ---------------------------------------------------------------------------
class TestParentWatch:
    def test_a_trainer_whose_launcher_died_before_it_started_stops(self, smoke_data, tmp_path, cli_env):
        """The launcher (a shell, as Snakemake's job) starts the trainer and dies at once, before
        the trainer has imported anything: the trainer must stop, not train on as an orphan."""
        run, pidfile = tmp_path / "run", tmp_path / "pid"
        cmd = (f"LOOPSCALE_PARENT_PID=$$ {sys.executable} -m loopscale.cli train --preset smoke --data {smoke_data} "
               f"--out {run} --set train.max_steps=100000 --set train.epochs=1000 -q --stop-with-parent "
               f"> {tmp_path / 'log'} 2>&1 & echo $! > {pidfile}; exit 0")
        subprocess.run(["sh", "-c", cmd], env=cli_env, check=True)
        pid = int(pidfile.read_text())

        def alive():
            try:
                os.kill(pid, 0)
                return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
            except (ProcessLookupError, FileNotFoundError):
                return False
        deadline = time.monotonic() + 90
        while alive() and time.monotonic() < deadline:
            time.sleep(0.5)
        stopped = not alive()
        if not stopped:
            os.kill(pid, signal.SIGKILL)
        assert stopped, (tmp_path / "log").read_text()[-2000:]
        with run_lock(run, "test"):  # nobody holds the run's lock any more
            pass
