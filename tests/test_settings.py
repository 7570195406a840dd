"""Every bad setting is caught before the first job, in one place (config.validate), by the
command line and the pipeline check alike: exit code 2, one line naming the key, nothing
written. (`snakemake -n` and `dvc repro` build the runs through the same check:
tests/test_pipeline.py::test_a_setting_out_of_range_stops_snakemake.)"""
import copy
import dataclasses
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from loopscale import cli
from loopscale import config as C
from loopscale import pipeline as P
from loopscale.config import LIMITS, ConfigError, load_eval_config
from loopscale.train import train

from cli_support import refused_in_one_line as one_line_error

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


SMOKE = ["--preset", "smoke", "--set", "model.dropout=0.1", "--set", "train.threads=1",
         "--set", "train.log_every=5", "--set", "train.ckpt_every=10"]


def digest(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


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


# ---------------------------------------------------------------------------
# the one table of limits (config.LIMITS): configs, --set, the pipeline's grid
# ---------------------------------------------------------------------------
class TestLimits:
    @pytest.mark.parametrize("override", [f"eval.depth_factor={10**6}", f"eval.lemma_loops={10**9}",
                                          "eval.batch_size=0"])
    def test_eval_settings_are_bounded(self, override):
        with pytest.raises(ConfigError, match=override.split("=")[0]):
            load_eval_config(overrides=[override])

    @pytest.mark.parametrize("key", ["vocab_size", "n_layers", "seq_len", "d_model", "n_loops"])
    def test_model_sizes_are_bounded_in_every_config(self, key, capsys):
        one_line_error(capsys, ["params", "--preset", "smoke", "--set", f"model.{key}={LIMITS[key] + 1}"],
                       f"model.{key}")

    def test_the_readers_share_the_table(self):
        from loopscale import artifacts
        assert all(artifacts.LIMITS[k] == LIMITS[k] for k in artifacts.LIMITS)

    def test_an_experiment_grid_is_bounded_before_anything_is_written(self, tmp_path):
        from loopscale.pipeline import ParamsError, build_experiment, load_params
        params = load_params(str(Path(__file__).parent.parent / "params.yaml"))
        name = next(iter(params["experiments"]))
        big = copy.deepcopy(params)
        big["experiments"][name]["seeds"] = list(range(LIMITS["grid_runs"] + 1))
        with pytest.raises(ParamsError, match="grid_runs"):
            build_experiment(big, name)
