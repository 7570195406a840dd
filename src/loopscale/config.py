"""Run and evaluation configuration: dataclasses, presets, overrides and validation.

A `RunConfig` (model + objective + data + train) is what the trained weights depend on; an
`EvalConfig` (RUN/eval.yaml) is how a trained run is evaluated. Each field declares its type
and allowed values once, on its annotation (`Range`, `Choices`); `from_mapping` checks them and
`settings_schemas` turns them into params.yaml's JSON schema. docs/usage.md ("Configuration
code") has the details.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import hashlib
import json
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Optional

import yaml

from . import registry

INITS = ("pytorch", "gpt2")
SOURCES = ("builtin", "wikitext-103", "wikitext-2", "text-files", "fineweb")
# fineweb: the corpus a second evaluation corpus can come from (data.eval_corpus)
EVAL_CORPORA = ("wikitext-103", "wikitext-2")
TOKENIZERS = ("word", "bpe")
FIT_ON = ("train+validation", "train")
# paper: the official stream (rows, fitted per row, joined with "\n\n": row boundaries are <unk>);
# joined: loopscale's earlier rule (blank lines dropped, fitted on the joined text). docs/data.md
TOKENIZATIONS = ("paper", "joined")
DEVICES = ("auto", "cpu", "cuda", "mps")
PRECISIONS = ("auto", "fp32", "bf16")
CE_IMPLS = ("chunked", "plain")
ALPHA_S_REFS = ("ema", "fixed", "learned")


class ConfigError(ValueError):
    """A bad setting. The message is one line and names the offending key."""


# ---------------------------------------------------------------------------
# the values a setting may take, declared once on its field (typing.Annotated)
# ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Range:
    """The values a numeric setting may take: finite, lo <= v <= hi (`<` where open)."""
    lo: float = -math.inf
    hi: float = math.inf
    lo_open: bool = False
    hi_open: bool = False

    def __contains__(self, v) -> bool:
        return (math.isfinite(v) and (self.lo < v if self.lo_open else self.lo <= v)
                and (v < self.hi if self.hi_open else v <= self.hi))

    def __str__(self) -> str:
        lo = f"{'>' if self.lo_open else '>='} {_num(self.lo)}"
        if self.hi == math.inf:
            return lo
        return f"in {'(' if self.lo_open else '['}{_num(self.lo)}, {_num(self.hi)}{')' if self.hi_open else ']'}"


@dataclass(frozen=True)
class Choices:
    """The names a string setting may take: a tuple, or a function returning them (read when a
    config is checked, so loopscale.registry stays their one source)."""
    names: Any

    def __call__(self) -> tuple:
        return tuple(self.names() if callable(self.names) else self.names)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


POSITIVE, NON_NEGATIVE, FRACTION, UNIT = Range(0, lo_open=True), Range(0), Range(0, 1, hi_open=True), Range(0, 1)
SEED = Range(0, 2**63 - 1)  # torch and numpy seeds: non-negative, int64
MAX_THREADS = 1024  # CPU threads any command may ask torch for (100,000 crashes torch's pool)
THREADS = Range(0, MAX_THREADS)

# The one table of size limits: every reader (a run directory, a Hugging Face Ouro checkpoint,
# an official checkpoint), every config (the bounds of the fields below, so `--set` and the
# pipeline too) and every command-line size argument is bounded by these, far beyond the
# paper's largest model (Appendix B's Ouro-1.4B: d 2048, 24 layers, K = 4) and its grids, so a
# hostile or mistyped value is one line before anything is allocated or run.
LIMITS: dict[str, int] = {
    "vocab_size": 2**24, "d_model": 2**16, "d_ff": 2**18, "seq_len": 2**20, "n_layers": 4096,
    "n_heads": 2**16, "n_loops": 10_000,
    "batch_size": 2**16,      # sequences per batch of any training or evaluation command
    "eval_loops": 1024,       # the deepest evaluation: ouro-depth --max-k, eval.lemma_loops
    "depth_factor": 64,       # eval.depth_factor: extrapolation to depth_factor x K
    "grid_runs": 2000,        # the runs one experiment of exp.yaml / params.yaml may expand to
}


def bounded(name: str, lo: float = 0, lo_open: bool = True) -> Range:
    """The Range of a size setting: (lo, LIMITS[name]]."""
    return Range(lo, LIMITS[name], lo_open=lo_open)


def check_arg(flag: str, value, allowed: Range, integer: bool = True) -> None:
    """A command-line number against its Range (one ConfigError line naming the flag)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value in allowed
    if not (ok and (not integer or float(value).is_integer())):
        kind = "an integer" if integer else "a finite number"
        raise ConfigError(f"{flag} must be {kind} {allowed}, got {value!r}")


def _size(name: str, lo: float = 0, lo_open: bool = True):
    return Annotated[int, bounded(name, lo, lo_open)]


PosInt, NonNegInt, Seed = Annotated[int, POSITIVE], Annotated[int, NON_NEGATIVE], Annotated[int, SEED]
PosFloat, NonNegFloat, Unit = Annotated[float, POSITIVE], Annotated[float, NON_NEGATIVE], Annotated[float, UNIT]
Device = Annotated[str, Choices(DEVICES)]


