"""Hugging Face transformers classes for loopscale runs (the `hf` extra).

A run directory loads as `LoopscaleForCausalLM` (wrapping `loopscale.model.LoopedLM`, read by
`loopscale.load` with all its checks), through the run's modeling_loopscale.py or the classes
registered here. `generate` uses loopscale's KV cache and context window, so greedy ids equal
`loopscale generate`'s; halting, padded batches, per-loop outputs and the refusals are in
docs/artifacts.md ("Hugging Face transformers").
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin, PreTrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .artifacts import (HF_ARCHITECTURE, HF_CONFIG, HF_MODEL_TYPE, LIMITS, RECORD, WEIGHTS, hf_config, load,
                        read_record, role_token_ids, write_run_files)
from .config import ModelConfig, RunConfig
from .exits import POLICIES
from .generate import Decoder, Halt, run_threshold
from .io import CheckpointError
from .model import LoopedLM
from .runfiles import check_regular, check_run_dir, read_json


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

    @classmethod
    def get_config_dict(cls, pretrained_model_name_or_path, **kwargs):
        """A run directory's config.json must be there as a regular file (transformers alone
        would skip a FIFO or a directory there and hand back a default config)."""
        path = Path(str(pretrained_model_name_or_path))
        if path.is_dir():
            check_regular(path / "config.json", "Hugging Face config")
            if not (path / "config.json").is_file():
                raise FileNotFoundError(f"{path / 'config.json'} not found: {path} is not a Hugging Face model directory")
        return super().get_config_dict(pretrained_model_name_or_path, **kwargs)

    @classmethod
    def _dict_from_json_file(cls, json_file):
        """config.json read as loopscale reads a run's JSON files (runfiles.read_json): a
        regular file, bounded in size and nesting; each refusal one line."""
        config = read_json(Path(json_file), "Hugging Face config")
        if not isinstance(config, dict):
            raise CheckpointError(f"{json_file} is not a JSON object: not a Hugging Face config")
        return cls._decode_special_floats(config)


@dataclass
class LoopscaleCausalLMOutput(CausalLMOutputWithPast):
    """CausalLMOutputWithPast plus exit_logits (z_1, ..., z_n): loop k's exit read out as
    trained (`lm.logits(H_k, final=k == n, k=k)`); hidden_states[k] is H_k, before any norm."""
    exit_logits: Optional[tuple] = None


@dataclass
class _Row:
    """One sequence of a padded or halting batch: its attended ids and its own decoder."""
    ids: list[int] = field(default_factory=list)  # every id fed with attention-mask 1, window slides included
    decoder: Optional[Decoder] = None
    loops: list[int] = field(default_factory=list)  # loops of the pass that produced each next-token prediction
    slides: int = 0
    last: Optional[tuple] = None  # the latest position's (logits, hidden states, exit logits)


class LoopscaleCache:
    """`past_key_values`: loopscale's per-(loop, layer) KV cache (`generate.Decoder`) and the
    ids seen so far. Equal-length rows share one decoder; a padded or halting batch decodes
    each row with its own, on its attended ids, as `loopscale generate` does it alone."""

    def __init__(self):
        self.decoder: Optional[Decoder] = None
        self.ids: Optional[torch.Tensor] = None  # [B, L]: all ids fed, window slides included
        self.n_loops: Optional[int] = None
        self.halt: Optional[Halt] = None
        self.rows: Optional[list[_Row]] = None  # per-row decoding (padding or halting)
        self._slides = 0
        self._seen = 0  # ids fed so far (the input ids generate() has already passed in)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._seen

    @property
    def slides(self) -> int:
        return max(r.slides for r in self.rows) if self.rows else self._slides

    @property
    def loops(self) -> list[list[int]]:
        """Per row: the loops each generated token came from (k, or the halting exit j < k)."""
        return [list(r.loops) for r in self.rows] if self.rows is not None else []


class LoopscaleForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = LoopscaleConfig
    base_model_prefix = "lm"
    main_input_name = "input_ids"
    _supports_cache_class = False

    def __init__(self, config: LoopscaleConfig, lm: Optional[LoopedLM] = None):
        super().__init__(config)
        self.post_init()  # before `lm` is a child: Hugging Face's weight init never touches it
        self.lm = lm if lm is not None else LoopedLM(model_config(config))  # LoopedLM's own init
        self.run_dir: Optional[Path] = None  # the run directory it was loaded from (calibrated thresholds)

    def _init_weights(self, module):
        pass  # LoopedLM initialises itself (config.init); loaded weights are never re-initialised

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # generate() must not hand us a DynamicCache: forward returns a LoopscaleCache

    # -- loading: through loopscale.load, which verifies every file ------------
    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, config=None, **kwargs):
        """The run through `loopscale.load`, config.json cross-checked against the run record.
        Only `n_loops` may be changed at loading: any other model setting (also through a config
        or an alias) is fixed by the weights and refused."""
        run = _local_dir(pretrained_model_name_or_path, kwargs)
        check_run_dir(run)
        lm, tok, cfg = load(run)
        expected = _expected_hf_config(run, cfg, tok)
        overrides = {k: kwargs.pop(k) for k in list(kwargs)
                     if k in LoopscaleConfig.attribute_map or k in expected or k == "n_loops"}
        if config is not None and not isinstance(config, LoopscaleConfig):
            raise ValueError(f"config must be a LoopscaleConfig, got {type(config).__name__}")
        given = config.to_dict() if config is not None else {}
        for alias, name in LoopscaleConfig.attribute_map.items():
            if alias in overrides:
                overrides[name] = overrides.pop(alias)
        given.update(overrides)
        for key, want in expected.items():
            if key in ("n_loops", "dtype", "torch_dtype", "loopscale", "auto_map", "architectures") or key not in given:
                continue
            if given[key] != want:
                raise ValueError(f"from_pretrained cannot change {key} to {given[key]!r}: the run's weights were "
                                 f"trained with {key}={want!r} (only n_loops, the depth, may be given)")
        config = LoopscaleConfig(**{k: v for k, v in expected.items() if k not in ("dtype", "architectures",
                                                                                   "auto_map", "model_type")})
        config.architectures = [HF_ARCHITECTURE]
        config.n_loops = given.get("n_loops", expected["n_loops"])
        check_depth(config.n_loops)
        model = cls(config, lm=lm)
        model.run_config = cfg  # the run's full config, for save_pretrained
        model.run_dir = run
        model.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
        if isinstance(dtype, str) and dtype != "auto":
            if not isinstance(getattr(torch, dtype, None), torch.dtype):
                raise ValueError(f"dtype: unknown torch dtype {dtype!r}")
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

    # -- checks ----------------------------------------------------------------
    def _check_ids(self, input_ids) -> None:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise ValueError(f"input_ids must be a [batch, length] tensor of token ids, got "
                             f"{type(input_ids).__name__}{'' if not isinstance(input_ids, torch.Tensor) else list(input_ids.shape)}")
        if input_ids.numel() == 0:
            raise ValueError(f"input_ids is empty (shape {list(input_ids.shape)}): give at least one token id per row")
        if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
            raise ValueError(f"input_ids must be integer token ids, got {input_ids.dtype}")
        V = self.lm.cfg.vocab_size
        lo, hi = int(input_ids.min()), int(input_ids.max())
        if lo < 0 or hi >= V:
            raise ValueError(f"input_ids holds id {lo if lo < 0 else hi}, outside the model's vocabulary [0, {V})")

    def _halt(self, halt, threshold) -> Optional[Halt]:
        """`halt`/`threshold` as `loopscale generate --halt POLICY [--threshold τ]`."""
        if halt is None:
            if threshold is not None:
                raise ValueError("threshold needs halt=POLICY (as --threshold needs --halt)")
            return None
        if isinstance(halt, Halt):
            halt, threshold = halt.policy, halt.threshold if threshold is None else threshold
        if halt not in POLICIES:
            raise ValueError(f"halt: unknown policy {halt!r}; choose one of {', '.join(POLICIES)}")
        if threshold is None:
            if self.run_dir is None:
                raise ValueError("halt without threshold needs a model loaded from a run directory "
                                 "(its calibrated RUN/eval/halting.json); give threshold=τ")
            threshold = run_threshold(self.run_dir, halt, getattr(self, "run_config", None))
        elif isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not math.isfinite(threshold):
            raise ValueError(f"threshold must be a finite number, got {threshold!r}")
        return Halt(halt, float(threshold))

    @torch.no_grad()
    def generate(self, inputs: Optional[torch.Tensor] = None, *args, halt=None, threshold=None, **kwargs):
        """GenerationMixin.generate with loopscale's extras: `n_loops=k` (any depth) and
        `halt=POLICY` [`threshold=τ`] (per-token early exit, as `loopscale generate --halt`:
        τ defaults to the run's calibrated threshold). Token ids are checked first (one line)."""
        ids = inputs if inputs is not None else kwargs.get("input_ids")
        if ids is not None:
            self._check_ids(ids)
        h = self._halt(halt, threshold)
        if h is not None:
            if kwargs.get("use_cache") is False:
                raise ValueError("halting needs the KV cache (use_cache=True)")
            kwargs["halt"] = h
        return super().generate(inputs, *args, **kwargs)

    # -- forward ----------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                past_key_values: Optional[LoopscaleCache] = None, use_cache: Optional[bool] = None,
                labels: Optional[torch.Tensor] = None, n_loops: Optional[int] = None,
                output_hidden_states: Optional[bool] = None, return_dict: Optional[bool] = None,
                halt=None, threshold=None, **kwargs) -> LoopscaleCausalLMOutput:
        """Logits after loop n_loops with the final readout (with a cache: of the positions fed
        now inside the window). Each row is computed on its attended ids alone (positions from
        0); a masked position carries the outputs of the last attended one before it (zeros
        before the first), so padded batches read the right next-token logits at the end."""
        n = self.config.n_loops if n_loops is None else n_loops
        check_depth(n)
        self._check_ids(input_ids)
        want_hidden = bool(self.config.output_hidden_states if output_hidden_states is None else output_hidden_states)
        h = halt if isinstance(halt, Halt) or halt is None else self._halt(halt, threshold)
        mask = None
        if attention_mask is not None:
            if attention_mask.shape[0] != input_ids.shape[0] or attention_mask.shape[1] < input_ids.shape[1]:
                raise ValueError(f"attention_mask of shape {list(attention_mask.shape)} does not cover "
                                 f"input_ids of shape {list(input_ids.shape)}")
            mask = attention_mask[:, -input_ids.shape[1]:].bool()
            if bool(mask.all()):
                mask = None
        if h is not None and want_hidden:
            raise ValueError("output_hidden_states is not available with halting: a halted token runs fewer loops")
        if use_cache or isinstance(past_key_values, LoopscaleCache):
            cache = past_key_values if isinstance(past_key_values, LoopscaleCache) else LoopscaleCache()
            logits, hidden, exits = self._cached(cache, input_ids, mask, n, h, want_hidden)
        else:
            if h is not None:
                raise ValueError("halting needs the KV cache (use_cache=True)")
            cache = None
            logits, hidden, exits = self._uncached(input_ids, mask, n, want_hidden)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                   labels[:, -logits.shape[1]:][:, 1:].reshape(-1), ignore_index=-100)
        return LoopscaleCausalLMOutput(loss=loss, logits=logits, past_key_values=cache,
                                       hidden_states=hidden, exit_logits=exits)

    def _readouts(self, states: list, n: int, want_hidden: bool):
        """(final logits, hidden states, exit logits) of [E, H_1..H_n]."""
        lm = self.lm
        logits = lm.logits(states[-1], final=True).float()
        if not want_hidden:
            return logits, None, None
        exits = tuple(lm.logits(hk, final=k == n, k=k).float() for k, hk in enumerate(states[1:], 1))
        return logits, tuple(states), exits

    def _full(self, ids: torch.Tensor, n: int, want_hidden: bool):
        """One uncached pass over ids [B, T]: (logits, hidden states, exit logits)."""
        lm = self.lm
        if ids.shape[1] > lm.cfg.seq_len:
            raise ValueError(f"{ids.shape[1]} tokens exceed the model's {lm.cfg.seq_len} learned positions; "
                             f"generate with use_cache=True (the window slides) or truncate the input")
        embedded = []

        def keep_input(k, x, h):
            if k == 1:
                embedded.append(x)
            return h
        states = lm(ids, n_loops=n, state_fn=keep_input if want_hidden else None)
        return self._readouts(embedded + states, n, want_hidden)

    def _uncached(self, ids: torch.Tensor, mask: Optional[torch.Tensor], n: int, want_hidden: bool):
        if mask is None:
            return self._full(ids, n, want_hidden)
        rows = []
        for i in range(ids.shape[0]):  # each row on its attended ids alone
            keep = mask[i].nonzero().squeeze(1)
            rows.append((keep, self._full(ids[i:i + 1, keep], n, want_hidden) if keep.numel() else None))
        return _scatter(rows, ids.shape[1])

    def _cached(self, cache: LoopscaleCache, ids: torch.Tensor, mask: Optional[torch.Tensor], n: int,
                halt: Optional[Halt], want_hidden: bool):
        """Feed `ids` after the cached ones (generate.py's decoding and window slides)."""
        if cache.n_loops not in (None, n):
            raise ValueError(f"n_loops changed from {cache.n_loops} to {n} within one cached generation")
        if cache._seen and (cache.halt != halt):
            raise ValueError("halt changed within one cached generation")
        cache.n_loops, cache.halt = n, halt
        cache._seen += ids.shape[1]
        if cache.rows is None and cache.decoder is None and (mask is not None or halt is not None):
            cache.rows = [_Row() for _ in range(ids.shape[0])]
        if cache.rows is not None:
            return self._cached_rows(cache, ids, mask, n, halt, want_hidden)
        if mask is not None:
            raise ValueError("padding (an attention mask with zeros) after the first call of a cached generation "
                             "of equal-length rows")
        seq = self.lm.cfg.seq_len
        cache.ids = ids if cache.ids is None else torch.cat([cache.ids, ids], dim=1)
        if cache.decoder is None:  # the prompt: a prompt longer than the window keeps its last seq_len
            window = cache.ids[:, -seq:]
        elif cache.decoder.pos + ids.shape[1] > seq:  # no position left: slide the window
            window = cache.ids[:, -max(1, seq // 2):]  # (a seq_len-1 model keeps the new token)
            cache._slides += 1
        else:
            return self._readouts(cache.decoder.states(ids, every_loop=True), n, want_hidden)
        cache.decoder = Decoder(self.lm, n)
        states = cache.decoder.states(window, every_loop=True)
        keep = min(ids.shape[1], window.shape[1])
        return self._readouts([s[:, -keep:] for s in states], n, want_hidden)

    def _cached_rows(self, cache: LoopscaleCache, ids: torch.Tensor, mask: Optional[torch.Tensor], n: int,
                     halt: Optional[Halt], want_hidden: bool):
        """Per-row decoding: row i is fed its attended new ids, exactly as `loopscale generate`
        feeds one sequence (the prompt at full depth, then one token at a time, halting per
        token, the window sliding when a token has no position left)."""
        if len(cache.rows) != ids.shape[0]:
            raise ValueError(f"the batch changed from {len(cache.rows)} to {ids.shape[0]} rows within one cached generation")
        lm, seq = self.lm, self.lm.cfg.seq_len
        out = []
        for i, row in enumerate(cache.rows):
            keep = torch.arange(ids.shape[1], device=ids.device) if mask is None else mask[i].nonzero().squeeze(1)
            new = ids[i, keep].tolist()
            if not new:
                out.append((keep, None))
                continue
            row.ids.extend(new)
            window = new  # what the decoder is fed: the new ids, or a whole window to a new decoder
            if row.decoder is None or row.decoder.pos + len(new) > seq:
                if row.decoder is None:
                    window = row.ids[-seq:]  # the prompt (its last seq_len ids)
                else:  # no position left: slide the window
                    window = row.ids[-max(1, seq // 2):]
                    row.slides += 1
                row.decoder = Decoder(lm, n, halt)
            t = torch.tensor([window], device=ids.device)
            fed = min(len(new), len(window))
            if halt is not None and row.decoder.pos > 0 and t.shape[1] == 1:
                z, loops = row.decoder(t)  # may exit early: the token's logits come from exit `loops`
                res = (z[None, None], None, None)
            else:
                states = row.decoder.states(t, every_loop=True)
                res = self._readouts([s[:, -fed:] for s in states], n, want_hidden)
                # the next-token logits exactly as generate.Decoder reads them (one position)
                last = lm.logits(states[-1][:, -1], final=True).float()
                res[0][:, -1] = last
                loops = n
            row.loops.append(loops)
            out.append((keep[-fed:], res))
        return _scatter(out, ids.shape[1], cache.rows)

    def prepare_inputs_for_generation(self, input_ids, past_key_values=None, attention_mask=None,
                                      use_cache=None, n_loops=None, halt=None, threshold=None,
                                      output_hidden_states=None, **kwargs):
        if isinstance(past_key_values, LoopscaleCache) and past_key_values._seen:
            input_ids = input_ids[:, past_key_values._seen:]  # only the new tokens
        return {"input_ids": input_ids, "past_key_values": past_key_values, "attention_mask": attention_mask,
                "use_cache": use_cache, "n_loops": n_loops, "halt": halt, "output_hidden_states": output_hidden_states}

    # -- saving: the loopscale layout, so loopscale.load reads it back -------------
    def save_pretrained(self, save_directory, overwrite: bool = False, **kwargs):
        """Write the run's artifact files (artifacts.write_run_files) into `save_directory`;
        the tokenizer is written by the tokenizer's own save_pretrained. A directory that
        already holds a run (its record, config or weights) is refused unless overwrite=True."""
        out = Path(save_directory)
        present = [name for name in (RECORD, HF_CONFIG, WEIGHTS, "model.pt") if os.path.lexists(out / name)]
        if present and not overwrite:
            raise FileExistsError(f"{out} already holds a run ({', '.join(present)}): refusing to write over it; "
                                  f"choose a new directory or pass overwrite=True")
        out.mkdir(parents=True, exist_ok=True)
        cfg = getattr(self, "run_config", None)
        if cfg is None or cfg.model != self.lm.cfg:  # a model built here: its data settings are unknown
            cfg = RunConfig(model=self.lm.cfg)
            cfg.data = dataclasses.replace(cfg.data, vocab_size=min(self.lm.cfg.vocab_size, 65535))
        record = {"config": cfg.to_dict(), "env": {}, "data": {}}
        write_run_files(out, self.lm, record, None)


def _scatter(rows: list, T: int, states: Optional[list] = None):
    """Per-row results [(attended positions, (logits, hidden, exits) over them or None)] placed
    at their positions of a [B, T] batch; a masked position carries the outputs of the last
    attended position before it (`states[i].last`: from an earlier call), zeros before any."""
    ref = next((r for _, r in rows if r is not None), None)
    if ref is None and states is not None:
        ref = next((s.last for s in states if s.last is not None), None)
    if ref is None:
        raise ValueError("every row of the batch is fully masked (attention_mask all zeros): nothing to compute")

    def place(get, i, keep, res):
        val = get(res) if res is not None else None
        prev = get(states[i].last) if states is not None and states[i].last is not None else None
        full = torch.zeros((T,) + get(ref).shape[2:], dtype=get(ref).dtype, device=get(ref).device)
        if val is not None:
            full[keep] = val[0]
        idx = torch.full((T,), -1, dtype=torch.long, device=full.device)
        if keep.numel():
            idx[keep] = keep
        idx = torch.cummax(idx, 0).values  # the last attended position at or before each position
        fill = idx >= 0
        full[fill] = full[idx[fill]]
        if prev is not None:
            full[~fill] = prev[0, -1]
        return full

    def stack(get):
        return torch.stack([place(get, i, keep, res) for i, (keep, res) in enumerate(rows)])

    logits = stack(lambda r: r[0])
    hidden = exits = None
    if ref[1] is not None:
        hidden = tuple(stack(lambda r, j=j: r[1][j]) for j in range(len(ref[1])))
        exits = tuple(stack(lambda r, j=j: r[2][j]) for j in range(len(ref[2])))
    if states is not None:
        for i, s in enumerate(states):
            s.last = (logits[i:i + 1, -1:], None if hidden is None else tuple(h[i:i + 1, -1:] for h in hidden),
                      None if exits is None else tuple(e[i:i + 1, -1:] for e in exits))
    return logits, hidden, exits


def _expected_hf_config(run: Path, cfg, tok) -> dict:
    """config.json as loopscale writes it for this run (artifacts.hf_config); the run's own
    config.json, where it is the Hugging Face config, must say the same, key by key."""
    record, rec_path = read_record(run)
    path = run / HF_CONFIG
    if rec_path.name != RECORD or not path.exists():  # an older layout: config.json is the record
        return {k: v for k, v in hf_config(record, "", None, role_token_ids(tok)).items() if k != "loopscale"}
    raw = read_json(path, "Hugging Face config")
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path} is not a JSON object: not the run's Hugging Face config")
    ls = raw.get("loopscale") if isinstance(raw.get("loopscale"), dict) else {}
    want = hf_config(record, ls.get("weights_sha256"), ls.get("tokenizer_sha256"), role_token_ids(tok))
    for key in sorted(set(raw) | set(want)):
        if key == "loopscale":
            have = raw.get(key)
            if not isinstance(have, dict) or {k: v for k, v in have.items() if k != "version"} != \
                    {k: v for k, v in want[key].items() if k != "version"}:
                raise CheckpointError(f"{path}: its 'loopscale' record differs from the one written for {rec_path}: "
                                      f"edited or mixed files; re-export the run (loopscale export)")
            continue
        if key not in want:
            alias = LoopscaleConfig.attribute_map.get(key)
            what = f" (an alias of {alias}, which is {want[alias]!r})" if alias in want else ""
            raise CheckpointError(f"{path} has {key}={raw[key]!r}{what}, which loopscale does not write: "
                                  f"edited config; re-export the run (loopscale export)")
        if key in raw and raw[key] != want[key]:
            raise CheckpointError(f"{path} says {key}={raw[key]!r} but the run ({rec_path} and its tokenizer) "
                                  f"gives {want[key]!r}: edited or mixed files; re-export the run (loopscale export)")
    return {k: v for k, v in want.items() if k != "loopscale"}


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


if __package__ == "loopscale":  # not in a run's bundled copy (remote.py): transformers loads that itself
    register()
__all__ = ["LoopscaleConfig", "LoopscaleForCausalLM", "LoopscaleCache", "register"]
assert HF_ARCHITECTURE == LoopscaleForCausalLM.__name__
