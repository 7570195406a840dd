"""`snakemake --report` of the smoke experiment holds the claims table, every figure and
every table, with captions and categories (Snakemake's report(), workflow/rules/report.smk)."""
from __future__ import annotations

import re
import shutil
import zipfile

import pytest

from loopscale.report.figures import FIGURES
from workflow_support import SMOKE, smk

TABLES = ["claims", "main", "depth", "norms", "norm_loops", "radial", "lemma", "clamp", "scale", "halting", "drift",
          "runs"]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def repo(smoke_local, tmp_path_factory):  # noqa: F811
    """A copy of the session's smoke workspace, Snakemake's metadata kept: the workspace is
    shared with other tests (and pytest-xdist workers), and a snakemake run writes into it."""
    return shutil.copytree(smoke_local[0], tmp_path_factory.mktemp("report") / "repo", symlinks=True)


def test_zip_report_holds_figures_tables_and_claims(repo, tmp_path):
    smk(repo, *SMOKE, "--report", str(tmp_path / "report.zip"))
    with zipfile.ZipFile(tmp_path / "report.zip") as z:
        names = z.namelist()
        png = {n.rsplit("/", 1)[-1] for n in names if n.endswith(".png")}
        csv = {n.rsplit("/", 1)[-1] for n in names if n.endswith(".csv")}
        assert png == {f"{f}.png" for f in FIGURES}
        assert {f"{t}.csv" for t in TABLES} <= csv
        for n in names:
            if n.endswith("norm_per_loop.png"):
                assert z.read(n).startswith(b"\x89PNG\r\n\x1a\n")
        index = z.read(next(n for n in names if n.endswith("report.html"))).decode()
    assert '"Claims"' in index and '"Figures"' in index and '"Tables"' in index


def test_html_report_embeds_figures_with_captions_and_claims_first(repo, tmp_path):
    smk(repo, *SMOKE, "--report", str(tmp_path / "report.html"))
    html = (tmp_path / "report.html").read_text()
    assert len(re.findall(r"data:image/png;[^,\"]*base64,iVBORw0KGgo", html)) == len(FIGURES)  # embedded PNGs
    for f in FIGURES:
        assert f"{f}.png" in html
    # captions of the figures, the tables and the claims; nothing docutils could not render
    assert "compute-quality frontier" in html and "radial gradient fraction" in html
    assert "the verdict, and the rule (threshold)" in html
    assert "system-message" not in html
    # the report's menu lists categories alphabetically: the claims come first
    categories = set(re.findall(r'"(\w+)": \{"Other": \[', html))
    assert categories == {"Claims", "Figures", "Tables"} and sorted(categories)[0] == "Claims"
