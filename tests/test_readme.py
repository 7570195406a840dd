"""Every shell and Python snippet of README.md and the usage pages runs as written, and every
figure the README and docs/results.md quote is the committed result files' (tests/figures.py).

Snippets: every shell and Python snippet of README.md, docs/usage.md and docs/integrations.md
(RUN_DOCS, run in that order) runs as written. Each ```bash / ```python block
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

import figures
from workflow_support import copy_worktree, pipeline_env

REPO = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"(?:<!-- readme-test: (run|skip)(?: ([^>]*?))? -->\n)?```(\w*)\n(.*?)```", re.S)
CODE = ("bash", "sh", "python")


def blocks(text: str) -> list[tuple[str | None, str, str, str]]:
    """(marker, reason, language, code) of every fenced block."""
    return [(m.group(1), m.group(2) or "", m.group(3), m.group(4)) for m in BLOCK.finditer(text)]


README = (REPO / "README.md").read_text()
RUN_DOCS = ("README.md", "docs/usage.md", "docs/integrations.md")
RESULTS = (REPO / "docs" / "results.md").read_text()


def all_blocks():
    return [b for doc in RUN_DOCS for b in blocks((REPO / doc).read_text())]


def test_every_snippet_is_marked_and_parses():
    found = [b for b in all_blocks() if b[2] in CODE]
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
    assert "make reproduce" in found[1][3] and "make test" in found[1][3]


def test_the_first_screen_is_the_findings_the_figure_the_claims_and_the_commands():
    """Everything before the README's first section heading: what the paper and loopscale found,
    the headline figure, the claims table and the three commands, in at most 70 lines."""
    first = README.split("\n## ", 1)[0]
    assert len(first.splitlines()) <= 70, f"the first screen is {len(first.splitlines())} lines"
    assert "**The paper found**" in first and "**loopscale found**" in first
    assert re.search(r"^!\[[^\]]*\]\(results/[^)]+\.png\)", first, re.M), "no headline figure"
    assert MATRIX.search(first), "the claims table is not on the first screen"
    for command in ("make smoke", "make reproduce", "make test"):
        assert re.search(rf"^{command}\b", first, re.M), f"{command} is not on the first screen"


def test_every_snippet_that_needs_the_venv_activates_it():
    """A reader who copies a snippet gets the venv's tools: a shell snippet calling loopscale,
    snakemake, dvc, torchrun, python or lm-eval activates .venv first or calls .venv/bin/...
    (make targets set it up themselves)."""
    tools = re.compile(r"^\s*(?:\$ )?(loopscale|loopscale-lm-eval|snakemake|dvc|torchrun|python3?)\b", re.M)
    for doc in RUN_DOCS:
        for marker, _, lang, code in blocks((REPO / doc).read_text()):
            if lang not in ("bash", "sh", "console") or not tools.search(code):
                continue
            first = tools.search(code).start()
            assert "source .venv/bin/activate" in code[:first], f"{doc}: activate the venv first:\n{code[:300]}"


def test_the_smoke_time_quoted_is_the_recorded_one():
    import json
    rec = json.loads((REPO / "benchmarks" / "make-smoke.json").read_text())
    assert rec["command"] == "make smoke" and " ".join(rec["quoted"].split()) in " ".join(README.split())
    cold = json.loads((REPO / "benchmarks" / "make-smoke-setup.json").read_text())["after"]  # set-up included
    assert f"set-up took {cold['set_up_s']} s and the pipeline {cold['smoke_s']} s" in " ".join(README.split())



def test_the_drift_law_figures_quoted_are_the_committed_ones():
    """docs/results.md's drift-law numbers are results/drift_law/drift_law.csv's and
    drift_law_coverage.csv's: the held-out point, its band and verdict; each paper model's
    points, band, ratio and verdict; the coverage counts."""
    import pandas as pd
    t = pd.read_csv(REPO / "results" / "drift_law" / "drift_law.csv").set_index("kind", append=True)
    cov = pd.read_csv(REPO / "results" / "drift_law" / "drift_law_coverage.csv")
    text = " ".join(RESULTS.split())

    def r(x):
        return f"{int(round(x)):,}"

    def where(row):
        return "inside" if row.band_low <= row.observed <= row.band_high else "outside"
    ho = t.xs("held-out", level="kind").iloc[0]
    assert (f"the law predicted {r(ho.power)} (log law {r(ho.log)}), 95% band {r(ho.band_low)}–{r(ho.band_high)} "
            f"at step {int(ho.step):,}") in text
    assert f"measured {r(ho.observed)} ({ho.observed_over_power:.2f}× the power law's point), {where(ho)} the band" in text
    assert ("passes" if where(ho) == "inside" else "fails") in text[text.index("**The held-out check"):][:40]
    paper = t.xs("paper", level="kind").set_index("target")
    for name in ("44M", "129M"):
        row = paper.loc[name]
        assert (f"for the {name} model the power law's point is {r(row.power)} (log {r(row.log)}), the 95% band "
                f"{r(row.band_low)}–{r(row.band_high)}; the paper's {r(row.observed)} is "
                f"{row.observed_over_power:.2f}× the point, {where(row)} the band") in text, name
    for check, words in (("leave-one-configuration-out", "configurations land inside their band"),
                         ("time-split", "configurations only")):
        c = cov[(cov.check == check) & cov.inside.notna()]
        n_in = int(c.inside.astype(str).str.lower().eq("true").sum())
        assert f"{n_in} of {len(c)} {words}" in text, check


def _section(text: str, exp: str) -> str:
    """docs/results.md's section of one experiment, whitespace collapsed."""
    text = " ".join(text.split())
    sec = text[text.index(f"## `{exp}`"):]
    return sec[:sec.index("## ", 3)] if "## " in sec[3:] else sec


