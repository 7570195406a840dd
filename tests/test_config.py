"""Settings files as given (config.read_yaml and the layering of file, preset and --set):
duplicate keys, odd files, resource bombs are one line, never a traceback; merge keys still work."""
import time

import pytest
import yaml

from loopscale import cli, pipeline as P
from loopscale.config import ConfigError, MAX_YAML_NODES, read_yaml

from cli_support import one_line_error, run_cli


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


BOMB = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 10)}]\n" for i in range(8))


def resolved(capsys, *args) -> dict:
    assert cli.main(["config", *args]) == 0
    return yaml.safe_load(capsys.readouterr().out)


def test_a_file_value_equal_to_the_default_survives_a_preset(tmp_path, capsys):
    f = tmp_path / "run.yaml"
    f.write_text("train: {lr: 3.0e-4, batch_size: 64}\nmodel: {readout: raw}\n")  # both global defaults
    cfg = resolved(capsys, "--config", str(f), "--preset", "cpu")
    assert cfg["train"]["lr"] == 3e-4 and cfg["train"]["batch_size"] == 64  # the cpu preset says 1e-3, 16
    assert cfg["model"]["readout"] == "raw" and cfg["model"]["d_model"] == 64  # the rest from the preset
    assert resolved(capsys, "--config", str(f), "--preset", "cpu", "--set", "train.lr=0.5")["train"]["lr"] == 0.5


def test_a_file_naming_another_preset_than_the_command_line_is_refused(tmp_path, capsys):
    f = tmp_path / "run.yaml"
    f.write_text("preset: smoke\n")
    assert resolved(capsys, "--config", str(f))["model"]["d_model"] == 32
    assert cli.main(["config", "--config", str(f), "--preset", "cpu"]) == 2
    assert "names preset 'smoke' but --preset is 'cpu'" in capsys.readouterr().err


def _bad_files(tmp_path):
    (tmp_path / "latin1.yaml").write_bytes("train: {lr: 0.001}  # café\n".encode("latin-1"))
    (tmp_path / "list.yaml").write_text("- train\n- model\n")
    (tmp_path / "bomb.yaml").write_text(BOMB)
    (tmp_path / "self.yaml").write_text("a: &a [1, *a]\n")
    return {"a directory": (tmp_path, "is a directory"),
            "not UTF-8": (tmp_path / "latin1.yaml", "not UTF-8"),
            "not a mapping": (tmp_path / "list.yaml", "must hold a mapping at top level, got list"),
            "an alias bomb": (tmp_path / "bomb.yaml", f"more than {MAX_YAML_NODES:,} nodes"),
            "a recursive alias": (tmp_path / "self.yaml", "refers to the node that holds it"),
            "missing": (tmp_path / "nope.yaml", "file not found")}


@pytest.mark.parametrize("case", ["a directory", "not UTF-8", "not a mapping", "an alias bomb",
                                  "a recursive alias", "missing"])
def test_a_bad_config_file_is_one_line(case, tmp_path, capsys):
    path, needle = _bad_files(tmp_path)[case]
    t0 = time.monotonic()
    rc = cli.main(["config", "--config", str(path), "-o", str(tmp_path / "out.yaml")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and needle in err and str(path) in err, err
    assert not (tmp_path / "out.yaml").exists()
    assert time.monotonic() - t0 < 10  # refused at once, not after expanding the aliases


@pytest.mark.parametrize("case", ["not UTF-8", "an alias bomb"])
def test_a_bad_params_file_stops_the_pipeline_check(case, tmp_path, capsys):
    path, needle = _bad_files(tmp_path)[case]
    rc = P.main(["check", "--params", str(path)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and needle in err, err


def test_yaml_merge_keys_and_small_aliases_still_work(tmp_path):
    f = tmp_path / "ok.yaml"
    f.write_text("base: &b {lr: 0.1, batch_size: 4}\ntrain:\n  <<: *b\n  lr: 0.2\n")
    assert read_yaml(f)["train"] == {"lr": 0.2, "batch_size": 4}
