"""Every bad setting is caught before the first job, in one place (config.validate), by the
command line and the pipeline check alike: exit code 2, one line naming the key, nothing
written. (`snakemake -n` and `dvc repro` build the runs through the same check:
tests/test_pipeline.py::test_a_setting_out_of_range_stops_snakemake.)"""
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from loopscale import cli
from loopscale import config as C
from loopscale import pipeline as P
from loopscale.train import train

REPO = Path(__file__).resolve().parents[1]
SCHEMA = REPO / "workflow" / "schemas" / "params.schema.yaml"

# (key, value as YAML): each one a setting a job would fail on late, or run on silently
BAD = [
    ("eval.depth_factor", "0"),
    ("eval.lemma_loops", "1"),
    ("eval.norm_tokens", "-5"),
    ("eval.max_tokens", "-1"),
    ("eval.halting_epsilon", ".nan"),
    ("eval.throughput_batches", "0"),
    ("train.betas", "[2, 3]"),
    ("train.betas", "[0.9]"),
    ("train.weight_decay", "-1"),
    ("train.epochs", ".inf"),
    ("train.seed", str(2**70)),
    ("train.seed", "-1"),
    ("train.lr", ".inf"),
    ("train.lr", "0"),
    ("train.grad_clip", "0"),
    ("train.grad_clip", "-1"),
    ("train.grad_clip", ".nan"),
    ("train.threads", "-3"),
    ("train.eval_every", "-1"),
    ("train.max_steps", "0"),
    ("objective.penalty_weight", ".nan"),
    ("objective.ce_chunk_tokens", "0"),
    ("model.norm_eps", "-1"),
    ("model.dropout", "1.0"),
    ("model.n_loops", "0"),
    ("data.vocab_size", "4"),  # the 4 special tokens leave no room for a word
    ("data.min_frequency", "0"),
    ("data.split_seed", "-2"),
    ("data.max_documents", "-1"),
]
IDS = [f"{k}={v}" for k, v in BAD]


@pytest.fixture(scope="module")
def model(smoke_data, tmp_path_factory):
    run = tmp_path_factory.mktemp("settings") / "run"
    train(C.preset("smoke", {"train": {"max_steps": 2}}), smoke_data, run, progress=False)
    return run / "model.pt"


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize("key,value", BAD, ids=IDS)
def test_the_command_line_refuses_it(key, value, smoke_data, model, tmp_path, capsys):
    out = tmp_path / "out"
    if key.startswith("eval."):
        args = ["eval", "depth", "--model", str(model), "--data", str(smoke_data), "--out", str(out / "d.json")]
    else:
        args = ["train", "--preset", "smoke", "--data", str(smoke_data), "--out", str(out)]
    rc = cli.main([*args, "--set", f"{key}={value}"])
    err = one_line(capsys)
    assert rc == 2 and err.startswith("loopscale: error:") and key in err
    assert not out.exists()


def _params_with(key: str, value: str) -> dict:
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    exp = params["experiments"]["smoke"]
    section, name = key.split(".")
    if key == "train.seed":  # the pipeline's seeds come from `seeds:`
        exp["seeds"] = [yaml.safe_load(value)]
    elif section in ("train", "eval", "data"):
        exp[section] = {**(exp.get(section) or {}), name: yaml.safe_load(value)}
    else:
        exp["sizes"]["smoke"]["overrides"] = {section: {name: yaml.safe_load(value)}}
    return params


@pytest.mark.parametrize("key,value", BAD, ids=IDS)
def test_the_pipeline_check_refuses_it(key, value, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(_params_with(key, value), sort_keys=False))
    rc = P.main(["check", "--params", "params.yaml", "--schema", str(SCHEMA), "--experiment", "smoke"])
    err = one_line(capsys)
    assert rc == 2 and err.startswith("loopscale pipeline: error:")
    assert ("experiments.smoke.seeds" if key == "train.seed" else key) in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["params.yaml"]


