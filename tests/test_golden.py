"""Golden tests (issue 31, "One design"): the current code's outputs equal the numbers recorded in
tests/golden/*.json by tests/golden/make_golden.py, to float rounding. A redesign with its
behaviour unchanged passes them untouched; a change of behaviour is a rerun of make_golden.py
in a commit that says so (its module docstring).

  smoke       the `smoke` experiment through Snakemake: summary.json, eval/*.json, results/smoke/*.csv
  ouro_smoke  the `ouro-smoke` preset trained a few steps: per-step losses, per-exit logits
  official    the bundled official checkpoints converted by `loopscale convert-paper`: per-exit logits
  hf_run      a trained run through transformers (trust_remote_code): logits at n_loops = 1..K+1,
              exit logits, greedy generation
  run_v1      tests/fixtures/run_v1/ (a run directory in the layout of issue 31's start) read by
              loopscale.load (of the directory and of its model.pt alone) and transformers: the recorded logits

Tolerances, and why:
  * floats of a forward pass (logits, their sums, CE): rtol 1e-5, atol 1e-6. The same fp32
    operations on CPU with one thread give the same bits; the tolerance admits a reordered sum
    (a few ulps of fp32, 1.2e-7 each, over d_model-long dot products), nothing more.
  * a sum over a whole logits tensor: |got - want| <= 1e-5 * sum|z| (the rounding of each term
    adds up: relative to the sum of magnitudes, not to a sum that may cancel to ~0).
  * numbers after training (losses, metrics, tables): rtol 1e-5, atol 1e-6 as well: a few
    AdamW steps at lr 1e-3 do not amplify a last-bit difference past that. Tables hold 8
    significant digits (%.8g), far below the tolerance.
  * token ids (argmax, generation), integers, strings, keys, table columns and rows: exact.
"""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "golden"))
import make_golden as G  # noqa: E402

RTOL, ATOL = 1e-5, 1e-6


def golden(name: str) -> dict:
    path = G.GOLDEN / f"{name}.json"
    assert path.is_file(), f"{path} missing: run tests/golden/make_golden.py {name}"
    return json.loads(path.read_text())


@pytest.fixture(autouse=True)
def deterministic():
    threads = torch.get_num_threads()
    was = torch.are_deterministic_algorithms_enabled()
    G.deterministic()
    yield
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(was)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A folder shared by the module's tests (the tiny corpus is prepared once)."""
    return tmp_path_factory.mktemp("golden")


# ---------------------------------------------------------------------------
# comparison
# ---------------------------------------------------------------------------
def same(got, want, where: str = "") -> None:
    """got equals want: same keys, same lengths, exact ints/strings/bools, floats to RTOL/ATOL."""
    if isinstance(want, dict):
        assert isinstance(got, dict), f"{where}: {type(got).__name__}, want a dict"
        assert sorted(got) == sorted(want), \
            f"{where}: keys differ: extra {sorted(set(got) - set(want))}, missing {sorted(set(want) - set(got))}"
        for k in want:
            same(got[k], want[k], f"{where}.{k}" if where else str(k))
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), \
            f"{where}: {got!r:.200} has another length than {want!r:.200}"
        for i, (g, w) in enumerate(zip(got, want)):
            same(g, w, f"{where}[{i}]")
    elif isinstance(want, float) or (isinstance(got, float) and isinstance(want, int) and not isinstance(want, bool)):
        assert isinstance(got, (int, float)) and not isinstance(got, bool), f"{where}: {got!r}, want {want!r}"
        if math.isnan(want):
            assert math.isnan(got), f"{where}: {got!r}, want nan"
        else:
            assert got == pytest.approx(want, rel=RTOL, abs=ATOL), f"{where}: {got!r}, want {want!r}"
    elif isinstance(want, str) and isinstance(got, str) and got != want:
        same_text(got, want, where)
    else:  # int, str, bool, None: exact
        assert type(got) is type(want) and got == want, f"{where}: {got!r}, want {want!r}"


NUMBER = re.compile(r"[-+]?(?:\d[\d,]*(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")  # 4, 483,482, 61787.7, 5.8e-14


def _printed(text: str) -> tuple[float, float]:
    """(value, one unit of its last printed digit) of a number as a table prints it; a bare
    integer (a count, K=4) gets no slack."""
    mant, _, exp = text.replace(",", "").lower().partition("e")
    decimals = len(mant.partition(".")[2])
    if not exp and "." not in mant and "," not in text:
        return float(mant), 0.0
    return float(text.replace(",", "")), 10.0 ** (int(exp or 0) - decimals)


