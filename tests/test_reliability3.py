"""No run is ever silently mixed or lost: retrains, report grouping, duplicate YAML keys,
hostile arguments, signals (issue "Reliability 3", outside the artifact surfaces)."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loopscale import cli
from loopscale.config import ConfigError, read_yaml
from report_support import make_run

REPO = Path(__file__).resolve().parents[1]


def run_cli(capsys, *argv) -> tuple[int, str]:
    """(exit code, stderr) of one in-process `loopscale` call."""
    rc = cli.main([str(a) for a in argv])
    return rc, capsys.readouterr().err


def one_line_error(rc: int, err: str, *words: str) -> None:
    assert rc == 2, err
    lines = [l for l in err.splitlines() if "loopscale: error" in l]
    assert len(lines) == 1 and "Traceback" not in err, err
    for w in words:
        assert w in lines[0], (w, lines[0])


# ---------------------------------------------------------------------------
# duplicate keys in YAML (params.yaml, config files, eval files)
# ---------------------------------------------------------------------------
def test_duplicate_key_is_refused_naming_key_and_lines(tmp_path):
    f = tmp_path / "params.yaml"
    f.write_text("experiment: smoke\nexperiments:\n  smoke:\n    steps: 20\n  cpu:\n    steps: 5\n"
                 "  smoke:\n    steps: 1500\n")
    with pytest.raises(ConfigError) as e:
        read_yaml(f, "params file")
    msg = str(e.value)
    assert "duplicate key 'smoke'" in msg and "line 7" in msg and "line 3" in msg, msg
    assert "\n" not in msg


def test_duplicate_key_in_a_flow_mapping_and_a_nested_block(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("train: {lr: 0.1, lr: 0.2}\n")
    with pytest.raises(ConfigError, match="duplicate key 'lr'"):
        read_yaml(f)
    f.write_text("model:\n  d_model: 64\n  n_layers: 2\n  d_model: 128\n")
    with pytest.raises(ConfigError, match=r"line 4\).*duplicate key 'd_model'"):
        read_yaml(f)


def test_merge_keys_may_still_be_overridden(tmp_path):
    f = tmp_path / "m.yaml"
    f.write_text("base: &b {x: 1, y: 2}\nother:\n  <<: *b\n  x: 5\n")
    assert read_yaml(f)["other"] == {"x": 5, "y": 2}


def test_duplicate_key_in_a_config_file_is_one_line_from_the_cli(tmp_path, capsys):
    f = tmp_path / "run.yaml"
    f.write_text("preset: smoke\ntrain:\n  max_steps: 3\n  max_steps: 7\n")
    rc, err = run_cli(capsys, "config", "--config", f)
    one_line_error(rc, err, "duplicate key 'max_steps'", "line 4")


def test_duplicate_experiment_in_params_stops_the_pipeline_planner(tmp_path):
    from loopscale import pipeline as P
    text = (REPO / "params.yaml").read_text()
    i = text.index("\nexperiments:\n") + len("\nexperiments:\n")
    j = text.index("\n  ", i + 1)  # the first experiment's block, copied once more at the end
    block_end = text.find("\n  ", j + 1)
    while block_end != -1 and text[block_end + 3] == " ":
        block_end = text.find("\n  ", block_end + 1)
    first = text[i:block_end if block_end != -1 else len(text)].rstrip("\n")
    (tmp_path / "params.yaml").write_text(text.rstrip("\n") + "\n" + first + "\n")
    with pytest.raises(P.ParamsError, match="duplicate key"):
        P.load_and_validate(tmp_path / "params.yaml", REPO / "workflow" / "schemas" / "params.schema.yaml")


# ---------------------------------------------------------------------------
# report: only seeds of one experiment are averaged
# ---------------------------------------------------------------------------
def _set(run: Path, section: str, key: str, value) -> None:
    cj = json.loads((run / "config.json").read_text())
    cj["config"][section][key] = value
    (run / "config.json").write_text(json.dumps(cj))


def test_two_copies_of_one_run_are_refused(tmp_path, capsys):
    a = make_run(tmp_path / "exp1", seed=1)
    make_run(tmp_path / "exp1", seed=2)
    shutil.copytree(a, tmp_path / "copy" / "seed1")
    rc, err = run_cli(capsys, "report", "tables", "--runs", tmp_path, "--out", tmp_path / "out")
    one_line_error(rc, err, "two copies", "seed 1", str(a), str(tmp_path / "copy" / "seed1"))
    assert not (tmp_path / "out").exists()


def test_runs_of_two_experiments_in_one_row_are_refused(tmp_path, capsys):
    short = make_run(tmp_path / "short", seed=1)
    long_ = make_run(tmp_path / "long", seed=2)
    _set(short, "train", "max_steps", 20)
    _set(long_, "train", "max_steps", 1500)
    rc, err = run_cli(capsys, "report", "tables", "--runs", tmp_path, "--out", tmp_path / "out")
    one_line_error(rc, err, "not seeds of one experiment", "train.max_steps", "20", "1500")
    assert not (tmp_path / "out").exists()
    rc, err = run_cli(capsys, "report", "write", "--runs", tmp_path, "--results", tmp_path,
                      "--out", tmp_path / "REPORT.md")
    one_line_error(rc, err, "not seeds of one experiment")
    assert not (tmp_path / "REPORT.md").exists()


def test_seeds_differing_only_in_free_settings_are_one_experiment(tmp_path, capsys):
    a = make_run(tmp_path / "e", seed=1)
    b = make_run(tmp_path / "e", seed=2)
    _set(a, "train", "threads", 1)
    _set(b, "train", "threads", 8)
    _set(b, "train", "device", "cuda")
    _set(b, "train", "ckpt_every", 7)
    rc, err = run_cli(capsys, "report", "tables", "--runs", tmp_path, "--out", tmp_path / "out")
    assert rc == 0, err
    import pandas as pd
    main = pd.read_csv(tmp_path / "out" / "main.csv")
    assert list(main["n"]) == [2]


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


@pytest.fixture
def finished_run(smoke_data, tmp_path):
    """A finished 10-step smoke run with an evaluation result beside it."""
    from loopscale.config import preset
    from loopscale.train import train
    run = tmp_path / "run"
    train(preset("smoke", {"train": {"threads": 1, "max_steps": 10, "log_every": 5}}), smoke_data, run, progress=False)
    (run / "eval").mkdir()
    (run / "eval" / "depth.json").write_text(json.dumps({"status": "ok", "exits": [{"k": 1, "ce": 1.0}]}))
    (run / "eval" / "halting.json").write_text(json.dumps({"status": "ok", "policies": {}}))
    return run


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


# ---------------------------------------------------------------------------
# arguments: one line each, before any work
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("args, words", [
    (["--steps", "0"], ["--steps", ">= 1"]),
    (["--steps", "-3"], ["--steps", "-3"]),
    (["--eval-batches", "0"], ["--eval-batches"]),
    (["--eval-warmup", "-2"], ["--eval-warmup"]),
    (["--warmup", "-1"], ["--warmup"]),
    (["--threads", "100000"], ["--threads", "1024"]),
    (["--device", "foo"], ["--device", "'foo'"]),
])
def test_bench_arguments_are_refused_in_one_line(args, words, capsys):
    rc, err = run_cli(capsys, "bench", "--preset", "smoke", "--no-memory", "--no-eval", *args)
    one_line_error(rc, err, *words)


def test_thread_and_seed_bounds_hold_for_every_command(tmp_path, smoke_data, capsys):
    rc, err = run_cli(capsys, "generate", "--run", tmp_path, "--prompt", "the", "--threads", "100000")
    one_line_error(rc, err, "--threads")
    rc, err = run_cli(capsys, "generate", "--run", tmp_path, "--prompt", "the", "--seed", str(2 ** 70))
    one_line_error(rc, err, "--seed")
    rc, err = run_cli(capsys, "generate", "--run", tmp_path, "--prompt", "the", "--device", "foo")
    one_line_error(rc, err, "--device")
    rc, err = run_cli(capsys, "eval", "depth", "--model", tmp_path / "model.pt", "--data", smoke_data,
                      "--out", tmp_path / "d.json", "--threads", "100000")
    one_line_error(rc, err, "--threads")
    rc, err = run_cli(capsys, "train", *SMOKE, "--set", "train.threads=100000", "--data", smoke_data,
                      "--out", tmp_path / "run")
    one_line_error(rc, err, "train.threads")
    assert not (tmp_path / "run").exists()
    rc, err = run_cli(capsys, "train", "--preset", "smoke", "--set", f"train.seed={2 ** 64}", "--data", smoke_data,
                      "--out", tmp_path / "run")
    one_line_error(rc, err, "train.seed")


# ---------------------------------------------------------------------------
# prepare-data: a directory as train_file, a bad --tokenizer
# ---------------------------------------------------------------------------
def _text_files_args(tmp_path, train_file):
    (tmp_path / "valid.txt").write_text("the cat sat on the mat\n" * 20)
    return ["prepare-data", "--preset", "smoke", "--set", "data.source=text-files",
            "--set", f"data.train_file={train_file}", "--set", f"data.validation_file={tmp_path / 'valid.txt'}",
            "--out", tmp_path / "data"]


def test_a_directory_as_train_file_says_so(tmp_path, capsys):
    (tmp_path / "corpus").mkdir()
    rc, err = run_cli(capsys, *_text_files_args(tmp_path, tmp_path / "corpus"))
    one_line_error(rc, err, "is a directory", "data.train_file")


@pytest.mark.parametrize("content", [b"\xff\xfe garbage \x00", b"{not json", b'{"version": "1.0"}'])
def test_prepare_data_with_a_broken_tokenizer_file_is_one_line(tmp_path, capsys, content):
    (tmp_path / "train.txt").write_text("the cat sat on the mat\n" * 50)
    tok = tmp_path / "tokenizer.json"
    tok.write_bytes(content)
    rc, err = run_cli(capsys, *_text_files_args(tmp_path, tmp_path / "train.txt"), "--tokenizer", tok)
    one_line_error(rc, err, str(tok))
    assert not (tmp_path / "data").exists()


def test_prepare_data_with_an_unreadable_tokenizer_file_is_one_line(tmp_path, capsys, monkeypatch):
    (tmp_path / "train.txt").write_text("the cat sat on the mat\n" * 50)
    tok = tmp_path / "tokenizer.json"
    tok.write_text("{}")
    real = Path.read_bytes

    def denied(self):
        if self.name == "tokenizer.json":
            raise PermissionError(13, "Permission denied", str(self))
        return real(self)
    monkeypatch.setattr(Path, "read_bytes", denied)  # as root, chmod 000 would not stop a read
    rc, err = run_cli(capsys, *_text_files_args(tmp_path, tmp_path / "train.txt"), "--tokenizer", tok)
    one_line_error(rc, err, "Permission denied", str(tok))


def test_prepare_data_refuses_a_tokenizer_with_non_contiguous_ids(tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<unk>": 3, "the": 4, "cat": 5, "sat": 9}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    (tmp_path / "train.txt").write_text("the cat sat on the mat\n" * 50)
    tok.save(str(tmp_path / "tok.json"))
    rc, err = run_cli(capsys, *_text_files_args(tmp_path, tmp_path / "train.txt"), "--tokenizer", tmp_path / "tok.json")
    one_line_error(rc, err, "not contiguous", "id 6")
    assert not (tmp_path / "data").exists()


# ---------------------------------------------------------------------------
# report: a mistyped value marks its run's file, never crashes the grid
# ---------------------------------------------------------------------------
def _edit(path: Path, change) -> None:
    d = json.loads(path.read_text())
    change(d)
    path.write_text(json.dumps(d, allow_nan=True))


def _grid(root: Path) -> Path:
    a = make_run(root, seed=1)
    make_run(root, seed=2)
    make_run(root, readout="raw", seed=1)
    return a


@pytest.mark.parametrize("file, change, words", [
    ("eval/depth.json", lambda d: d["exits"][-1].update(norm="big"), "exits[2].norm is 'big', not a number"),
    ("eval/depth.json", lambda d: d["exits"][-1].update(ce=[1, 2]), "exits[2].ce is a list"),
    ("eval/depth.json", lambda d: d["exits"][-1].update(ppl=float("nan")), "exits[2].ppl is NaN"),
    ("eval/depth.json", lambda d: d["exits"][-1].update(norm=-5.0), "exits[2].norm is negative"),
    ("eval/norms.json", lambda d: d["loops"][0].update(k="one"), "loops[0].k is 'one'"),
    ("eval/norms.json", lambda d: d["final"].update(p99="x"), "final.p99 is 'x'"),
    ("eval/radial.json", lambda d: d["loops"][0].update(radial_fraction=[1]), "radial_fraction is a list"),
    ("summary.json", lambda d: d["validation"].update(val_norm="x"), "validation.val_norm is 'x'"),
    ("summary.json", lambda d: d["validation"].update(val_ce=[1.0, float("nan"), 2.0]), "val_ce[1] is NaN"),
])
def test_a_mistyped_metric_marks_its_run_and_says_so(tmp_path, capsys, file, change, words):
    a = _grid(tmp_path / "runs")
    if file == "summary.json":
        (a / "eval" / "depth.json").unlink()  # the summary's values would be the ones used
    _edit(a / file, change)
    rc, err = run_cli(capsys, "report", "tables", "--runs", tmp_path / "runs", "--out", tmp_path / "out")
    assert rc == 0, err
    runs_md = (tmp_path / "out" / "runs.md").read_text()
    row = next(l for l in runs_md.splitlines() if "seed1" in l and "RMSNorm" in l)
    assert "malformed" in row and words in row, row
    assert words in (tmp_path / "out" / "claims.md").read_text()
    import pandas as pd
    main = pd.read_csv(tmp_path / "out" / "main.csv")
    rms = main[main["condition_id"] == "rmsnorm-per_loop-none-residual"].iloc[0]
    if file in ("eval/depth.json", "summary.json"):  # the bad run's final exit counts nowhere
        assert rms["ppl_K_n"] == 1 and rms["norm_K_n"] == 1


def test_an_empty_depth_json_is_unreadable_and_not_replaced_by_the_summary(tmp_path, capsys):
    a = _grid(tmp_path / "runs")
    (a / "eval" / "depth.json").write_text("")
    rc, err = run_cli(capsys, "report", "tables", "--runs", tmp_path / "runs", "--out", tmp_path / "out")
    assert rc == 0, err
    main_md = (tmp_path / "out" / "main.md").read_text()
    assert "eval/depth.json is unusable" in main_md and "seed 1 (unreadable)" in main_md
    row = next(l for l in (tmp_path / "out" / "runs.md").read_text().splitlines() if "seed1" in l and "RMSNorm" in l)
    assert "unreadable: depth" in row and "empty" in row and "missing: depth" not in row


def test_report_write_refuses_an_unknown_experiment_or_missing_results(tmp_path, capsys):
    _grid(tmp_path / "runs")
    (tmp_path / "res").mkdir()
    out = tmp_path / "REPORT.md"
    rc, err = run_cli(capsys, "report", "write", "--runs", tmp_path / "runs", "--results", tmp_path / "res",
                      "--params", REPO / "params.yaml", "--experiment", "nope", "--out", out)
    one_line_error(rc, err, "no experiment 'nope'")
    rc, err = run_cli(capsys, "report", "write", "--runs", tmp_path / "runs", "--results", tmp_path / "missing",
                      "--out", out)
    one_line_error(rc, err, "results directory", "not found")
    assert not out.exists()
    rc, err = run_cli(capsys, "report", "write", "--runs", tmp_path / "runs", "--results", tmp_path / "res",
                      "--params", REPO / "params.yaml", "--experiment", "smoke", "--out", out)
    assert rc == 0 and out.exists(), err


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


def test_seeds_trained_before_a_setting_existed_are_still_one_experiment(tmp_path, capsys):
    a = make_run(tmp_path / "e", seed=1)
    make_run(tmp_path / "e", seed=2)
    cj = json.loads((a / "config.json").read_text())
    del cj["config"]["objective"]["ce_impl"]  # written by a version without it: its default then
    (a / "config.json").write_text(json.dumps(cj))
    rc, err = run_cli(capsys, "report", "tables", "--runs", tmp_path, "--out", tmp_path / "out")
    assert rc == 0, err