def test_every_numeric_setting_has_a_range():
    """Each numeric field declares its Range on its annotation (config.rules reads them)."""
    for cls in (C.ModelConfig, C.ObjectiveConfig, C.DataConfig, C.TrainConfig, C.EvalConfig):
        rules = C.rules(cls)
        assert set(rules) == {f.name for f in dataclasses.fields(cls)}
        for name, rule in rules.items():
            assert (rule.bound is not None) == (rule.type in (int, float)), f"{cls.__name__}.{name}"


def test_good_values_at_the_edges_pass():
    C.preset("smoke", {"train": {"seed": 0, "weight_decay": 0, "betas": [0, 0.999], "threads": 0},
                       "model": {"dropout": 0}, "data": {"vocab_size": 5}, "objective": {"penalty_weight": 0}})
    C.eval_preset("smoke", {"depth_factor": 1, "lemma_loops": 2, "halting_epsilon": 0, "max_tokens": 0})


@pytest.mark.parametrize("typo, named, meant", [("train.max_stepz", "train.max_stepz", "train.max_steps"),
                                                ("model.d_modle", "model.d_modle", "model.d_model"),
                                                ("objectiv.loss", "objectiv", "objective")])
def test_an_unknown_key_is_named_as_given_with_the_closest_known_one(typo, named, meant, capsys):
    """`--set train.max_stepz=5` names `train.max_stepz` (no internal prefix) and suggests the
    closest known key (difflib); a key like no known one gets no suggestion."""
    rc = cli.main(["params", "--preset", "smoke", "--set", f"{typo}=5"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert f"unknown key '{named}'; did you mean '{meant}'?" in err[0] and "override" not in err[0]
    with pytest.raises(C.ConfigError) as e:
        C.resolve(preset_name="smoke", overrides=["train.qqqqqq=1"])
    assert str(e.value) == "unknown key 'train.qqqqqq'"


def test_version_and_the_presets_in_train_help(capsys):
    """`loopscale --version`; `loopscale train --help` names every preset of the preset table."""
    import loopscale
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"loopscale {loopscale.__version__}"
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert C.MODEL_PRESETS and all(name in text.replace("- ", "-") for name in C.MODEL_PRESETS)


def test_the_params_schema_of_the_settings_is_generated_from_the_dataclasses():
    """The end of params.schema.yaml is what tools/settings_schema.py writes from
    config.settings_schemas(), and it refuses a setting's bad key, type, range or fixed choice
    by itself, in the config's words after the params key of the setting's section."""
    tool = subprocess.run([sys.executable, str(REPO / "tools" / "settings_schema.py"), "--check"],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    assert tool.returncode == 0, tool.stderr
    assert "  TrainConfig:" in SCHEMA.read_text()
    schema = P.load_schema(SCHEMA)
    for key, value, message in [("train.max_stepz", "5", "unknown key 'experiments.smoke.train.max_stepz'; "
                                 "did you mean 'experiments.smoke.train.max_steps'?"),
                                ("train.lr", "abc", None),
                                ("train.lr", "0", "experiments.smoke.train: train.lr must be a finite number > 0, got 0"),
                                ("train.threads", "true", "train: train.threads must be an integer, got True"),
                                ("eval.device", "gpu", "eval: eval.device: unknown value 'gpu'; choose one of auto, cpu"),
                                ("model.dropout", "1", "overrides.model: model.dropout must be a finite number in [0, 1)"),
                                ("model.n_loopz", "1", "unknown key 'experiments.smoke.sizes.smoke.overrides.model."
                                 "n_loopz'; did you mean 'experiments.smoke.sizes.smoke.overrides.model.n_loops'?")]:
        params = _params_with(key, value)
        if message is None:  # a string where a number goes: the schema lets it through, the config refuses it
            P.check_schema(params, schema)
            continue
        with pytest.raises(P.ParamsError) as e:
            P.check_schema(params, schema)
        assert key in str(e.value) and message in str(e.value)