def _claims(exp: str):
    import pandas as pd
    t = pd.read_csv(REPO / "results" / exp / "claims.csv")
    ran = (t.verdict != "not run at this scale").groupby(t["size"]).sum()
    return t[t["size"] == ran.idxmax()].set_index("id")  # the size that ran the most claims


@pytest.mark.parametrize("exp", ["cpu", "cpu_confirm", "cpu_long"])
def test_the_verdict_counts_quoted_are_the_committed_ones(exp):
    """Each experiment's counts in docs/results.md are its claims.csv's (for cpu_confirm, the
    size that ran every condition): reproduced, not reproduced and mixed evidence claims, and
    the sanity checks apart."""
    t = _claims(exp)
    sec = _section(RESULTS, exp)
    n_seeds = int(t.seeds_evaluated.max())
    ev, san = t[t.kind == "evidence"], t[t.kind == "sanity"]
    n_ok = int((ev.seeds_reproduced == ev.seeds_evaluated).sum())
    n_mixed = int(ev.verdict.str.startswith("mixed").sum())
    n_not = len(ev) - n_ok - n_mixed
    if n_ok == len(ev):
        assert f"All {n_ok} evidence claims reproduce, each in {n_seeds}/{n_seeds} seeds" in sec
    else:
        assert f"{n_ok} of the {len(ev)} evidence claims reproduce in {n_seeds}/{n_seeds} seeds" in sec
        assert not re.search(r"\bAll \d+ (evidence )?claims", sec)
        if n_mixed:
            assert f"{n_not} do not, {n_mixed} {'is' if n_mixed == 1 else 'are'} mixed" in sec
        else:
            not_ids = " and ".join(f"({i})" for i in ev.index[ev.seeds_reproduced != ev.seeds_evaluated])
            assert f"{not_ids} do not" in sec
    san_ok = int((san.seeds_reproduced == san.seeds_evaluated).sum())
    assert san_ok == len(san), f"{exp}: a sanity check fails; the page says they hold"
    assert f"the {len(san)} sanity checks hold in {n_seeds}/{n_seeds} seeds" in sec


