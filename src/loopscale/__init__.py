"""loopscale: looped language models and the readout blind spot (arXiv 2606.24898)."""
from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"  # the one place the version is written (pyproject reads it)

from .config import ConfigError, RunConfig, load_config, preset  # noqa: E402,F401

if TYPE_CHECKING:  # what the lazy exports below are, for type checkers
    from .artifacts import load
    from .model import LoopedLM

# torch is imported only when the model is used (fast CLI/pipeline start)
_LAZY = {"LoopedLM": ("model", "LoopedLM"), "load": ("artifacts", "load")}  # load(run_dir) -> (model, tokenizer, config)

__all__ = ["__version__", "ConfigError", "RunConfig", "load_config", "preset", "LoopedLM", "load"]


def __getattr__(name):
    if name in _LAZY:
        import importlib
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(f".{module}", __name__), attr)
    raise AttributeError(f"module 'loopscale' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