def _of_registry(name: str):
    """A string setting whose names are loopscale.registry's table `name`."""
    return Annotated[str, Choices(lambda: tuple(getattr(registry, name)))]


@dataclass
class ModelConfig:
    vocab_size: _size("vocab_size") = 20000
    d_model: _size("d_model") = 512
    n_layers: _size("n_layers") = 8
    n_heads: _size("n_heads") = 8
    d_ff: _size("d_ff") = 2048  # SwiGLU hidden width
    seq_len: _size("seq_len") = 256
    n_loops: _size("n_loops") = 4  # K: how often the shared stack is applied in training
    dropout: Annotated[float, FRACTION] = 0.1
    norm_eps: PosFloat = 1e-6
    readout: _of_registry("READOUTS") = "rmsnorm"
    recurrence: _of_registry("RECURRENCES") = "residual"
    init: Annotated[str, Choices(INITS)] = "pytorch"  # pytorch (paper: N(0,1) embeddings) | gpt2 (N(0, 0.02))
    # the official release's model options (docs/diagnostics.md, "Model options of the official release")
    alpha_init: Unit = 0.5  # readout=alpha_readout: the learned α's start (alpha_readout.init_alpha)
    alpha_fixed: Optional[Unit] = None  # a constant α in [0, 1] instead of a learned one (fixed_alpha)
    alpha_min: Unit = 0.0  # the learned α's range (alpha_readout.alpha_min / alpha_max)
    alpha_max: Unit = 1.0
    alpha_s_ref: Annotated[str, Choices(ALPHA_S_REFS)] = "ema"  # alpha_readout.s_ref_mode
    alpha_ema_decay: Unit = 0.99  # of the EMA s_ref (alpha_readout.ema_decay)
    alpha_log_s_ref: Annotated[float, Range()] = 0.0  # log s_ref's start (alpha_readout.init_log_s_ref)
    alpha_per_loop: bool = False  # one alpha readout per exit (alpha_readout.per_loop_alpha)
    taper_ema_decay: Unit = 0.99  # readout=tapernorm: calibration EMA (taper_norm.ema_decay)
    taper_warmup_frac: Unit = 0.05  # share of training at gate 1 (taper_norm.gate_warmup_frac)
    taper_decay_frac: Optional[Unit] = None  # share of training the gate decays over (None: the rest)
    exit_gate: bool = False  # a learned exit gate Linear(d, 1) on H_k (on whenever objective.loss reads it)
    arch: _of_registry("ARCHS") = "looped"  # loopscale.model.ARCHITECTURES: looped | ouro
    n_kv_heads: _size("n_heads", 0, False) = 0  # key/value heads (grouped-query attention); 0 = n_heads
    rope_theta: PosFloat = 1e6  # ouro: RoPE base


@dataclass
class ObjectiveConfig:
    loss: _of_registry("LOSSES") = "per_loop"
    regularizer: _of_registry("REGULARIZERS") = "none"
    penalty_weight: NonNegFloat = registry.PAPER_PENALTY_WEIGHT  # lambda of the norm penalty
    ce_impl: Annotated[str, Choices(CE_IMPLS)] = "chunked"  # chunked (memory-lean, exact) | plain
    ce_chunk_tokens: PosInt = 4096  # tokens per chunk of the chunked cross-entropy
    entropy_weight: NonNegFloat = 0.1  # loss=adaptive: weight of the exit distribution's entropy bonus
    anchor_weight: NonNegFloat = 0.01  # regularizer=scale_anchor: its weight (official supervision.scale_anchor_weight)
    anchor_target: NonNegFloat = 1.0  # the RMS of H the anchor pulls towards (supervision.scale_anchor_target)


@dataclass
class DataConfig:
    source: Annotated[str, Choices(SOURCES)] = "builtin"
    train_file: Optional[str] = None  # for source=text-files
    validation_file: Optional[str] = None
    test_file: Optional[str] = None
    tokenizer: Annotated[str, Choices(TOKENIZERS)] = "word"  # word (paper regex) | bpe (byte-level BPE)
    vocab_size: PosInt = 20000  # includes the special tokens
    min_frequency: Annotated[int, Range(1)] = 2
    fit_on: Annotated[str, Choices(FIT_ON)] = "train+validation"  # paper: train + validation
    validation_fraction: Annotated[float, Range(0, 1, True, True)] = 0.05  # builtin corpus: documents per split
    test_fraction: Annotated[float, FRACTION] = 0.05
    split_seed: Seed = 0
    max_documents: NonNegInt = 0  # >0: keep only the first N documents of each split (quick tests)
    tokenization: Annotated[str, Choices(TOKENIZATIONS)] = "paper"  # paper (the official token stream) | joined
    # wikitext-* (or fineweb's eval_corpus): a local folder laid out like Salesforce/wikitext, or a hub id
    hf_dataset: Optional[str] = None
    # source=fineweb (Appendix B's recipe): training streams the corpus (loopscale train-stream);
    # prepare-data writes the held-out documents (validation, test) and the eval corpus. The
    # pipeline leaves these keys out of the files it writes while they hold their defaults.
    pretrained_tokenizer: Optional[str] = None  # a directory with tokenizer.json, a tokenizer.json, or a hub name
    data_files: list = field(default_factory=list)  # local parquet files in FineWeb's schema instead of the hub
    stream_dataset: str = "HuggingFaceFW/fineweb"  # the hub dataset streamed when data_files is empty
    stream_subset: str = "sample-10BT"
    heldout_documents: NonNegInt = 0  # the stream's first N documents (file order): never trained on; validation, then test
    min_chars: NonNegInt = 50  # documents shorter once stripped are skipped (the official filter)
    # also prepare wikitext-103 | wikitext-2 with the same tokenizer (DATA/<name>/)
    eval_corpus: Optional[Annotated[str, Choices(EVAL_CORPORA)]] = None


