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
