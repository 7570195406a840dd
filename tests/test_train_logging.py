"""Training progress in logs: off a terminal (pipeline logs, SLURM) `loopscale train` logs one
line every train.log_every steps through Python logging; TensorBoard curves on request."""
import logging
import re
import subprocess
import sys

import pytest

from loopscale.config import ConfigError, preset
from loopscale.train import train

LINE = re.compile(r"step (\d+)/24  loss (\d+\.\d+)  \|H_K\| (\S+)  tok/s ([\d,]+)  ETA (\d+:\d\d:\d\d)$")


def cfg(**train_kw):
    return preset("smoke", {"train": {"max_steps": 24, "log_every": 8, "ckpt_every": 8, **train_kw}})


def test_a_progress_line_every_log_every_steps(smoke_data, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="loopscale.train")
    train(cfg(), smoke_data, tmp_path / "run", progress=False)
    lines = [LINE.match(r.getMessage()) for r in caplog.records if r.getMessage().startswith("step ")]
    assert [int(m.group(1)) for m in lines] == [8, 16, 24]
    assert all(float(m.group(3)) > 0 and int(m.group(4).replace(",", "")) > 0 for m in lines)
    assert lines[-1].group(5) == "0:00:00"
    assert any(r.getMessage().startswith("done: 24 steps, validation CE") for r in caplog.records)


def test_resume_is_logged(smoke_data, tmp_path, caplog, monkeypatch):
    from loopscale import train as T
    orig = T.atomic_torch_save

    def stop_after_first_state(path, obj):
        orig(path, obj)
        if path.name == "state.pt":
            raise KeyboardInterrupt
    monkeypatch.setattr(T, "atomic_torch_save", stop_after_first_state)
    with pytest.raises(KeyboardInterrupt):
        train(cfg(), smoke_data, tmp_path / "run", progress=False)
    monkeypatch.setattr(T, "atomic_torch_save", orig)
    caplog.set_level(logging.INFO, logger="loopscale.train")
    train(cfg(), smoke_data, tmp_path / "run", progress=False)
    assert any(re.fullmatch(r"resuming from .*state\.pt at step 8/24", r.getMessage()) for r in caplog.records)


def test_cli_logs_progress_to_a_pipe(smoke_data, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "loopscale.cli", "train", "--preset", "smoke", "-q",
                           "--set", "train.max_steps=24", "--set", "train.log_every=8",
                           "--data", str(smoke_data), "--out", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = [l for l in proc.stderr.splitlines() if " loopscale.train: step " in l]
    assert len(lines) == 3 and all(re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d loopscale\.train: step", l) for l in lines)


def test_tensorboard_curves(smoke_data, tmp_path):
    pytest.importorskip("tensorboard", reason="the optional tensorboard extra is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    train(cfg(tensorboard=True), smoke_data, tmp_path / "run", progress=False)
    acc = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    acc.Reload()
    assert {"train/loss", "train/norm_K", "ce/loop1", "norm/loop3"} <= set(acc.Tags()["scalars"])
    assert [e.step for e in acc.Scalars("train/loss")] == [8, 16, 24]


def test_tensorboard_missing_is_one_clear_error(smoke_data, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if not installed
    with pytest.raises(ConfigError, match="train.tensorboard needs the tensorboard package"):
        train(cfg(tensorboard=True), smoke_data, tmp_path / "run", progress=False)
