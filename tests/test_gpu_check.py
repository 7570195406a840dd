"""benchmarks/gpu_check.py and benchmarks/gpu_bench.py, run on this CPU at toy size.

The GPU check must leave usable JSON however it ends: every part's file parses and holds
finite figures, a part killed at its time budget is recorded as cut short, and the parts
after it still run and write theirs."""
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = REPO / "benchmarks"


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


gpu_check = _module("gpu_check")


def numbers(obj, where="$"):
    """Every number in a JSON value, with its path."""
    if isinstance(obj, bool):
        return
    if isinstance(obj, (int, float)):
        yield where, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from numbers(v, f"{where}.{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from numbers(v, f"{where}[{i}]")


def assert_finite(obj):
    bad = [(w, v) for w, v in numbers(obj) if not math.isfinite(v)]
    assert not bad, f"non-finite figures: {bad[:5]}"


LOG_EVERY, MAX_STEPS = 5, 12
ENV_S = 0.05  # the env part's budget: killed before it imports torch


@pytest.fixture(scope="module")
def check(smoke_data, tmp_path_factory):
    """One tiny run of every part on the CPU, the env part given a budget too small to start
    in: 50 ms, while importing torch alone takes several hundred. Bench must measure its own
    peak: the env part was killed (and bench ignores the peak of an env part that did not finish
    "ok", even one written before the kill). The output folder holds an earlier run's env.json,
    which must not survive."""
    out = tmp_path_factory.mktemp("gpu-check")
    (out / "env.json").write_text(json.dumps({"part": "env", "status": "ok", "peak": {"flop_per_s": 1e30}}))
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    cmd = [sys.executable, str(BENCHMARKS / "gpu_check.py"), "--device", "cpu", "--tiny", "--out", str(out),
           "--data", str(smoke_data), "--budget-s", "300", "--env-s", str(ENV_S), "--drift-s", "60", "--no-compile",
           "--log-every", str(LOG_EVERY), "--drift-max-steps", str(MAX_STEPS)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    return out, proc


@pytest.mark.slow  # one run of the whole script: about a minute on 2 cores
def test_every_part_writes_json_and_the_cut_short_part_is_recorded(check):
    out, proc = check
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]  # 1: not every part ok (env cut)
    summary = json.loads((out / "gpu_check.json").read_text())
    assert summary["finished"] is True
    status = {p: e["status"] for p, e in summary["parts"].items()}
    assert status == {"env": "timeout", "tests": "ok", "bench": "ok", "drift": "ok"}, proc.stdout[-3000:]
    assert summary["parts"]["env"]["budget_s"] == ENV_S
    for part in gpu_check.PARTS:
        data = json.loads((out / f"{part}.json").read_text())
        assert data["part"] == part and data["status"] == status[part]
        assert data["elapsed_s"] <= data["budget_s"] + 20  # killed at the budget (plus the kill's grace)
        assert_finite(data)
        if part != "env":
            assert data["forbidden_imports"] == []  # nothing the GPU machine lacks was imported
    env = json.loads((out / "env.json").read_text())
    assert "cut_short" in env and env["returncode"] != 0
    assert "===== env: killed at its budget" in (out / "gpu_check.log").read_text()
    assert not list(out.glob(".*.tmp"))
    assert len(list(out.iterdir())) <= 8  # the GPU machine sends back at most 8 files


@pytest.mark.slow  # one run of the whole script: about a minute on 2 cores
def test_bench_part_measures_every_model_without_the_env_peak(check):
    out, _ = check
    bench = json.loads((out / "bench.json").read_text())["bench"]
    assert bench["peak"]["source"] == "measured here" and bench["peak"]["flop_per_s"] > 0  # env was cut short
    assert bench["done"] is True and bench["tiny"] is True
    for name in ("paper-44m", "paper-129m"):
        rec = bench["models"][name]
        assert "compiled" not in rec  # --no-compile
        assert rec["eager"]["tokens_per_s"] > 0 and rec["eager"]["mfu"] > 0
        assert [r["k"] for r in rec["eval"]["depth"]] == list(range(1, rec["config"]["model"]["n_loops"] + 1))


def test_env_part_records_the_versions_and_a_bf16_peak(tmp_path):
    result = {"status": "running"}
    a = SimpleNamespace(device="cpu", tiny=True)
    gpu_check.part_env(a, result, lambda: None, 20)
    assert result["env"]["torch"] == torch.__version__ and result["env"]["device"] == "cpu"
    assert result["env"]["pytest"] == "installed"
    assert result["peak"]["dtype"] == "bfloat16" and result["peak"]["flop_per_s"] > 0
    assert result["peak"]["tflop_per_s"] == pytest.approx(result["peak"]["flop_per_s"] / 1e12)


@pytest.mark.slow  # one run of the whole script: about a minute on 2 cores
def test_tests_part_counts_the_cuda_tests(check):
    out, _ = check
    tests = json.loads((out / "tests.json").read_text())
    c = tests["counts"]
    assert c["tests"] == len(tests["outcomes"]) > 0
    assert c["tests"] == c["passed"] + c["failed"] + c["errors"] + c["skipped"]
    if not torch.cuda.is_available():  # here: every cuda test skips cleanly
        assert c["skipped"] == c["tests"] and set(tests["outcomes"].values()) == {"SKIPPED"}
    assert all(name.startswith("tests/test_cuda.py::") for name in tests["outcomes"])
    assert json.loads((out / "gpu_check.json").read_text())["parts"]["tests"]["counts"] == c


@pytest.mark.slow  # one run of the whole script: about a minute on 2 cores
def test_drift_part_logs_norms_per_loop_and_ends_with_diagnostics(check, smoke_data):
    out, _ = check
    drift = json.loads((out / "drift.json").read_text())
    meta = json.loads((smoke_data / "meta.json").read_text())
    assert drift["data"]["vocab_size"] == meta["vocab_size"]
    assert list(drift["readouts"]) == ["rmsnorm", "raw"]
    for readout, rec in drift["readouts"].items():
        K = rec["config"]["n_loops"]
        assert rec["config"]["readout"] == readout and rec["config"]["precision"] == "bf16"
        assert rec["steps"] == MAX_STEPS and rec["stopped_by"] == "max steps"
        assert [r["step"] for r in rec["log"]] == [1] + list(range(LOG_EVERY, MAX_STEPS + 1, LOG_EVERY))
        assert all(len(r["norm"]) == K and min(r["norm"]) > 0 for r in rec["log"])
        assert len(rec["final_validation"]["norm"]) == K and rec["final_validation"]["tokens"] > 0
        assert [r["k"] for r in rec["radial"]] == list(range(1, K + 1))
        assert all(0 <= r["radial_fraction"] <= 1 for r in rec["radial"])
    # the RMSNorm readout cannot see the scale: its radial gradient is (numerically) zero
    assert max(r["radial_fraction"] for r in drift["readouts"]["rmsnorm"]["radial"]) < 1e-6
    assert min(r["radial_fraction"] for r in drift["readouts"]["raw"]["radial"]) > 1e-6
    assert drift["final_norm_ratio_rmsnorm_over_raw"] > 0


def test_gpu_bench_at_toy_size_records_mfu_eval_and_the_paper_figures(tmp_path, one_thread):
    gpu_bench = _module("gpu_bench")
    models = ["paper-44m", "paper-129m"]
    saved = []
    r = gpu_bench.run(tmp_path / "bench.json", device="cpu", models=models, steps=1, warmup=1, compile=False,
                      tiny=True, budget_s=120, log=lambda s: None, on_save=lambda d: saved.append(d["elapsed_s"]))
    assert json.loads((tmp_path / "bench.json").read_text()) == json.loads(json.dumps(r))
    assert len(saved) >= 1 + 2 * len(models)  # the peak, then every measurement
    assert_finite({k: v for k, v in r.items() if k != "paper_eval_tokens_per_s"})
    assert r["peak"]["flop_per_s"] > 0
    for name in models:
        rec = r["models"][name]
        eager = rec["eager"]
        assert eager["tokens_per_s"] > 0 and 0 < eager["mfu"] == pytest.approx(eager["flop_per_s"] / r["peak"]["flop_per_s"])
        K = rec["config"]["model"]["n_loops"]
        rows = rec["eval"]["depth"]
        assert [row["k"] for row in rows] == list(range(1, K + 1))
        paper = gpu_bench.PAPER_EVAL_TOKENS_PER_S.get(name, {})
        for row in rows:
            assert row["paper_tokens_per_s"] == paper.get(row["k"])
            if row["k"] in paper:
                assert row["ratio_to_paper"] == pytest.approx(row["tokens_per_s"] / paper[row["k"]])
    assert gpu_bench.PAPER_EVAL_TOKENS_PER_S["paper-129m"] == {1: 80_000, 2: 41_000, 3: 28_000, 4: 21_000}


def test_a_bench_budget_too_small_skips_the_measurements(tmp_path):
    gpu_bench = _module("gpu_bench")
    r = gpu_bench.run(tmp_path / "bench.json", device="cpu", models=["paper-44m"], steps=1, warmup=0,
                      compile=True, tiny=True, budget_s=0.01, log=lambda s: None)
    assert set(r["models"]["paper-44m"]) == {"eager", "compiled"}
    assert all("time budget" in v["skipped"] for v in r["models"]["paper-44m"].values())


def test_pytest_missing_is_recorded(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(gpu_check.importlib.util, "find_spec", lambda name, *a: None if name == "pytest" else real(name, *a))
    result = {"status": "running"}
    gpu_check.part_tests(None, result, lambda: None, 10)
    assert result == {"status": "skipped", "reason": "pytest missing"}


@pytest.mark.parametrize("args, flag", [(["--budget-s", "0"], "--budget-s"), (["--drift-s", "nan"], "--drift-s"),
                                        (["--parts", "env,gpu"], "--parts"), (["--readouts", "none"], "--readouts"),
                                        (["--steps", "0"], "--steps")])
def test_bad_settings_are_one_line_errors(args, flag, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        gpu_check.main(["--out", str(tmp_path / "o"), *args])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert flag in err
    assert not (tmp_path / "o").exists()  # nothing was written
