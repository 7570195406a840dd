"""Every shell and Python snippet of README.md runs as written. Each ```bash / ```python block
carries a marker on the line before it: `<!-- readme-test: run -->` (executed, in README order,
in a temporary copy of the working tree; later blocks see what earlier ones made, e.g. the
one-minute start's results) or `<!-- readme-test: skip REASON -->` (needs GPUs, a cluster, the
network or a 20-minute grid: only checked to parse). ```console blocks are transcripts."""
from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from test_pipeline import copy_worktree, pipeline_env

REPO = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"(?:<!-- readme-test: (run|skip)(?: ([^>]*?))? -->\n)?```(\w*)\n(.*?)```", re.S)
CODE = ("bash", "sh", "python")


def blocks(text: str) -> list[tuple[str | None, str, str, str]]:
    """(marker, reason, language, code) of every fenced block."""
    return [(m.group(1), m.group(2) or "", m.group(3), m.group(4)) for m in BLOCK.finditer(text)]


README = (REPO / "README.md").read_text()


def test_every_snippet_is_marked_and_parses():
    found = [b for b in blocks(README) if b[2] in CODE]
    assert len(found) >= 8
    for marker, reason, lang, code in found:
        assert marker in ("run", "skip"), f"unmarked {lang} block:\n{code[:200]}"
        if marker == "skip":
            assert len(reason) > 10, f"a skipped block needs its reason:\n{code[:200]}"
        if lang == "python":
            ast.parse(code)
        else:
            subprocess.run(["bash", "-n"], input=code, text=True, check=True)
    assert found[0][0] == "run" and found[0][3].startswith("make smoke"), "the README starts with make smoke"
    assert "make reproduce" in found[1][3]


def test_the_smoke_time_quoted_is_the_recorded_one():
    import json
    rec = json.loads((REPO / "benchmarks" / "make-smoke.json").read_text())
    assert rec["command"] == "make smoke" and " ".join(rec["quoted"].split()) in " ".join(README.split())



def test_the_drift_law_figures_quoted_are_the_committed_ones():
    """The README's drift-law numbers are results/drift_law/drift_law.csv's, at the rounding
    it quotes them (held-out band to 10, the paper bands to 100)."""
    import pandas as pd
    t = pd.read_csv(REPO / "results" / "drift_law" / "drift_law.csv").set_index("kind", append=True)
    text = " ".join(README.split())

    def r(x, to):
        return f"{int(round(x / to) * to):,}"
    ho = t.xs("held-out", level="kind").iloc[0]
    assert f"predicted {r(ho.band_low, 10)}–{r(ho.band_high, 10)} at step {int(ho.step):,}" in text
    assert f"measured {r(ho.observed, 1)} ({ho.observed / (ho.band_low * ho.band_high) ** 0.5:.2f}×" in text
    paper = t.xs("paper", level="kind").set_index("target")
    for name in ("44M", "129M"):
        row = paper.loc[name]
        assert f"{r(row.band_low, 100)}–{r(row.band_high, 100)} for the {name} model" in text
    spread = [f"{r(paper.loc[n].exponent_spread_low, 100)}–{r(paper.loc[n].exponent_spread_high, 1000 if n == '129M' else 100)}"
              for n in ("44M", "129M")]
    assert f"the range is {spread[0]} and {spread[1]}" in text


def test_the_cpu_long_figures_quoted_are_the_committed_ones():
    """The README's cpu_long paragraph quotes results/cpu_long/claims.csv: the verdict count and
    claim (a)'s and (c)'s numbers."""
    import pandas as pd
    t = pd.read_csv(REPO / "results" / "cpu_long" / "claims.csv").set_index("id")
    text = " ".join(README.split())
    para = text[text.index("**The longer CPU study:**"):]
    para = para[:para.index("Analysis:")]
    n_ok = int(t.verdict.str.startswith("reproduced").sum())
    n_seeds = t.seeds_evaluated.max()
    if n_ok == len(t):
        assert f"All {n_ok} claims reproduce, each in {n_seeds}/{n_seeds} seeds" in para
    else:
        assert f"{n_ok} of {len(t)} claims reproduce" in para
    drift, raw, ratio = re.search(r"‖H_K‖ ([\d,.]+) vs ([\d,.]+) \(ratio ([\d,.]+)×\)", t.loc["a", "ours"]).groups()
    assert f"‖H_K‖ reaches {drift} with the RMSNorm readout" in para
    assert f"against {float(raw):.1f} raw ({float(ratio.replace(',', '')):.0f}×)" in para
    acc = re.search(r"‖H_K‖/‖H_1‖ ([\d.]+) with inter-loop norm vs ([\d.]+) residual", t.loc["c", "ours"]).groups()
    assert f"‖H_K‖/‖H_1‖ {acc[0]} against {acc[1]} residual" in para


@pytest.mark.slow
def test_the_readme_runs_as_written(tmp_path):
    repo = copy_worktree(tmp_path / "repo")
    os.symlink(Path(sys.executable).parents[1], repo / ".venv")  # the set-up's venv (make setup is done)
    env = pipeline_env(repo)
    shutil.rmtree("/tmp/loopscale-out", ignore_errors=True)  # the --directory example's folder
    for i, (marker, _, lang, code) in enumerate(blocks(README)):
        if marker != "run":
            continue
        if lang == "python":
            cmd = [sys.executable, "-c", code]
        else:  # make: its set-up target is this venv (never reinstall it from the copy)
            code = re.sub(r"^make (\w+)", r"make -o .venv/.installed \1", code, flags=re.M)
            cmd = ["bash", "-euo", "pipefail", "-c", code]
        proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=1800)
        assert proc.returncode == 0, f"README block {i} ({lang}) failed:\n{code}\n--- stderr\n{proc.stderr[-3000:]}"
        if "tok.encode(" in code:
            assert "['The', ' ', 'Congress', ' ', 'of'" in proc.stdout
    assert (repo / "results" / "smoke" / "REPORT.md").is_file()
    assert (repo / "runs" / "demo" / "rmsnorm" / "model.safetensors").is_file()
