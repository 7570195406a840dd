"""loopscale: looped language models and the readout blind spot (arXiv 2606.24898)."""
__version__ = "0.1.0"

from .config import ConfigError, RunConfig, load_config, preset  # noqa: E402,F401
from .model import LoopedLM  # noqa: E402,F401