def test_the_cpu_long_figures_quoted_are_the_committed_ones():
    """docs/results.md's cpu_long section quotes results/cpu_long/claims.csv: claim (a)'s,
    (c)'s and (c-acc)'s numbers."""
    t = _claims("cpu_long")
    para = _section(RESULTS, "cpu_long")
    drift, raw, ratio = re.search(r"‖H_K‖ ([\d,.]+) vs ([\d,.]+) \(ratio ([\d,.]+)×\)", t.loc["a", "ours"]).groups()
    assert f"‖H_K‖ reaches {drift} with the RMSNorm readout" in para
    assert f"against {float(raw):.1f} raw ({float(ratio.replace(',', '')):.0f}×)" in para
    norm, per_d, ratio = re.search(r"‖H_K‖ ([\d,.]+) \(([\d.]+)·√d\) with inter-loop norm vs [\d,.]+ without "
                                   r"\(ratio ([\d.]+)×\)", t.loc["c", "ours"]).groups()
    assert (f"‖H_K‖ is {float(norm):.0f} with inter-loop normalisation ({float(per_d):.1f}·√d, "
            f"{float(ratio):.1f}× below the drifting model's") in para
    assert t.loc["c", "verdict"].startswith("not reproduced") and "(c) not reproduced" in para
    acc = re.search(r"‖H_K‖/‖H_1‖ ([\d.]+) with inter-loop norm vs ([\d.]+) residual", t.loc["c-acc", "ours"]).groups()
    assert f"(c-acc, sanity) ‖H_K‖/‖H_1‖ {acc[0]} against {acc[1]} residual" in para


# --- the claims table ------------------------------------------------------------------------

MATRIX = re.compile(r"<!-- claims-matrix:begin -->\n(.*?)<!-- claims-matrix:end -->", re.S)
MATRIX_DIR = REPO / "results" / "claims_matrix"
README_VIEW = MATRIX_DIR / "claims_matrix_readme.md"
SHOWN = {"cpu": ("cpu", None), "cpu_confirm: d64": ("cpu_confirm", "d64"), "cpu_long": ("cpu_long", None),
         "cpu_length": ("cpu_length", None), "cpu_factorial: w128": ("cpu_factorial", "w128"), "cpu_factorial: l4": ("cpu_factorial", "l4"),
         "cpu_factorial: ctx128": ("cpu_factorial", "ctx128")}


def _cell(verdict: str) -> str:
    """claims.csv's verdict as the table writes it: ✓ 3/3, ✗ 0/3, mixed 2/3, – (not run)."""
    if verdict.startswith("not run"):
        return "–"
    if verdict.startswith("control uninformative"):
        return "uninformative"
    k, n = re.search(r"(\d+)/(\d+)", verdict).groups()
    sym = "mixed" if verdict.startswith("mixed") else "✗" if verdict.startswith("not reproduced") else "✓"
    return f"{sym} {k}/{n}"


def expected_cell(row) -> str:
    cell = _cell(row.verdict)
    reg = row.registered_verdict if isinstance(row.registered_verdict, str) else ""
    if reg and _cell(reg) != cell:
        cell += f" (registered {_cell(reg)})"
    return cell


def matrix_tables(readme: str) -> dict[str, tuple[list[str], list[list[str]]]]:
    """{first header cell: (header, rows)} of the tables between the README's claims-matrix markers."""
    tables, cur = {}, None
    for ln in MATRIX.search(readme).group(1).splitlines():
        if not ln.startswith("|"):
            cur = None
            continue
        cells = [c.strip() for c in ln.strip("|").split("|")]
        if cur is None:
            cur = cells[0]
            tables[cur] = (cells, [])
        elif not set("".join(cells)) <= set(":- "):
            tables[cur][1].append(cells)
    return tables


def matrix_cells(readme: str) -> dict[tuple[str, str], str]:
    """{(claim id, column): cell} of the README's claims tables (evidence and sanity)."""
    cells = {}
    for head, rows in matrix_tables(readme).values():
        for row in rows:
            cid = re.match(r"\(([a-z0-9-]+)\)", row[0]).group(1)
            for col, cell in zip(head[1:], row[1:]):
                cells[cid, col] = cell
    return cells