@dataclass
class TrainConfig:
    batch_size: _size("batch_size") = 64  # the global batch (all ranks x grad_accum micro-batches)
    grad_accum: PosInt = 1  # micro-batches per step and rank: per-rank batch = batch_size / (ranks x grad_accum)
    fsdp: bool = False  # under torchrun: shard weights/grads/AdamW state over the ranks (FSDP2) instead of DDP
    lr: PosFloat = 3e-4  # constant, no warm-up or decay (paper)
    weight_decay: NonNegFloat = 0.01
    betas: list = field(default_factory=lambda: [0.9, 0.999])
    grad_clip: PosFloat = 1.0
    epochs: PosFloat = 4.0
    max_steps: Optional[PosInt] = None  # overrides epochs when set
    stride: PosInt = 128  # training windows of seq_len+1 tokens every `stride` tokens
    seed: Seed = 42
    device: Device = "auto"
    precision: Annotated[str, Choices(PRECISIONS)] = "auto"  # auto (bf16 autocast on CUDA, else fp32) | fp32 | bf16
    compile: bool = False
    activation_checkpointing: bool = False  # recompute each block in backward: less memory, same result
    log_every: PosInt = 50
    ckpt_every: PosInt = 500
    eval_every: NonNegInt = 0  # 0: validate only at the end
    eval_tokens: NonNegInt = 65536  # validation tokens for the in-training evaluation
    eval_batch_size: _size("batch_size") = 16  # windows per batch of the in-training evaluation
    threads: Annotated[int, THREADS] = 0  # torch CPU threads; 0 leaves torch's default
    tensorboard: bool = False  # also write RUN/tensorboard/ event files (needs the tensorboard extra)
    wandb: bool = False  # also log to Weights & Biases, files in RUN/wandb/ (needs the wandb extra; WANDB_MODE=offline)


@dataclass
class EvalConfig:
    """How a trained run is evaluated (loopscale eval); never changes the weights."""
    batch_size: _size("batch_size") = 16
    max_tokens: NonNegInt = 0  # depth-eval tokens; 0 = the whole validation split
    depth_factor: _size("depth_factor", 1, False) = 3  # extrapolate to depth_factor * K
    norm_tokens: PosInt = 20480  # tokens for the per-token norm distribution
    radial_tokens: PosInt = 8192
    lemma_loops: _size("eval_loops", 2, False) = 30
    lemma_tokens: PosInt = 8192
    clamp_tokens: PosInt = 32768
    halting_tokens: PosInt = 65536
    halting_epsilon: NonNegFloat = 0.01
    scale_tokens: PosInt = 32768  # tokens of the alpha scale-sensitivity sweep
    throughput_batches: PosInt = 10
    throughput_warmup: NonNegInt = 2
    device: Device = "auto"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict, where: str = "eval") -> "EvalConfig":
        """Built and checked; error messages name keys as `<where>.<key>`."""
        return from_mapping(cls, d, where)


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    # -- dict round trip -------------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict, where: str = "") -> "RunConfig":
        if isinstance(d, dict) and "eval" in d and not where:
            raise ConfigError("unknown key 'eval': evaluation settings are not part of the run config; "
                              "give them to `loopscale eval` (--eval-config FILE, --set eval.KEY=VALUE)")
        cfg = from_mapping(cls, d, where)
        validate(cfg)
        return cfg

    @classmethod
    def from_checkpoint(cls, d: dict) -> "RunConfig":
        """The config stored in a checkpoint; one written before evaluation settings left the
        run config carries a stale `eval` section, dropped here."""
        return cls.from_dict({k: v for k, v in d.items() if k != "eval"} if isinstance(d, dict) else d)

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------
# presets
# ---------------------------------------------------------------------------
# the training settings of the test-size presets (smoke, ouro-tiny, ouro-smoke) and the Ouro
# architecture the last two share
_TINY_TRAIN = dict(batch_size=8, lr=1e-3, max_steps=30, stride=32, log_every=5, ckpt_every=10,
                   eval_tokens=2048, eval_batch_size=8)
_TINY_OURO = dict(arch="ouro", vocab_size=2048, d_model=32, d_ff=64, seq_len=32, n_loops=4, dropout=0.0,
                  rope_theta=1e4, init="gpt2", readout="rmsnorm", recurrence="inter_loop_norm")

