"""Hugging Face transformers classes for loopscale runs (the `hf` extra).

A run directory is a Hugging Face model directory: config.json (model_type "loopscale",
`auto_map`), model.safetensors, the tokenizer files and modeling_loopscale.py (remote code
that imports this module). So both

    AutoModelForCausalLM.from_pretrained(RUN, trust_remote_code=True)
    import loopscale; AutoModelForCausalLM.from_pretrained(RUN)       # classes registered here

give a `LoopscaleForCausalLM`, and `pipeline("text-generation", model=RUN)` works.

The model wraps `loopscale.model.LoopedLM` (attribute `lm`); nothing is implemented twice.
It is loaded by `loopscale.load`, so every check of artifacts.py applies (weights, config and
tokenizer hashes, dtypes, finite values, sizes). `n_loops` is a config field (default: the
K of training) and an argument of `forward` and `generate`: any depth >= 1.

Generation (`model.generate`, the pipeline) uses loopscale's KV cache (`LoopscaleCache`, the
one of `loopscale generate`: a cache per (loop, layer)) and the same context window: when a
new token would sit at position seq_len, the last seq_len/2 tokens are re-encoded from
position 0. So greedy ids equal `loopscale generate`'s. Without the cache, an input longer
than seq_len is refused (one line); padding (an attention mask with zeros) is refused too.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin, PreTrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .artifacts import HF_ARCHITECTURE, HF_MODEL_TYPE, LIMITS
from .config import ModelConfig
from .generate import Decoder
from .model import LoopedLM


class LoopscaleConfig(PreTrainedConfig):
    """config.json of a loopscale run: loopscale's model settings under their own names
    (ModelConfig), with the usual Hugging Face names as aliases."""
    model_type = HF_MODEL_TYPE
    keys_to_ignore_at_inference = ["past_key_values"]
    attribute_map = {"hidden_size": "d_model", "num_hidden_layers": "n_layers", "num_attention_heads": "n_heads",
                     "intermediate_size": "d_ff", "max_position_embeddings": "seq_len"}

    def __init__(self, vocab_size: int = 20000, d_model: int = 512, n_layers: int = 8, n_heads: int = 8,
                 d_ff: int = 2048, seq_len: int = 256, n_loops: int = 4, dropout: float = 0.1,
                 norm_eps: float = 1e-6, readout: str = "rmsnorm", recurrence: str = "residual",
                 init: str = "pytorch", arch: str = "looped", loopscale: Optional[dict] = None, **kwargs):
        self.vocab_size, self.d_model, self.n_layers, self.n_heads = vocab_size, d_model, n_layers, n_heads
        self.d_ff, self.seq_len, self.n_loops, self.dropout = d_ff, seq_len, n_loops, dropout
        self.norm_eps, self.readout, self.recurrence, self.init = norm_eps, readout, recurrence, init
        self.arch, self.loopscale = arch, dict(loopscale or {})
        kwargs.setdefault("bos_token_id", 1)
        kwargs.setdefault("eos_token_id", 2)
        kwargs.setdefault("pad_token_id", 0)
        kwargs.setdefault("tie_word_embeddings", True)
        super().__init__(**kwargs)


class LoopscaleCache:
    """`past_key_values` of a loopscale model: loopscale's per-(loop, layer) KV cache
    (`generate.Decoder`) and every id seen so far (to re-encode the window when it slides)."""

    def __init__(self):
        self.decoder: Optional[Decoder] = None
        self.ids: Optional[torch.Tensor] = None  # [B, L]: all ids fed, window slides included
        self.n_loops: Optional[int] = None
        self.slides = 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0 if self.ids is None else self.ids.shape[1]


class LoopscaleForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = LoopscaleConfig
    base_model_prefix = "lm"
    main_input_name = "input_ids"
    _supports_cache_class = False

    def __init__(self, config: LoopscaleConfig, lm: Optional[LoopedLM] = None):
        super().__init__(config)
        self.post_init()  # before `lm` is a child: Hugging Face's weight init never touches it
        self.lm = lm if lm is not None else LoopedLM(model_config(config))  # LoopedLM's own init

    def _init_weights(self, module):
        pass  # LoopedLM initialises itself (config.init); loaded weights are never re-initialised

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # generate() must not hand us a DynamicCache: forward returns a LoopscaleCache

    # -- loading: through loopscale.load, which verifies every file ------------
    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, config=None, **kwargs):
        from .artifacts import load
        run = _local_dir(pretrained_model_name_or_path, kwargs)
        lm, _, cfg = load(run)
        if not isinstance(config, LoopscaleConfig):  # an older run's config.json is no HF config
            config = LoopscaleConfig(**{k: getattr(cfg.model, k) for k in ModelConfig.__dataclass_fields__})
        for key in list(kwargs):  # config overrides given to from_pretrained (e.g. n_loops=6)
            if key in config.to_dict() and key not in ("dtype", "torch_dtype"):
                setattr(config, key, kwargs.pop(key))
        check_depth(config.n_loops)
        model = cls(config, lm=lm)
        model.run_config = cfg  # the run's full config, for save_pretrained
        dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
        if isinstance(dtype, str) and dtype != "auto":
            dtype = getattr(torch, dtype)
        if isinstance(dtype, torch.dtype):
            model = model.to(dtype)
        device = kwargs.get("device_map")
        if isinstance(device, dict):
            device = next(iter(device.values()), None)
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device is not None:
            model = model.to(device if not isinstance(device, int) else f"cuda:{device}")
        model.name_or_path = str(pretrained_model_name_or_path)
        model.config.name_or_path = str(pretrained_model_name_or_path)
        return model.eval()

    def get_input_embeddings(self):
        return self.lm.tok_emb

    def get_output_embeddings(self):
        return None  # tied: the head is the token embedding (LoopedLM.logits)

    # -- forward ----------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                past_key_values: Optional[LoopscaleCache] = None, use_cache: Optional[bool] = None,
                labels: Optional[torch.Tensor] = None, n_loops: Optional[int] = None,
                return_dict: Optional[bool] = None, **kwargs) -> CausalLMOutputWithPast:
        """Logits after loop n_loops (default config.n_loops) with the final readout, as
        `model.logits(model(idx, n_loops=k)[-1])`. With a cache (generate), the logits of
        the positions fed in this call that are inside the current window."""
        n = self.config.n_loops if n_loops is None else n_loops
        check_depth(n)
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            raise ValueError("loopscale models take no padding: the attention mask has zeros "
                             "(generate one sequence at a time, or sequences of equal length)")
        lm = self.lm
        if use_cache or isinstance(past_key_values, LoopscaleCache):
            cache = past_key_values if isinstance(past_key_values, LoopscaleCache) else LoopscaleCache()
            h = self._cached(cache, input_ids, n)
        else:
            cache = None
            if input_ids.shape[1] > lm.cfg.seq_len:
                raise ValueError(f"{input_ids.shape[1]} tokens exceed the model's {lm.cfg.seq_len} learned positions; "
                                 f"generate with use_cache=True (the window slides) or truncate the input")
            h = lm(input_ids, n_loops=n)[-1]
        logits = lm.logits(h, final=True).float()
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                   labels[:, -logits.shape[1]:][:, 1:].reshape(-1), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=cache)

    def _cached(self, cache: LoopscaleCache, ids: torch.Tensor, n: int) -> torch.Tensor:
        """Feed `ids` after the cached ones (generate.py's decoding and window slides)."""
        seq = self.lm.cfg.seq_len
        if cache.n_loops not in (None, n):
            raise ValueError(f"n_loops changed from {cache.n_loops} to {n} within one cached generation")
        cache.n_loops = n
        cache.ids = ids if cache.ids is None else torch.cat([cache.ids, ids], dim=1)
        if cache.decoder is None:  # the prompt: a prompt longer than the window keeps its last seq_len
            window = cache.ids[:, -seq:]
        elif cache.decoder.pos + ids.shape[1] > seq:  # no position left: slide the window
            window = cache.ids[:, -max(1, seq // 2):]  # (a seq_len-1 model keeps the new token)
            cache.slides += 1
        else:
            return cache.decoder.states(ids)
        cache.decoder = Decoder(self.lm, n)
        return cache.decoder.states(window)[:, -min(ids.shape[1], window.shape[1]):]

    def prepare_inputs_for_generation(self, input_ids, past_key_values=None, attention_mask=None,
                                      use_cache=None, n_loops=None, **kwargs):
        if isinstance(past_key_values, LoopscaleCache) and past_key_values.ids is not None:
            input_ids = input_ids[:, past_key_values.ids.shape[1]:]  # only the new tokens
        return {"input_ids": input_ids, "past_key_values": past_key_values, "attention_mask": attention_mask,
                "use_cache": use_cache, "n_loops": n_loops}

    # -- saving: the loopscale layout, so loopscale.load reads it back -------------
    def save_pretrained(self, save_directory, **kwargs):
        """Write the run's artifact files (artifacts.write_run_files) into `save_directory`;
        the tokenizer is written by the tokenizer's own save_pretrained."""
        import dataclasses

        from .artifacts import write_run_files
        from .config import RunConfig
        out = Path(save_directory)
        out.mkdir(parents=True, exist_ok=True)
        cfg = getattr(self, "run_config", None)
        if cfg is None or cfg.model != self.lm.cfg:  # a model built here: its data settings are unknown
            cfg = RunConfig(model=self.lm.cfg)
            cfg.data = dataclasses.replace(cfg.data, vocab_size=min(self.lm.cfg.vocab_size, 65535))
        record = {"config": cfg.to_dict(), "env": {}, "data": {}}
        write_run_files(out, self.lm, record, None)


def model_config(config: LoopscaleConfig) -> ModelConfig:
    return ModelConfig(**{k: getattr(config, k) for k in ModelConfig.__dataclass_fields__})


def check_depth(n) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= LIMITS["n_loops"]:
        raise ValueError(f"n_loops must be an integer in [1, {LIMITS['n_loops']}], got {n!r}")


def _local_dir(name, kwargs) -> Path:
    """A run directory on disk: the path itself, else a snapshot of the hub repository."""
    if os.path.isdir(name):
        return Path(name)
    from huggingface_hub import snapshot_download
    return Path(snapshot_download(str(name), revision=kwargs.get("revision"),
                                  cache_dir=kwargs.get("cache_dir"), token=kwargs.get("token")))


def register() -> None:
    """Register the classes with AutoConfig / AutoModelForCausalLM (no remote code needed)."""
    AutoConfig.register(HF_MODEL_TYPE, LoopscaleConfig, exist_ok=True)
    AutoModelForCausalLM.register(LoopscaleConfig, LoopscaleForCausalLM, exist_ok=True)


register()
__all__ = ["LoopscaleConfig", "LoopscaleForCausalLM", "LoopscaleCache", "register"]
assert HF_ARCHITECTURE == LoopscaleForCausalLM.__name__