def test_the_claims_table_is_the_generated_view():
    """The README's claims table is, character for character, results/claims_matrix/
    claims_matrix_readme.md; rerunning the command named in it on the committed claims.csv
    files writes the committed claims_matrix.{csv,md} and that view again."""
    from loopscale.report import claims_matrix as M
    block = MATRIX.search(README).group(1)
    assert block.strip() == README_VIEW.read_text().strip(), (
        "the README's claims table is not results/claims_matrix/claims_matrix_readme.md: rerun the "
        "command in its first comment with --splice README.md")
    cmd = re.match(r"<!-- made by: loopscale report claims-matrix --results (.+?) --out (\S+) --readme (\S+) -->",
                   block).groups()
    dirs, out, spec = cmd[0].split(), cmd[1], cmd[2]
    assert out == "results/claims_matrix"
    cwd = os.getcwd()
    try:
        os.chdir(REPO)
        m = M.build(dirs)
        command = f"loopscale report claims-matrix --results {' '.join(dirs)} --out {out} --readme {spec}"
        assert M.readme_view(m, spec, command).strip() == README_VIEW.read_text().strip()
        assert M.markdown(m, dirs) == (MATRIX_DIR / "claims_matrix.md").read_text()
    finally:
        os.chdir(cwd)
    import pandas as pd
    committed = pd.read_csv(MATRIX_DIR / "claims_matrix.csv", dtype=str, keep_default_na=False)
    assert committed.equals(m.astype(str).reset_index(drop=True)), "results/claims_matrix/claims_matrix.csv is stale"


def test_the_claims_table_is_the_committed_verdicts():
    """Independently of the generator: every cell of the README's shown columns is that
    experiment's claims.csv verdict (with the registered one beside it where it differs),
    evidence and sanity checks sit in their own tables, every claim of claims_matrix.csv has
    its row, and the summary column counts the other columns' verdicts."""
    import pandas as pd
    tables = matrix_tables(README)
    assert list(tables) == ["Claim (evidence)", "Sanity check (holds by construction)"]
    cells = matrix_cells(README)
    full = pd.read_csv(MATRIX_DIR / "claims_matrix.csv", dtype=str, keep_default_na=False).set_index("id")
    for (head, rows), kind in zip(tables.values(), ("evidence", "sanity")):
        ids = [re.match(r"\(([a-z0-9-]+)\)", r[0]).group(1) for r in rows]
        assert ids == list(full.index[full.kind == kind]), kind
        assert [c for c in head[1:] if c in SHOWN] == list(SHOWN)
    for col, (exp, arm) in SHOWN.items():
        t = pd.read_csv(REPO / "results" / exp / "claims.csv")
        t = t[t.arm == arm] if arm else t
        for _, row in t.iterrows():
            assert cells[row.id, col] == expected_cell(row), (col, row.id, cells[row.id, col], expected_cell(row))
    others = [c for c in full.columns if c not in ("kind", "claim", *SHOWN)]
    summary = f"the {len(others)} other columns"
    for cid, row in full.iterrows():
        ran = [row[c] for c in others if row[c] != "–"]
        if not ran:
            assert cells[cid, summary] == "–"
            continue
        marks = pd.Series([c.split()[0] for c in ran]).value_counts()
        for mark, n in marks.items():
            assert f"{mark} in {n}" in cells[cid, summary], (cid, cells[cid, summary])


def test_a_wrong_cell_of_the_claims_table_fails():
    """The table checks are not vacuous: a flipped verdict and a dropped 'registered' note are
    both told apart from the committed ones, and the generated view no longer equals the README."""
    import pandas as pd
    t = pd.read_csv(REPO / "results" / "cpu_confirm" / "claims.csv")
    t = t[t.arm == "d64"].set_index("id")
    cells = matrix_cells(README)
    assert cells["g", "cpu_confirm: d64"] == expected_cell(t.loc["g"]) == "✓ 3/3 (registered ✗ 0/3)"
    wrong = README.replace("| ✓ 3/3 (registered ✗ 0/3) |", "| ✓ 3/3 |", 1)
    assert matrix_cells(wrong)["g", "cpu_confirm: d64"] != expected_cell(t.loc["g"])
    assert MATRIX.search(wrong).group(1).strip() != README_VIEW.read_text().strip()
    cpu = _claims("cpu")
    wrong = README.replace("| ✗ 0/3 | mixed 2/3 | ✓ 2/2 |", "| ✓ 3/3 | mixed 2/3 | ✓ 2/2 |", 1)
    assert wrong != README and matrix_cells(wrong)["e2", "cpu"] != expected_cell(cpu.loc["e2"])


