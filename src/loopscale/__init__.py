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


def _register_with_transformers() -> None:
    """Make `AutoModelForCausalLM.from_pretrained(RUN)` work without remote code after
    `import loopscale`: loopscale.hf registers its classes with the Auto classes. Importing
    transformers costs seconds, so it is not imported here: when it is already loaded the
    classes are registered now, else the moment it is imported (a one-shot import hook)."""
    import importlib.abc
    import importlib.util
    import sys

    def register():
        try:
            from . import hf  # noqa: F401  (registers on import)
        except Exception:  # a transformers loopscale cannot use must not break its import
            pass

    if "transformers" in sys.modules:
        register()
        return

    class Hook(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname != "transformers":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(fullname)
            if spec is None or spec.loader is None:
                return spec
            exec_module = spec.loader.exec_module

            def exec_and_register(module):
                exec_module(module)
                sys.modules[fullname] = sys.modules.get(fullname, module)
                register()
            spec.loader.exec_module = exec_and_register
            return spec

    try:
        present = importlib.util.find_spec("transformers") is not None
    except (ImportError, ValueError):  # an environment that blocks or breaks it: not there
        present = False
    if present:
        sys.meta_path.insert(0, Hook())


_register_with_transformers()