def same_text(got: str, want: str, where: str) -> None:
    """Two table cells that print numbers: the words exact, each number to RTOL/ATOL or one unit of
    its last printed digit (float rounding can flip a printed 61787.75 either way, and a residue
    such as 5.8e-14 vs 6.0e-14 is the same zero); bare integers exact."""
    g_nums, w_nums = NUMBER.findall(got), NUMBER.findall(want)
    assert NUMBER.split(got) == NUMBER.split(want) and len(g_nums) == len(w_nums), f"{where}: {got!r}, want {want!r}"
    for g, w in zip(g_nums, w_nums):
        (gv, _), (wv, unit) = _printed(g), _printed(w)
        assert abs(gv - wv) <= max(unit * (1 + 1e-9), RTOL * abs(wv), ATOL if unit else 0), \
            f"{where}: {got!r}, want {want!r}"


def same_logits(got: dict, want: dict, where: str) -> None:
    """Two exit_summary records: whole-tensor sums to RTOL * sum|z|, the rest with same()."""
    assert got["shape"] == want["shape"], f"{where}: shape {got['shape']}, want {want['shape']}"
    assert abs(got["sum"] - want["sum"]) <= RTOL * want["sum_abs"] + ATOL, \
        f"{where}: sum {got['sum']!r}, want {want['sum']!r}"
    rest = ("sum", "shape")
    same({k: v for k, v in got.items() if k not in rest}, {k: v for k, v in want.items() if k not in rest}, where)


def same_exits(got: list, want: list, where: str) -> None:
    assert len(got) == len(want), f"{where}: {len(got)} exits, want {len(want)}"
    for k, (g, w) in enumerate(zip(got, want), 1):
        same_logits(g, w, f"{where} exit {k}")


# ---------------------------------------------------------------------------
# the comparison can fail
# ---------------------------------------------------------------------------
def test_the_comparison_catches_a_changed_number():
    rec = golden("run_v1")["exits"][0]
    same_logits(rec, rec, "itself")
    moved = json.loads(json.dumps(rec))
    moved["first_row"][0] += 1e-3 * (1 + abs(moved["first_row"][0]))
    with pytest.raises(AssertionError, match="first_row"):
        same_logits(moved, rec, "moved")
    flipped = json.loads(json.dumps(rec))
    flipped["argmax"][0][0] += 1
    with pytest.raises(AssertionError, match="argmax"):
        same_logits(flipped, rec, "flipped")
    with pytest.raises(AssertionError, match="keys differ"):
        same({"a": 1.0, "b": 2}, {"a": 1.0}, "extra")
    same("max 6.0e-14 (1 condition(s)); mean 1.9e-01", "max 5.8e-14 (1 condition(s)); mean 1.9e-01", "residue")
    same("483,482 (R=61787.7%)", "483,482 (R=61787.8%)", "last digit")  # a rounding flip
    for got, want in (("mean 2.1e-01", "mean 1.9e-01"), ("R=61780.5%", "R=61787.8%"), ("483,582", "483,482"),
                      ("K=5", "K=4")):
        with pytest.raises(AssertionError, match="text"):
            same(got, want, "text")
    with pytest.raises(AssertionError, match="words"):
        same("min 6.0e-14", "max 6.0e-14", "words")


# ---------------------------------------------------------------------------
# a. the smoke experiment (Snakemake, whole)
# ---------------------------------------------------------------------------
@pytest.mark.slow
def test_smoke_experiment_metrics_and_tables(smoke_local):
    want = golden("smoke")
    repo, _ = smoke_local
    got = G.smoke_record(repo)
    assert got["settings"] == want["settings"], \
        "params.yaml's smoke experiment changed: the golden smoke.json records other settings"
    assert sorted(got["runs"]) == sorted(want["runs"]), "the smoke runs differ"
    for run, files in want["runs"].items():
        assert sorted(got["runs"][run]) == sorted(files), f"{run}: other files {sorted(got['runs'][run])}"
        for name, rec in files.items():
            same(got["runs"][run][name], rec, f"{run}/{name}")
    assert sorted(got["tables"]) == sorted(want["tables"]), "results/smoke holds other tables"
    for name, table in want["tables"].items():
        g = got["tables"][name]
        assert g["columns"] == table["columns"], f"{name}: columns {g['columns']}, want {table['columns']}"
        assert len(g["rows"]) == len(table["rows"]), f"{name}: {len(g['rows'])} rows, want {len(table['rows'])}"
        for i, (row, wrow) in enumerate(zip(g["rows"], table["rows"])):
            same([_cell(c) for c in row], [_cell(c) for c in wrow], f"{name} row {i}")


def _cell(text: str):
    """A CSV cell as a number where it is one (compared to RTOL), else its text (exact)."""
    try:
        return float(text) if any(ch.isdigit() for ch in text) else text
    except ValueError:
        return text


# ---------------------------------------------------------------------------
# b. the ouro-smoke preset, trained a few steps
# ---------------------------------------------------------------------------
def test_ouro_smoke_losses_and_exit_logits(workdir):
    want = golden("ouro_smoke")
    got = G.ouro_record(workdir)
    assert got["settings"] == want["settings"]
    same(got["metrics"], want["metrics"], "metrics.jsonl")
    same(got["summary"], want["summary"], "summary.json")
    assert got["ids"] == want["ids"]
    same_exits(got["exits"], want["exits"], "ouro-smoke")