# --- every figure from a committed file ------------------------------------------------------

def test_every_figure_quoted_comes_from_a_committed_result_file():
    """Every number of README.md and docs/results.md (and of any docs page's block that declares
    its sources) is one of its declared sources' numbers at the precision quoted
    (tests/figures.py: how to declare a source, what is exempt)."""
    bad = [p for page in figures.pages() for p in figures.check(page)]
    assert not bad, "\n".join(bad)


def test_a_figure_edited_to_a_wrong_value_fails(tmp_path):
    """A mutated copy of the README and of docs/results.md: each edited figure is reported,
    naming the file, line and figure; the unedited pages pass."""
    cases = [("README.md", "‖H_K‖ 382 against", "‖H_K‖ 383 against", "'383'"),
             ("README.md", "1.33× the point prediction", "1.43× the point prediction", "'1.43'"),
             ("README.md", "drift to 39,207 (44M)", "drift to 39,270 (44M)", "'39,270'"),
             ("README.md", "only 4.5–6.3×", "only 4.5–6.4×", "'6.4'"),
             ("README.md", "(26.75 s and 27.01 s", "(26.75 s and 27.91 s", "'27.91'"),
             ("docs/results.md", "measured 2,077 (1.33×", "measured 2,177 (1.33×", "'2,177'"),
             ("docs/results.md", "changes CE by 0.0258 nats", "changes CE by 0.0358 nats", "'0.0358'"),
             ("docs/results.md", "(−7.1% at worst)", "(+7.1% at worst)", "'+7.1%'"),
             ("docs/results.md", "5,619–157,460; the paper", "5,619–157,470; the paper", "'157,470'")]
    for page, old, new, reported in cases:
        text = (REPO / page).read_text()
        assert text.count(old) == 1, (page, old)
        assert not figures.check(page, text)
        mutated = tmp_path / Path(page).name
        mutated.write_text(text.replace(old, new))
        errors = figures.check(page, mutated.read_text())
        assert len(errors) == 1 and reported in errors[0] and errors[0].startswith(f"{page}:"), (new, errors)
    # a figure without any declaration fails on the pages that must declare one
    text = README.replace("<!-- figures: benchmarks/make-smoke.json benchmarks/make-smoke-setup.json benchmarks/test-suite.json -->\n", "")
    assert any("declares no source" in e and "898" in e for e in figures.check("README.md", text))
    # a source that is not a committed result file is refused
    text = README.replace("benchmarks/make-smoke.json benchmarks/make-smoke-setup.json benchmarks/test-suite.json", "docs/studies.md", 1)
    assert any("not a committed file under results/ or benchmarks/" in e for e in figures.check("README.md", text))


def test_most_single_digit_edits_of_a_precise_figure_are_caught():
    """Strictness over the whole pages: every figure with a decimal point or three or more
    significant digits is edited in its last digit, one at a time; at least 90% of the edits must
    fail the check (an edit can land on another number its sources hold; small integers, e.g.
    seed counts, are checked by the exact tests above, not here)."""
    from dataclasses import replace
    tried, missed = 0, []
    for page in figures.CHECKED:
        for b in figures.blocks(page):
            if b.sources is None:
                continue
            for f in figures.figures(b.text):
                digits = [i for i, c in enumerate(f.text) if c.isdigit()]
                if "." not in f.text and len(f.text.replace(",", "").strip("0+−-%kMB")) < 3:
                    continue
                i = digits[-1]
                edited = f.text[:i] + str((int(f.text[i]) + 1) % 10) + f.text[i + 1:]
                tried += 1
                if not figures.problems(replace(b, text=b.text[:f.start] + edited + b.text[f.end:]), True):
                    missed.append(f"{page}:{b.line} {f.text} -> {edited}")
    assert tried >= 100
    assert len(missed) <= 0.1 * tried, missed