MODEL_PRESETS: dict[str, dict] = {
    # the paper's experimental setup: 44M = d512, 8 layers, 8 heads, SwiGLU 2048, seq 256, K=4, batch 64
    "paper-44m": dict(model=dict(vocab_size=20000, d_model=512, n_layers=8, n_heads=8, d_ff=2048,
                                 seq_len=256, n_loops=4), train=dict(batch_size=64)),
    # 129M = d768, 12 layers, 12 heads, SwiGLU 3072, seq 256, K=4, batch 32
    "paper-129m": dict(model=dict(vocab_size=20000, d_model=768, n_layers=12, n_heads=12, d_ff=3072,
                                  seq_len=256, n_loops=4), train=dict(batch_size=32)),
    # Appendix B: 1.4B = d2048, 20 layers, 16 heads, SwiGLU 8192, seq 256, K=4, terminal CE,
    # global batch 8, 2 epochs, lr 2e-4, bf16 autocast; trained data-parallel (torchrun)
    "paper-1.4b": dict(model=dict(vocab_size=20000, d_model=2048, n_layers=20, n_heads=16, d_ff=8192,
                                  seq_len=256, n_loops=4),
                       objective=dict(loss="terminal"),
                       train=dict(batch_size=8, epochs=2.0, lr=2e-4, precision="bf16")),
    # laptop scale (calibrated on 2 cores: the cpu experiment, nine conditions x three seeds,
    # took 19 min 25 s with `make reproduce` on a fresh clone, docs/studies.md): the paper's
    # architecture, init, optimiser and losses; narrow, short context, small vocabulary, and
    # a higher constant lr (1e-3) so the drift shows within a few hundred steps
    "cpu": dict(model=dict(vocab_size=2048, d_model=64, n_layers=2, n_heads=2, d_ff=256,
                           seq_len=64, n_loops=4),
                data=dict(vocab_size=2048),
                train=dict(batch_size=16, lr=1e-3, max_steps=400, stride=32, log_every=20,
                           ckpt_every=100, eval_tokens=32768, eval_batch_size=32)),
    # seconds: for tests and the smoke grid
    "smoke": dict(model=dict(vocab_size=2048, d_model=32, n_layers=1, n_heads=2, d_ff=64,
                             seq_len=32, n_loops=3, dropout=0.0),
                  data=dict(vocab_size=2048), train=_TINY_TRAIN),
    # Appendix B as the official release ran it (src/train_ouro_from_scratch_ddp.py): the
    # architecture of ByteDance/Ouro-1.4B's config.json (24 layers, hidden 2048, 16 heads and 16
    # key/value heads of 128, SwiGLU 5632, vocabulary 49,152, total_ut_steps 4, rope_theta 1e6,
    # rms_norm_eps 1e-6, untied head) at seq 2048; AdamW β=(0.9, 0.95), wd 0.01, lr 3e-4, clip 1,
    # per-device batch 8 x grad-accum 3 (global 48 on 2 GPUs), activation checkpointing, bf16;
    # 16,667 steps = the official 50,000 micro-steps; windows every 2048 tokens (its chunks)
    "ouro-1.4b": dict(model=dict(arch="ouro", vocab_size=49152, d_model=2048, n_layers=24, n_heads=16,
                                 n_kv_heads=16, d_ff=5632, seq_len=2048, n_loops=4, dropout=0.0, norm_eps=1e-6,
                                 rope_theta=1e6, init="gpt2", readout="rmsnorm", recurrence="inter_loop_norm"),
                      objective=dict(loss="terminal"),
                      data=dict(tokenizer="bpe", tokenization="joined", vocab_size=49152),
                      train=dict(batch_size=48, grad_accum=3, lr=3e-4, betas=[0.9, 0.95], weight_decay=0.01,
                                 max_steps=16667, stride=2048, precision="bf16", activation_checkpointing=True,
                                 log_every=50, ckpt_every=500, eval_every=500)),
    # the Ouro architecture at test size (grouped-query attention: 4 heads, 2 key/value heads)
    "ouro-tiny": dict(model=dict(_TINY_OURO, n_layers=2, n_heads=4, n_kv_heads=2),
                      data=dict(vocab_size=2048), train=dict(_TINY_TRAIN, betas=[0.9, 0.95])),
    # seconds on a CPU: the ouro-smoke experiment's runs
    "ouro-smoke": dict(model=dict(_TINY_OURO, n_layers=1, n_heads=2, n_kv_heads=1),
                       objective=dict(loss="terminal"),
                       data=dict(vocab_size=2048), train=dict(_TINY_TRAIN, betas=[0.9, 0.95])),
}

# the evaluation settings of the test-size presets (smoke, ouro-tiny, ouro-smoke)
_TINY_EVAL = dict(batch_size=8, max_tokens=4096, norm_tokens=2048, radial_tokens=1024, lemma_loops=8,
                  lemma_tokens=1024, clamp_tokens=2048, halting_tokens=4096, throughput_batches=3,
                  throughput_warmup=1)

# the evaluation settings that go with each preset (EvalConfig fields; paper: the defaults)
EVAL_PRESETS: dict[str, dict] = {
    "paper-44m": {},
    "paper-129m": {},
    "paper-1.4b": {},
    "cpu": dict(batch_size=32, max_tokens=65536),
    "smoke": dict(_TINY_EVAL, scale_tokens=2048),
    "ouro-1.4b": dict(batch_size=2, max_tokens=32768, depth_factor=2),  # official: K = 1..8, 8 batches x 2 x 2048
    "ouro-tiny": dict(_TINY_EVAL),
    "ouro-smoke": dict(_TINY_EVAL),
}