# ---------------------------------------------------------------------------
# c. the official checkpoints, converted
# ---------------------------------------------------------------------------
def test_official_checkpoints_convert_to_the_recorded_exit_logits(workdir):
    other = os.environ.get("LOOPSCALE_OFFICIAL_FIXTURES")
    if other and Path(other).resolve() != G.OFFICIAL.resolve():
        pytest.skip(f"LOOPSCALE_OFFICIAL_FIXTURES={other}: the golden logits are those of the bundled set "
                    f"{G.OFFICIAL}; unset it to compare")
    want = golden("official")
    got = G.official_record(workdir)
    assert got["settings"] == want["settings"]
    assert sorted(got["checkpoints"]) == sorted(want["checkpoints"]), "the bundled official checkpoints changed"
    for name, rec in want["checkpoints"].items():
        assert got["checkpoints"][name]["windows"] == rec["windows"]
        same_exits(got["checkpoints"][name]["exits"], rec["exits"], name)


# ---------------------------------------------------------------------------
# d. a trained run through Hugging Face
# ---------------------------------------------------------------------------
def test_hf_logits_at_every_depth_and_greedy_generation(workdir):
    pytest.importorskip("transformers")
    want = golden("hf_run")
    got = G.hf_record(workdir)
    assert got["settings"] == want["settings"]
    same(got["metrics"], want["metrics"], "metrics.jsonl")
    assert (got["ids"], got["prompt_ids"], got["n_loops"]) == (want["ids"], want["prompt_ids"], want["n_loops"])
    assert sorted(got["logits"]) == sorted(want["logits"])
    for n, rec in want["logits"].items():
        same_logits(got["logits"][n], rec, f"n_loops={n}")
    same_exits(got["exit_logits"], want["exit_logits"], "exit_logits")
    assert got["generated"] == want["generated"], "the greedy generation changed"


# ---------------------------------------------------------------------------
# e. a run directory of the current layout still loads, through every reader
# ---------------------------------------------------------------------------
def test_run_v1_fixture_holds_the_recorded_files():
    want = golden("run_v1")
    assert sorted(p.name for p in G.FIXTURE_RUN.iterdir()) == want["settings"]["files"]


def test_run_v1_loads_through_loopscale_load():
    want = golden("run_v1")
    got = G.readers_record(G.FIXTURE_RUN)
    assert got["ids"] == want["ids"]
    same_exits(got["exits"], want["exits"], "loopscale.load")


def test_run_v1_model_pt_loads_alone():
    """model.pt on its own (what `loopscale eval` and `loopscale export` read)."""
    from loopscale import load
    want = golden("run_v1")
    model, _, _ = load(G.FIXTURE_RUN / "model.pt")
    model.eval()
    same_exits(G.exit_summaries(model, torch.tensor(want["ids"])), want["exits"], "loopscale.load(model.pt)")


def test_run_v1_loads_through_hugging_face():
    """AutoModelForCausalLM with the classes the current loopscale registers (loopscale.hf)."""
    transformers = pytest.importorskip("transformers")
    import loopscale.hf  # noqa: F401  (registers the classes with the Auto classes)
    want = golden("run_v1")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(G.FIXTURE_RUN))
    assert type(model).__module__ == "loopscale.hf"
    model.eval()
    with torch.no_grad():
        out = model(torch.tensor(want["ids"]), output_hidden_states=True)
    same_exits([G.summary(z) for z in out.exit_logits], want["exits"], "transformers")
    same_logits(G.summary(out.logits), want["exits"][-1], "transformers logits")


@pytest.mark.slow  # a fresh Python process importing transformers
def test_run_v1_loads_through_its_bundled_remote_code(tmp_path):
    """In a fresh process without loopscale: trust_remote_code=True runs the run's own
    modeling_loopscale.py (the code of the run's time) and gives the recorded exit logits."""
    pytest.importorskip("transformers")
    want = golden("run_v1")
    code = f"""
import json, sys
sys.path.insert(0, {str(G.GOLDEN)!r})
import make_golden as G
import torch
from transformers import AutoModelForCausalLM
G.deterministic()
m = AutoModelForCausalLM.from_pretrained({str(G.FIXTURE_RUN)!r}, trust_remote_code=True).eval()
# the bundled package runs under its own name, _loopscale_<hash>
assert "loopscale" not in sys.modules and type(m).__module__.startswith("_loopscale_"), type(m).__module__
with torch.no_grad():
    out = m(torch.tensor({want["ids"]!r}), output_hidden_states=True)
print(json.dumps([G.summary(z) for z in out.exit_logits]))
"""
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    same_exits(json.loads(r.stdout.strip().splitlines()[-1]), want["exits"], "bundled remote code")