@pytest.mark.slow
def test_the_readme_runs_as_written(tmp_path):
    repo = copy_worktree(tmp_path / "repo")
    os.symlink(Path(sys.executable).parents[1], repo / ".venv")  # the set-up's venv (make setup is done)
    env = pipeline_env(repo)
    shutil.rmtree("/tmp/loopscale-out", ignore_errors=True)  # the --directory example's folder
    for i, (marker, _, lang, code) in enumerate(all_blocks()):
        if marker != "run":
            continue
        if lang == "python":
            cmd = [sys.executable, "-c", code]
        else:  # make: its set-up target is this venv (never reinstall it from the copy)
            code = re.sub(r"^make (\w+)", r"make -o .venv/.installed \1", code, flags=re.M)
            cmd = ["bash", "-euo", "pipefail", "-c", code]
        proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=1800)
        assert proc.returncode == 0, f"snippet {i} of {', '.join(RUN_DOCS)} ({lang}) failed:\n{code}\n--- stderr\n{proc.stderr[-3000:]}"
        if "tok.encode(" in code:
            assert "['The', ' ', 'Congress', ' ', 'of'" in proc.stdout
    assert (repo / "results" / "smoke" / "REPORT.md").is_file()
    assert (repo / "runs" / "demo" / "rmsnorm" / "model.safetensors").is_file()


# ---------------------------------------------------------------------------
# docs/troubleshooting.md names the test of each promise: every one must exist
# ---------------------------------------------------------------------------
TEST_REF = re.compile(r"tests/[\w/]+\.py(?:::\w+)+")


def defined_tests(path: Path) -> dict[str, set[str]]:
    """The tests a file defines, parsed (not imported or collected): top-level test functions
    and classes, each class with its test methods, as {name: {method names}}."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            out[node.name] = set()
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            out[node.name] = {n.name for n in node.body
                              if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name.startswith("test")}
    return out


def missing_tests(text: str, root: Path = REPO) -> list[str]:
    """The `tests/FILE.py::NAME[::METHOD]` references in `text` that name no test in `root`."""
    gone, parsed = [], {}
    for ref in sorted(set(TEST_REF.findall(text))):
        file, *names = ref.split("::")
        path = root / file
        if not path.is_file():
            gone.append(ref)
            continue
        defs = parsed.setdefault(file, defined_tests(path))
        if names[0] not in defs or len(names) > 2 or (len(names) == 2 and names[1] not in defs[names[0]]):
            gone.append(ref)
    return gone


def test_every_test_named_in_troubleshooting_exists():
    text = (REPO / "docs" / "troubleshooting.md").read_text(encoding="utf-8")
    assert len(set(TEST_REF.findall(text))) >= 10  # the promises of issue 34 each name their test
    assert missing_tests(text) == []


@pytest.mark.parametrize("ref", ["tests/test_settings.py::TestNoSuchClass",
                                 "tests/test_settings.py::TestLimits::test_no_such_method",
                                 "tests/test_pipeline.py::test_no_such_test", "tests/test_gone.py::test_x",
                                 "tests/test_settings.py::one_line"])  # a helper is not a test
def test_a_renamed_or_removed_test_is_caught(ref):
    text = (REPO / "docs" / "troubleshooting.md").read_text(encoding="utf-8")
    assert missing_tests(f"{text}\n({ref})\n") == [ref]


def test_the_generate_transcript_in_the_docs_is_the_recorded_one():
    """docs/usage.md's `loopscale generate` transcript is benchmarks/generate-cpu.json's, output
    line for line (benchmarks/generate_cpu.py records it); an edited line fails."""
    import json
    text = (REPO / "docs" / "usage.md").read_text()
    m = re.search(r"<!-- generate-transcript: (\S+) -->\n```console\n(.*?)```", text, re.S)
    assert m, "docs/usage.md has no generate transcript"
    record = json.loads((REPO / m.group(1)).read_text())
    shown = [line for line in m.group(2).splitlines() if not line.startswith(("$ ", " "))]
    recorded = [line for t in record["generate_transcript"] for line in (t["stdout"] + t["stderr"]).splitlines()]
    assert shown == recorded
    assert len(recorded) == 2 * len(record["generate_transcript"])
    assert all(t["command"].startswith("loopscale generate") for t in record["generate_transcript"])