def _check_preset(name: str) -> None:
    if name not in MODEL_PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(MODEL_PRESETS)}")


def preset_dict(name: str) -> dict:
    """A named preset as a complete, not yet validated config dict."""
    _check_preset(name)
    return merge(RunConfig().to_dict(), MODEL_PRESETS[name])


# benchmark-only shapes (`loopscale bench --preset NAME`): a preset above plus overrides;
# the pipeline never trains them
BENCH_PRESETS: dict[str, tuple[str, dict]] = {
    # the paper's architecture scaled to fit a CPU: d 256, 4 layers, 4 heads of 64, SwiGLU 1024,
    # vocabulary 8192, seq 256, batch 16, K 4, per-loop CE
    "paper-cpu": ("cpu", dict(model=dict(vocab_size=8192, d_model=256, n_layers=4, n_heads=4, d_ff=1024,
                                         seq_len=256, n_loops=4),
                              objective=dict(loss="per_loop"),
                              train=dict(batch_size=16, eval_batch_size=16))),
}


def preset(name: str, overrides: Optional[dict] = None) -> RunConfig:
    """A RunConfig from a named preset plus nested-dict overrides."""
    return RunConfig.from_dict(merge(preset_dict(name), overrides or {}))


def eval_preset(name: str, overrides: Optional[dict] = None) -> EvalConfig:
    """The EvalConfig of a named preset plus overrides (a flat dict of EvalConfig keys)."""
    _check_preset(name)
    d = merge(EvalConfig().to_dict(), EVAL_PRESETS[name], "eval")
    return EvalConfig.from_dict(merge(d, overrides or {}, "eval"))


def merge(base: dict, update: dict, where: str = "") -> dict:
    """Deep-merge `update` into a copy of `base`; keys of `update` must exist in `base`."""
    out = copy.deepcopy(base)
    for k, v in update.items():
        key = _join(where, k)
        if k not in out:
            raise ConfigError(f"unknown key {key!r}{did_you_mean(k, out, where)}")
        if isinstance(out[k], dict) and isinstance(v, dict):
            out[k] = merge(out[k], v, key)
        else:
            out[k] = copy.deepcopy(v)
    return out


def did_you_mean(key: str, known, where: str = "") -> str:
    """"; did you mean 'train.max_steps'?" for the known key closest to a mistyped one (difflib), or ""."""
    close = difflib.get_close_matches(str(key), [str(k) for k in known], n=1)
    return f"; did you mean {_join(where, close[0])!r}?" if close else ""


def parse_overrides(items: list[str]) -> dict:
    """`["train.lr=1e-3", "model.readout=raw"]` -> nested dict (values parsed as YAML)."""
    out: dict = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        path, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError:
            value = raw
        node = out
        parts = path.strip().split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return out


MAX_YAML_NODES = 100_000  # what a settings file may expand to through its aliases


class BoundedLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
    """Safe YAML (libyaml when available) that refuses documents whose aliases expand to more
    than `MAX_YAML_NODES` nodes (an alias bomb) or refer to themselves."""

    def construct_document(self, node):
        _expanded_size(node, {})
        return super().construct_document(node)

    def construct_mapping(self, node, deep=False):
        """A mapping whose keys are unique: a key given twice (a copy-pasted block) is refused,
        never resolved "last wins". Keys a `<<:` merge brings in may still be overridden."""
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                    continue
                key = self.construct_object(key_node)
                try:
                    if key in seen:
                        raise yaml.constructor.ConstructorError(
                            None, None, f"duplicate key {key!r} (first given on line {seen[key] + 1})",
                            key_node.start_mark)
                    seen[key] = key_node.start_mark.line
                except TypeError:  # an unhashable key: the base class names it
                    continue
        return super().construct_mapping(node, deep=deep)


def _expanded_size(node, memo: dict) -> int:
    """Nodes of `node` with every alias expanded, counted in time linear in the document."""
    key = id(node)
    if key in memo:
        if memo[key] is None:
            raise yaml.YAMLError("an alias refers to the node that holds it")
        return memo[key]
    memo[key] = None
    children = node.value if isinstance(node, yaml.SequenceNode) else \
        [n for kv in node.value for n in kv] if isinstance(node, yaml.MappingNode) else []
    size = 1 + sum(_expanded_size(c, memo) for c in children)
    if size > MAX_YAML_NODES:
        raise yaml.YAMLError(f"its aliases expand to more than {MAX_YAML_NODES:,} nodes")
    memo[key] = size
    return size


