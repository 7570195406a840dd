"""Weights & Biases logging behind `train.wandb: true` (the `wandb` extra), tested offline:
WANDB_MODE=offline writes the run under RUN/wandb/ and reaches no server."""
import json
import sys

import pytest

from loopscale.config import ConfigError, preset
from loopscale.train import train


def cfg(**train_kw):
    return preset("smoke", {"train": {"max_steps": 24, "log_every": 8, "ckpt_every": 8, **train_kw}})


@pytest.fixture
def offline(monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_PROJECT", "loopscale-test")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_DIR", "WANDB_RUN_ID", "WANDB_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))


def history(path):
    """The `history` records (what wandb.log sent) of an offline run file: the LevelDB log
    format wandb writes (a 7-byte file header, 32 KiB blocks of checksum/length/type chunks)."""
    from wandb.proto import wandb_internal_pb2 as pb
    raw = path.read_bytes()
    assert raw[:4] == b":W&B"
    data, pos, chunks = raw[7:], 0, b""
    records = []
    block = 32768
    first = block - 7  # the file header shares the first block
    while pos + 7 <= len(data):
        left = (first - pos) if pos < first else block - ((pos - first) % block)
        if left < 7:  # block trailer
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if kind == 0 and length == 0:
            break
        chunks += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            r = pb.Record()
            r.ParseFromString(chunks)
            chunks = b""
            if r.WhichOneof("record_type") == "history":
                records.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item})
    return records


def test_offline_run_is_written_locally_and_changes_nothing(smoke_data, tmp_path, offline):
    pytest.importorskip("wandb", reason="the optional wandb extra is not installed")
    run, plain = tmp_path / "run", tmp_path / "plain"
    summary = train(cfg(wandb=True), smoke_data, run, progress=False)
    (wb,) = (run / "wandb").glob("offline-run-*")
    steps = history(next(wb.glob("run-*.wandb")))
    assert [h["_step"] for h in steps] == [8, 16, 24]
    assert {"train/loss", "train/norm_K", "train/grad_norm", "ce/loop1", "norm/loop3"} <= set(steps[-1])
    logged = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in l]
    assert [h["train/loss"] for h in steps] == pytest.approx([r["loss"] for r in logged])
    assert steps[-1]["norm/loop3"] == pytest.approx(logged[-1]["norm"][-1])
    assert summary["status"] == "completed"
    # the flag only adds logging: the same losses without it, and a finished run is reused
    # when only the flag changes
    train(cfg(), smoke_data, plain, progress=False)
    read = lambda p: [json.loads(l).get("loss") for l in (p / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    assert read(plain) == read(run)
    before = (plain / "model.pt").stat().st_mtime_ns
    train(cfg(wandb=True), smoke_data, plain, progress=False)
    assert (plain / "model.pt").stat().st_mtime_ns == before and not (plain / "wandb").exists()


def test_wandb_missing_is_one_clear_error(smoke_data, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(ConfigError, match="train.wandb needs the wandb package"):
        train(cfg(wandb=True), smoke_data, tmp_path / "run", progress=False)


def test_wandb_that_cannot_start_is_one_clear_error(smoke_data, tmp_path, monkeypatch):
    import types

    def init(**kw):
        raise RuntimeError("api_key not configured (no-tty)")
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    with pytest.raises(ConfigError, match=r"W&B could not start \(api_key not configured.*WANDB_MODE=offline"):
        train(cfg(wandb=True), smoke_data, tmp_path / "run", progress=False)
    assert not (tmp_path / "run" / "model.pt").exists()
