"""Training: logs, checkpoints, resume, determinism, provenance, divergence."""
import json

import pytest
import torch

from loopscale.config import preset
from loopscale.artifacts import load
from loopscale.train import train


def cfg(**train_kw):
    # dropout on, so resuming must restore the RNG too
    return preset("smoke", {"model": {"dropout": 0.1}, "train": {"max_steps": 24, "log_every": 4,
                                                                  "ckpt_every": 8, **train_kw}})


def interrupt_after_state_saves(monkeypatch, n: int) -> list:
    """Make training stop hard (KeyboardInterrupt) right after its n-th state.pt checkpoint;
    returns the list of checkpointed steps, filled as training runs."""
    from loopscale import train as T
    orig, saved = T.atomic_torch_save, []

    def save(path, obj):
        orig(path, obj)
        if path.name == "state.pt":
            saved.append(obj["step"])
            if len(saved) == n:
                raise KeyboardInterrupt
    monkeypatch.setattr(T, "atomic_torch_save", save)
    return saved


def losses(run_dir):
    lines = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r["ce"], r["norm"]) for r in lines if "loss" in r]


def test_run_writes_its_files_and_provenance(smoke_data, tmp_path):
    s = train(cfg(), smoke_data, tmp_path / "run", progress=False)
    assert s["status"] == "completed" and s["steps"] == 24
    run = tmp_path / "run"
    assert {p.name for p in run.iterdir()} >= {"loopscale.json", "config.json", "metrics.jsonl", "model.pt", "summary.json"}
    assert not (run / "state.pt").exists()  # resumable state is dropped once finished
    info = json.loads((run / "loopscale.json").read_text())
    assert info["config"]["model"]["dropout"] == 0.1
    for key in ("loopscale", "git_commit", "torch", "device"):
        assert key in info["env"]
    rec = losses(run)
    assert [r[0] for r in rec] == [4, 8, 12, 16, 20, 24]
    assert all(len(r[2]) == 3 and len(r[3]) == 3 for r in rec)  # CE and norm of every loop
    assert len(s["validation"]["val_ce"]) == 3
    model, _, loaded = load(run / "model.pt")
    assert loaded.to_dict() == cfg().to_dict()


def test_same_seed_same_result(smoke_data, tmp_path):
    train(cfg(), smoke_data, tmp_path / "a", progress=False)
    train(cfg(), smoke_data, tmp_path / "b", progress=False)
    assert losses(tmp_path / "a") == losses(tmp_path / "b")
    c = train(cfg(seed=7), smoke_data, tmp_path / "c", progress=False)
    assert losses(tmp_path / "c") != losses(tmp_path / "a") and c["status"] == "completed"


def test_stop_and_resume_equals_uninterrupted(smoke_data, tmp_path, monkeypatch):
    full = tmp_path / "full"
    train(cfg(), smoke_data, full, progress=False)
    # a shorter budget ends at its own last step
    train(cfg(max_steps=16, ckpt_every=8), smoke_data, tmp_path / "part", progress=False)
    state = torch.load(tmp_path / "part" / "model.pt", weights_only=True)
    assert state["step"] == 16
    # a run stopped hard right after its step-16 checkpoint, then rerun, equals the full run
    killed = tmp_path / "killed"
    with monkeypatch.context() as m:
        calls = interrupt_after_state_saves(m, 2)
        with pytest.raises(KeyboardInterrupt):
            train(cfg(), smoke_data, killed, progress=False)
    assert calls == [8, 16] and (killed / "state.pt").exists()
    train(cfg(), smoke_data, killed, progress=False)
    assert losses(killed) == losses(full)
    a, b = torch.load(full / "model.pt", weights_only=True), torch.load(killed / "model.pt", weights_only=True)
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k


def test_resume_refuses_a_different_config(smoke_data, tmp_path, monkeypatch):
    from loopscale.io import CheckpointError
    run = tmp_path / "run"
    with monkeypatch.context() as m:
        interrupt_after_state_saves(m, 1)
        with pytest.raises(KeyboardInterrupt):
            train(cfg(), smoke_data, run, progress=False)
    with pytest.raises(CheckpointError, match="different config"):
        train(preset("smoke", {"model": {"dropout": 0.1, "readout": "raw"},
                               "train": {"max_steps": 24, "log_every": 4, "ckpt_every": 8}}),
              smoke_data, run, progress=False)


def test_absurd_learning_rate_is_recorded_as_diverged(smoke_data, tmp_path):
    s = train(cfg(lr=1e6, max_steps=60), smoke_data, tmp_path / "run", progress=False)
    assert s["status"] == "diverged"
    assert 1 <= s["diverged_at_step"] <= 60
    saved = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    assert saved["status"] == "diverged"
    assert all(torch.isfinite(v).all() for v in saved["model"].values())  # the diverged update never landed
    for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        assert all(map(lambda v: v == v and abs(v) != float("inf"), rec.get("ce", []) + [rec.get("loss", 0)]))


