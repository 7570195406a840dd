"""Shared by the run-directory tests (test_resume, test_rundir, test_data) and tests/conftest.py's
`reference` run: the smoke settings they train with and a run directory's files. A helper
module, not a test file."""
from pathlib import Path

from loopscale.config import preset


def smoke_cfg(steps):
    return preset("smoke", {"model": {"dropout": 0.1}, "train": {"threads": 1, "log_every": 5,
                                                                  "ckpt_every": 10, "max_steps": steps}})


def tree(path: Path) -> dict:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file() and p.name != ".lock"}
