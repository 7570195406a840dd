"""loopscale: looped language models and the readout blind spot (arXiv 2606.24898)."""
__version__ = "0.1.0"

from .config import ConfigError, RunConfig, load_config, preset  # noqa: E402,F401


def __getattr__(name):  # torch is imported only when the model is used (fast CLI/pipeline start)
    if name == "LoopedLM":
        from .model import LoopedLM
        return LoopedLM
    if name == "load":  # load(run_dir) -> (model, tokenizer, config)
        from .artifacts import load
        return load
    raise AttributeError(f"module 'loopscale' has no attribute {name!r}")


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

    if importlib.util.find_spec("transformers") is not None:
        sys.meta_path.insert(0, Hook())


_register_with_transformers()
