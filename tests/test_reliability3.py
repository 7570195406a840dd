"""No run is ever silently mixed or lost: retrains, report grouping, duplicate YAML keys,
hostile arguments, signals (issue "Reliability 3", outside the artifact surfaces)."""
import json
import math
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
from test_report import make_run

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
    rc, err = run_cli(capsys, "report", "write", "--runs", tmp_path, "--results", tmp_path / "out",
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