def test_activation_checkpointing_gives_the_same_run(smoke_data, tmp_path):
    train(cfg(), smoke_data, tmp_path / "plain", progress=False)
    train(cfg(activation_checkpointing=True), smoke_data, tmp_path / "ckpt", progress=False)
    assert losses(tmp_path / "ckpt") == losses(tmp_path / "plain")


@pytest.mark.parametrize("setting", [("lr", float("inf")), ("grad_clip", float("nan"))])
def test_a_non_finite_update_never_lands(smoke_data, tmp_path, setting):
    """The loss and gradient are finite, the update is not (settings the validation refuses,
    set behind its back): the step is undone and model.pt keeps the last finite weights."""
    c = cfg(max_steps=8)
    setattr(c.train, *setting)
    s = train(c, smoke_data, tmp_path / "run", progress=False)
    assert s["status"] == "diverged" and s["diverged_at_step"] == 1
    saved = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    torch.manual_seed(c.train.seed)
    from loopscale.model import LoopedLM
    init = LoopedLM(c.model).state_dict()
    assert all(torch.equal(saved["model"][k], init[k]) for k in init)  # the weights before the bad step


def digest(folder):
    import hashlib
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def test_a_finished_run_is_reused_when_only_thread_or_device_settings_change(smoke_data, tmp_path):
    run = tmp_path / "run"
    first = train(cfg(), smoke_data, run, progress=False)
    before = digest(run)
    c = cfg(threads=1, ckpt_every=5, device="cpu")
    assert train(c, smoke_data, run, progress=False) == first and digest(run) == before


def test_a_finished_run_of_other_settings_is_refused_not_overwritten(smoke_data, tmp_path):
    from loopscale.io import CheckpointError
    run = tmp_path / "run"
    train(cfg(), smoke_data, run, progress=False)
    before = digest(run)
    with pytest.raises(CheckpointError, match="finished run of other settings; train with --no-resume"):
        train(cfg(lr=5e-4), smoke_data, run, progress=False)
    assert digest(run) == before
    assert train(cfg(lr=5e-4), smoke_data, run, resume=False, progress=False)["status"] == "completed"
    assert torch.load(run / "model.pt", weights_only=True)["config"]["train"]["lr"] == 5e-4


def test_max_steps_lowered_below_the_checkpoint_is_refused(smoke_data, tmp_path, monkeypatch):
    from loopscale.io import CheckpointError
    run = tmp_path / "run"
    with monkeypatch.context() as m:
        interrupt_after_state_saves(m, 2)  # state.pt at step 16
        with pytest.raises(KeyboardInterrupt):
            train(cfg(), smoke_data, run, progress=False)
    with pytest.raises(CheckpointError, match="at step 16, past this run's 12 steps"):
        train(cfg(max_steps=12), smoke_data, run, progress=False)
    assert not (run / "summary.json").exists()


@pytest.mark.parametrize("change", [{"step": -3}, {"step": "7"}, {"optimizer": None}, {"rng_ranks": 5},
                                    {"config": "x"}])
def test_a_malformed_state_is_one_line_and_keeps_the_log(smoke_data, tmp_path, monkeypatch, capsys, change):
    from loopscale import cli
    run = tmp_path / "run"
    with monkeypatch.context() as m:
        interrupt_after_state_saves(m, 1)
        with pytest.raises(KeyboardInterrupt):
            train(cfg(), smoke_data, run, progress=False)
    state = torch.load(run / "state.pt", weights_only=True)
    state.update(change)
    torch.save(state, run / "state.pt")
    log = (run / "metrics.jsonl").read_text()
    rc = cli.main(["train", "--preset", "smoke", "--set", "model.dropout=0.1", "--set", "train.max_steps=24",
                   "--set", "train.log_every=4", "--set", "train.ckpt_every=8", "--data", str(smoke_data),
                   "--out", str(run), "-q"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "state.pt" in err and "--no-resume" in err, err
    assert (run / "metrics.jsonl").read_text() == log  # a negative step used to empty it


def test_kill_leftovers_are_cleaned_on_the_next_run(smoke_data, tmp_path):
    run = tmp_path / "run"
    train(cfg(), smoke_data, run, progress=False)
    (run / ".model.pt.k1ll3d.tmp").write_bytes(b"torn")
    (run / "state.pt").write_bytes((run / "model.pt").read_bytes())  # killed before state.pt was removed
    train(cfg(), smoke_data, run, progress=False)
    assert not list(run.glob(".*.tmp")) and not (run / "state.pt").exists()


def test_a_second_trainer_on_the_same_run_is_refused(smoke_data, tmp_path, capsys):
    from loopscale import cli
    from loopscale.io import run_lock
    run = tmp_path / "run"
    run.mkdir()
    with run_lock(run, "loopscale train"):  # what a running trainer holds
        rc = cli.main(["train", "--preset", "smoke", "--data", str(smoke_data), "--out", str(run), "-q"])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and len(err.splitlines()) == 1 and "is in use by loopscale train (pid " in err, err
        assert sorted(p.name for p in run.iterdir()) == [".lock"]
    with run_lock(run, "again"):  # released on exit
        pass
