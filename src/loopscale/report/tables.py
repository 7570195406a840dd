"""Every table of the report, in report order: the aggregate tables (aggregate.py), the drift
law (drift.py) and the tidy per-seed table (tidy.py), which all build on aggregate.py."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from .appendix_b import appendix_b_table, is_ouro
from .aggregate import (Table, clamp_table, depth_table, group_runs, halting_table, lemma_table, main_table,
                        norms_table, radial_table, runs_table, scale_table)
from .drift import drift_table
from .drift_law import train_norms_frame
from .halting_paper import halting_paper_table
from .story import story_table
from .runs import Run
from .tidy import per_seed_table


def build_tables(runs: list[Run], root: Optional[Path] = None) -> list[Table]:
    """Every aggregate table, in report order."""
    groups = group_runs(runs)
    norms, norm_loops_t = norms_table(groups)
    return [main_table(groups), depth_table(groups), norms, radial_table(groups), lemma_table(groups),
            clamp_table(groups), scale_table(groups), halting_table(groups), halting_paper_table(groups),
            story_table(groups), drift_table(groups), runs_table(runs, root)] + \
        [norm_loops_t, per_seed_table(runs, root), train_norms_table(runs)] + \
        ([appendix_b_table(runs)] if is_ouro(runs) else [])  # an Ouro experiment: Appendix B's tables


def train_norms_table(runs: list[Run]) -> Table:
    """The training logs the drift laws are fitted on (CSV only; `loopscale report drift-law` reads it)."""
    return Table("train_norms", "Training logs of ‖H_K‖", train_norms_frame(runs), "")
