"""Appendix B's report table (report/appendix_b.py) on synthetic inputs: means and stds over
seeds per readout variant, corpus and depth, downstream accuracy per task, and the paper's
column "not reported" in every cell (the project holds none of Appendix B's numbers)."""
import json
import math

import pytest

from loopscale.report.appendix_b import PAPER, appendix_b_frame, appendix_b_markdown, appendix_b_table
from loopscale.report.runs import load_runs


def entry(cond, seed, ppl, acc=None):
    e = {"size": "tiny", "condition": cond, "readout": cond, "seed": seed,
         "depth": {"fineweb": [{"K": k, "ppl": p} for k, p in enumerate(ppl, 1)]}}
    if acc is not None:
        e["downstream"] = [{"task": "piqa", "loops": 4, "acc": acc[0], "acc_norm": acc[1]}]
    return e


def test_means_and_stds_over_seeds_and_the_paper_column():
    df = appendix_b_frame([entry("rmsnorm", 1, [10.0, 8.0], (0.5, 0.6)), entry("rmsnorm", 2, [12.0, 6.0], (0.7, 0.6)),
                           entry("final_raw", 1, [9.0, float("nan")])])
    d = df[df.table == "variable_depth"].set_index(["condition", "K"])
    assert d.loc[("rmsnorm", 1), "mean"] == 11.0 and d.loc[("rmsnorm", 1), "std"] == pytest.approx(math.sqrt(2))
    assert d.loc[("rmsnorm", 2), "mean"] == 7.0 and d.loc[("rmsnorm", 2), "n_seeds"] == 2
    assert d.loc[("final_raw", 1), "n_seeds"] == 1 and math.isnan(d.loc[("final_raw", 1), "std"])
    assert d.loc[("final_raw", 2), "n_seeds"] == 0  # a non-finite PPL is no value
    down = df[df.table == "downstream"].set_index("metric")
    assert down.loc["acc", "mean"] == pytest.approx(0.6) and down.loc["acc_norm", "std"] == 0
    assert set(df.paper) == {PAPER}
    md = appendix_b_markdown(df)
    assert "| rmsnorm | 11.00 ± 1.41 | 7.00 ± 1.41 | 2 | not reported |" in md
    assert "piqa acc" in md and "60.0%" in md and md.count(PAPER) >= 3


def test_no_results_says_so():
    assert appendix_b_frame([]).empty
    assert "No Appendix-B results" in appendix_b_markdown(appendix_b_frame([]))


def write_runs(root, arch="ouro"):
    """Three run directories of one condition (seeds 1, 2 completed, 3 failed), each with a
    variable-depth result on WikiText-103."""
    for seed, status in ((1, "completed"), (2, "completed"), (3, "failed")):
        run = root / f"seed{seed}"
        (run / "eval").mkdir(parents=True)
        cfg = {"model": {"arch": arch, "readout": "final_raw", "n_loops": 4, "d_model": 8, "n_layers": 1},
               "objective": {"loss": "terminal"}, "train": {"seed": seed}}
        (run / "config.json").write_text(json.dumps({"config": cfg}))
        (run / "summary.json").write_text(json.dumps({"status": status, "steps": 1}))
        rows = [{"K": 1, "ppl": 10.0 * seed}] if status == "completed" else []
        (run / "eval/ouro_depth-wikitext-103.json").write_text(json.dumps({"status": "ok" if rows else status,
                                                                          "rows": rows}))
    return sorted(root.iterdir())


def test_reads_run_directories_and_skips_failed_results(tmp_path):
    df = appendix_b_table(load_runs(write_runs(tmp_path))).df
    assert list(df.data) == ["wikitext-103"] and df["mean"][0] == 15.0 and df.n_seeds[0] == 2


@pytest.mark.parametrize("arch", ["ouro", "looped"])
def test_report_links_appendix_b_md_of_an_ouro_experiment(tmp_path, arch):
    """REPORT.md of an Ouro experiment links appendix_b.md and appendix_b.csv (relative to the
    report) and keeps Appendix B's sub-tables under its heading inside "## Tables"; a report
    of other runs has neither."""
    from loopscale.report.document import report_markdown
    runs = load_runs(write_runs(tmp_path / "runs", arch))
    text = report_markdown(runs, tmp_path / "results", tmp_path / "results" / "REPORT.md", "ouro-smoke")
    link = "[appendix_b.md](appendix_b.md), [appendix_b.csv](appendix_b.csv)"
    headings = [l for l in text.splitlines() if l.startswith("#")]
    if arch == "looped":
        assert "appendix_b.md" not in text and "Appendix B" not in text
        return
    assert text.count(link) == 1
    at = headings.index("### Appendix B: the Ouro track (variable depth, downstream accuracy)")
    assert headings[at - 1] == "## Tables" or headings[at - 1].startswith("### ")
    # the size label: a parameter count where the config gives one (this partial config does not), then the shape
    sub = headings[at + 1]
    assert sub.startswith("#### Variable depth: perplexity on wikitext-103, ") and sub.endswith("(d8, 1L, K=4)")
    assert all(not h.startswith("## ") for h in headings[headings.index("## Tables") + 1:])
    # from a report written elsewhere, the links still point at the results directory
    other = report_markdown(runs, tmp_path / "results", tmp_path / "elsewhere" / "REPORT.md", "ouro-smoke")
    assert "[appendix_b.md](../results/appendix_b.md)" in other