def read_yaml(path: str | Path, what: str = "") -> Any:
    """The YAML document of a file; any problem is one ConfigError naming the file."""
    from .io import read_text_file
    name = f"{what} {str(path)!r}" if what else str(path)
    text = read_text_file(path, name, ConfigError)
    try:
        return yaml.load(text, Loader=BoundedLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" (line {mark.line + 1})" if mark is not None else ""
        problem = getattr(e, "problem", None) or (str(e).splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"{name}: not valid YAML{at}: {problem}") from None
    except RecursionError:
        raise ConfigError(f"{name}: nested too deeply") from None


def read_config_file(path: str | Path) -> dict:
    """The settings a config file sets (a mapping; a `preset:` key is kept)."""
    d = read_yaml(path, "config file")
    if d is None:
        return {}
    if not isinstance(d, dict):
        raise ConfigError(f"config file {str(path)!r}: must hold a mapping at top level, got {type(d).__name__}")
    return dict(d)


def config_dict(path: Optional[str] = None, preset_name: Optional[str] = None) -> dict:
    """A preset <- a run config file, as a complete, not yet validated dict. The preset is
    `preset_name` or the file's `preset:` key (else the defaults); every key the file sets
    is kept, also one equal to the global default."""
    d = read_config_file(path) if path else {}
    named = d.pop("preset", None)
    if preset_name and named and named != preset_name:
        raise ConfigError(f"config file {str(path)!r} names preset {named!r} but --preset is {preset_name!r}")
    if "eval" in d:
        raise ConfigError(f"config file {str(path)!r}: unknown key 'eval': evaluation settings are not part of the "
                          f"run config; give them to `loopscale eval` (--eval-config FILE)")
    name = preset_name or named
    return merge(preset_dict(name) if name else RunConfig().to_dict(), d)


def resolve(path: Optional[str] = None, preset_name: Optional[str] = None,
            overrides: Optional[list[str]] = None) -> RunConfig:
    """A preset <- a config file <- `--set` overrides (later layers win), merged and validated once."""
    d = config_dict(path, preset_name)
    if overrides:
        d = merge(d, parse_overrides(overrides))  # errors name the key as given: train.max_steps
    return RunConfig.from_dict(d)


def load_config(path: str, overrides: Optional[list[str]] = None) -> RunConfig:
    """Load a run config from YAML/JSON. A top-level `preset:` key starts from that preset."""
    return resolve(path, None, overrides)


def load_eval_config(path: Optional[str] = None, overrides: Optional[list[str]] = None,
                     preset_name: Optional[str] = None, base: Optional[EvalConfig] = None) -> EvalConfig:
    """The evaluation settings: `base` (default: the defaults) <- a preset's <- the file
    `path` (a mapping of EvalConfig keys, e.g. RUN/eval.yaml; may name a `preset:`) <-
    `--set eval.KEY=VALUE` overrides. Merged once, validated once."""
    d = read_config_file(path) if path else {}
    name = d.pop("preset", None) or preset_name
    start = (base or EvalConfig()).to_dict()
    if name is not None:
        _check_preset(name)
        start = merge(start, EVAL_PRESETS[name], "eval")
    d = merge(start, d, "eval")
    if overrides:
        upd = parse_overrides(overrides)
        bad = [k for k in upd if k != "eval"]
        if bad:
            raise ConfigError(f"--set {bad[0]}.…: evaluation takes eval.* overrides only "
                              f"(the model's other settings are fixed by training)")
        if not isinstance(upd["eval"], dict):
            raise ConfigError("--set eval=…: give one key, e.g. --set eval.max_tokens=65536")
        d = merge(d, upd["eval"], "eval")
    return EvalConfig.from_dict(d)


# ---------------------------------------------------------------------------
# typed construction and validation: one function for every config dataclass
# ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Rule:
    """What a field's annotation allows: its type, None or not, a Range and Choices."""
    type: Any
    optional: bool = False
    bound: Optional[Range] = None
    choices: Optional[Choices] = None


@functools.cache
def rules(cls) -> dict[str, Rule]:
    """{field name: Rule} of a config dataclass, read from its annotations."""
    out = {}
    for name, tp in typing.get_type_hints(cls, include_extras=True).items():
        optional = typing.get_origin(tp) is typing.Union
        if optional:
            tp = next(a for a in typing.get_args(tp) if a is not type(None))
        extras: tuple = ()
        if typing.get_origin(tp) is Annotated:
            tp, *extras = typing.get_args(tp)
        out[name] = Rule(tp, optional, next((x for x in extras if isinstance(x, Range)), None),
                         next((x for x in extras if isinstance(x, Choices)), None))
    return out


def from_mapping(cls, d: Any, where: str = ""):
    """A config dataclass (nested sections included) from a mapping: unknown keys, types,
    choices and ranges are checked, each as one ConfigError line naming `<where>.<key>`."""
    if not isinstance(d, dict):
        raise ConfigError(f"{where or 'config'} must be a mapping, got {type(d).__name__}")
    known = rules(cls)
    for k in d:
        if k not in known:
            raise ConfigError(f"unknown key {_join(where, k)!r}{did_you_mean(k, known, where)}")
    return check(cls(**{k: d[k] for k in known if k in d}), where)


def check(obj, where: str = ""):
    """Check (and coerce in place) every field of a config dataclass against its Rule."""
    for name, rule in rules(type(obj)).items():
        setattr(obj, name, _value(rule, getattr(obj, name), _join(where, name)))
    return obj


SECTIONS = {"model": ModelConfig, "objective": ObjectiveConfig, "data": DataConfig, "train": TrainConfig,
            "eval": EvalConfig}


def setting_error(section: str, name: str, value) -> Optional[str]:
    """The ConfigError message `from_mapping` gives for `section.name` set to `value`; None
    when the value is fine or `section.name` is no setting (params.yaml's schema errors say
    what the config would say)."""
    rule = rules(SECTIONS[section]).get(name) if section in SECTIONS else None
    try:
        _value(rule, value, f"{section}.{name}") if rule else None
    except ConfigError as e:
        return str(e)
    return None


def _join(where: str, k: str) -> str:
    return f"{where}.{k}" if where else k


def _value(rule: Rule, v, key: str):
    tp = rule.type
    if v is None and rule.optional:
        return None
    if dataclasses.is_dataclass(tp):
        return check(v, key) if isinstance(v, tp) else from_mapping(tp, v, key)
    if tp is float and isinstance(v, str):
        try:
            v = float(v)  # YAML 1.1 reads 1e-3 as a string
        except ValueError:
            pass
    number = isinstance(v, (int, float)) and not isinstance(v, bool)
    if tp is bool and not isinstance(v, bool):
        raise ConfigError(f"{key} must be true or false, got {v!r}")
    if tp is int and not (number and float(v).is_integer()):
        raise ConfigError(f"{key} must be an integer, got {v!r}")
    if tp is float and not number:
        raise ConfigError(f"{key} must be a number, got {v!r}")
    if tp is str and not isinstance(v, str):
        raise ConfigError(f"{key} must be a string, got {v!r}")
    if tp is list and not isinstance(v, (list, tuple)):
        raise ConfigError(f"{key} must be a list, got {v!r}")
    v = tp(v) if tp in (int, float, list) else v
    if rule.choices is not None and v not in rule.choices():
        raise ConfigError(f"{key}: unknown value {v!r}; choose one of {', '.join(rule.choices())}")
    if rule.bound is not None and v not in rule.bound:
        raise ConfigError(f"{key} must be {'a finite number ' if tp is float else ''}{rule.bound}, got {v!r}")
    return v


# train settings a finished run's results do not depend on: a finished run is reused when only
# they change, and runs that differ only in them (and the seed) are seeds of one experiment
RESULT_FREE = ("threads", "device", "compile", "activation_checkpointing", "ckpt_every", "tensorboard", "wandb")
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")  # token ids 0..3 of every tokenizer


def validate_data(d: DataConfig) -> None:
    """Check the data settings on their own (what `loopscale prepare-data` reads)."""
    check(d, "data")
    _check_data(d)


def _check_data(d: DataConfig) -> None:
    if d.vocab_size > 65535:
        raise ConfigError(f"data.vocab_size {d.vocab_size} does not fit uint16 token storage (max 65535)")
    smallest = len(SPECIAL_TOKENS) + (256 if d.tokenizer == "bpe" else 1)
    if d.vocab_size < smallest:
        raise ConfigError(f"data.vocab_size {d.vocab_size} is too small for data.tokenizer={d.tokenizer} "
                          f"(needs >= {smallest}: the {len(SPECIAL_TOKENS)} special tokens"
                          f"{' and 256 byte symbols' if d.tokenizer == 'bpe' else ' and one word'})")
    if d.tokenization == "paper" and d.tokenizer != "word":
        raise ConfigError(f"data.tokenization=paper is the paper's word tokenizer; with data.tokenizer="
                          f"{d.tokenizer} set data.tokenization=joined")
    if d.hf_dataset is not None and d.source != "fineweb" and (d.source not in ("wikitext-103", "wikitext-2")
                                                               or not str(d.hf_dataset).strip()):
        raise ConfigError(f"data.hf_dataset ({d.hf_dataset!r}) needs data.source=wikitext-103 or wikitext-2 "
                          "and a folder or hub dataset id")
    _check_fineweb(d)
    if d.source == "text-files" and not (d.train_file and d.validation_file):
        raise ConfigError("data.train_file and data.validation_file are required with data.source=text-files")
    if d.validation_fraction + d.test_fraction >= 1:
        raise ConfigError("data.validation_fraction + data.test_fraction must be below 1")


# the data keys of source=fineweb and their defaults (the pipeline omits them at their defaults)
FINEWEB_KEYS = ("pretrained_tokenizer", "data_files", "stream_dataset", "stream_subset", "heldout_documents",
                "min_chars", "eval_corpus")


def fineweb_defaults() -> dict:
    d = dataclasses.asdict(DataConfig())
    return {k: d[k] for k in FINEWEB_KEYS}


def _check_fineweb(d: DataConfig) -> None:
    if d.source != "fineweb":
        for k, default in fineweb_defaults().items():
            if getattr(d, k) != default:
                raise ConfigError(f"data.{k} ({getattr(d, k)!r}) needs data.source=fineweb")
        return
    if not (isinstance(d.pretrained_tokenizer, str) and d.pretrained_tokenizer.strip()):
        raise ConfigError("data.pretrained_tokenizer is required with data.source=fineweb: a directory holding "
                          "tokenizer.json, a tokenizer.json file or a hub name (e.g. ByteDance/Ouro-1.4B)")
    if not all(isinstance(f, str) and f.strip() for f in d.data_files):
        raise ConfigError(f"data.data_files must be a list of parquet file paths, got {d.data_files!r}")
    if not d.data_files and not (d.stream_dataset.strip() and d.stream_subset.strip()):
        raise ConfigError("data.stream_dataset and data.stream_subset name the hub corpus when data.data_files "
                          "is empty; neither may be empty")
    if d.heldout_documents < 2:
        raise ConfigError(f"data.heldout_documents must be >= 2 with data.source=fineweb (held-out validation "
                          f"and test documents, never trained on), got {d.heldout_documents}")
    if d.hf_dataset is not None and (d.eval_corpus is None or not str(d.hf_dataset).strip()):
        raise ConfigError(f"data.hf_dataset ({d.hf_dataset!r}) with data.source=fineweb is the folder of "
                          "data.eval_corpus: set data.eval_corpus too")


def validate(cfg: RunConfig) -> None:
    """The settings of a run that constrain each other (each field on its own: `from_mapping`)."""
    m, t, d = cfg.model, cfg.train, cfg.data
    if m.d_model % m.n_heads:
        raise ConfigError(f"model.d_model ({m.d_model}) must be divisible by model.n_heads ({m.n_heads})")
    if m.alpha_min >= m.alpha_max:
        raise ConfigError(f"model.alpha_min ({m.alpha_min}) must be below model.alpha_max ({m.alpha_max})")
    if cfg.objective.loss in registry.GATED_LOSSES:
        m.exit_gate = True  # the loss reads the gate: the model has one (recorded in the config)
    _check_data(d)
    _check_arch(cfg)
    if t.batch_size % t.grad_accum:
        raise ConfigError(f"train.batch_size ({t.batch_size}) must be divisible by train.grad_accum ({t.grad_accum})")
    if m.vocab_size < d.vocab_size:
        raise ConfigError(f"model.vocab_size ({m.vocab_size}) is smaller than data.vocab_size ({d.vocab_size})")
    if len(t.betas) != 2 or not all(isinstance(b, (int, float)) and not isinstance(b, bool) and b in FRACTION
                                    for b in t.betas):
        raise ConfigError(f"train.betas must be two numbers in [0, 1), got {t.betas!r}")


def _check_arch(cfg: RunConfig) -> None:
    """The settings each architecture allows (registry.ARCHS)."""
    m = cfg.model
    readout = registry.READOUTS[m.readout]
    if not readout.applies_to(m.arch):
        raise ConfigError(f"model.readout {m.readout!r} is not a readout of model.arch={m.arch} (it is one of "
                          f"model.arch={'|'.join(readout.archs)}); choose one of "
                          f"{', '.join(registry.readouts_of(m.arch))}")
    kv = m.n_kv_heads or m.n_heads
    if m.n_heads % kv:
        raise ConfigError(f"model.n_heads ({m.n_heads}) must be divisible by model.n_kv_heads ({kv})")
    if m.arch == "looped":
        return
    # Ouro's recurrence is its step norm (model.norm after every step, also the exits' readout):
    # model.recurrence is not read; it may say so (inter_loop_norm) or be left at its default
    if m.recurrence not in ("residual", "inter_loop_norm"):
        raise ConfigError(f"model.recurrence={m.recurrence} does not apply to model.arch=ouro (its recurrence is "
                          f"its step norm, model.norm); leave model.recurrence out")
    if (m.d_model // m.n_heads) % 2:
        raise ConfigError(f"model.arch=ouro needs an even head size for RoPE, got d_model/n_heads = "
                          f"{m.d_model // m.n_heads}")


# ---------------------------------------------------------------------------
# the JSON schema of the settings, generated from the same annotations
# ---------------------------------------------------------------------------
_JSON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array"}


def json_schema(cls) -> dict:
    """The JSON schema (draft 2020-12) of a config dataclass as a mapping: its keys, types,
    ranges and fixed choices. A name of loopscale.registry (a readout, a loss, ...) is a string
    here, checked when the config is built, so a new readout never changes the schema; a
    number may also be a string (YAML 1.1 reads 1e-3 as one), read as a number by `from_mapping`."""
    props = {}
    for name, rule in rules(cls).items():
        if dataclasses.is_dataclass(rule.type):
            props[name] = {"$ref": f"#/$defs/{rule.type.__name__}"}
            continue
        types = [_JSON_TYPES[rule.type]] + (["string"] if rule.type is float else [])
        s: dict = {"type": types + ["null"] if rule.optional else (types if len(types) > 1 else types[0])}
        if rule.choices is not None and not callable(rule.choices.names):
            s["enum"] = list(rule.choices()) + ([None] if rule.optional else [])
        b = rule.bound
        if b is not None and b.lo > -math.inf:
            s["exclusiveMinimum" if b.lo_open else "minimum"] = b.lo
        if b is not None and b.hi < math.inf:
            s["exclusiveMaximum" if b.hi_open else "maximum"] = b.hi
        props[name] = s
    return {"type": "object", "additionalProperties": False, "properties": props}


def settings_schemas() -> dict:
    """{name: schema} of every settings section, for params.yaml's schema: the run config
    (RunConfig), its sections, the evaluation settings (EvalConfig) and RunOverrides, a run's
    overrides as params.yaml gives them (RunConfig's sections and `eval`)."""
    out = {cls.__name__: json_schema(cls) for cls in (RunConfig, ModelConfig, ObjectiveConfig, DataConfig,
                                                       TrainConfig, EvalConfig)}
    run = out["RunConfig"]
    out["RunOverrides"] = {**run, "properties": {**run["properties"], "eval": {"$ref": "#/$defs/EvalConfig"}}}
    return out

