"""Appendix B's training recipe: `loopscale train-stream`, a run trained on a streamed corpus
(FineWeb, `loopscale.fineweb`) with a cosine schedule. The batch source `Stream` feeds the one
training loop (`loopscale.train.fit`: grad accumulation, autocast, DDP/FSDP under torchrun,
the divergence guard, logging, checkpoints and preemption) inside the run directory's handling
(`loopscale.rundir.run_directory`: the run lock, a finished run kept).

The learning rate warms up linearly from 0 and decays by a cosine to `min_lr`; AdamW β =
(0.9, 0.95), as the official Ouro-track trainer. Where the official trainer's settings differ
from `loopscale train`'s, the loop runs them (`train.LoopSettings`): AdamW without the fused
kernel, the weights in bf16 with stream.pure_bf16, no model.schedule, the periodic validation
(with --val-data) on rank 0 alone. Two differences from the official trainer are deliberate:
resuming is exact (a state.pt records how many chunks each rank consumed, and the reopened
stream skips exactly those; the official trainer skips an approximate token count, and by
default none), and the schedule counts optimiser steps (the official counts micro-steps: its
1,000 warm-up micro-steps at grad-accum 3 are 333 steps).

  loopscale train-stream --preset ouro-1.4b --out RUN [--set stream.KEY=VALUE ...]
                         [--val-data DATA]        a prepared data dir for validation
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
from pathlib import Path
from typing import Optional

import torch

from . import data as D
from . import distributed as DD
from .artifacts import RECORD
from .config import ConfigError, RunConfig, merge, read_yaml
from .fineweb import ChunkStream, StreamConfig, load_tokenizer
from .io import CheckpointError
from .rundir import drop_stale, result_fingerprint, run_directory
from .train import BatchSource, LoopSettings, fit

logger = logging.getLogger("loopscale.train")  # the trainers' messages, one logger


def cosine_lr(step: int, warmup: int, total: int, lr: float, min_lr: float) -> float:
    """The official schedule at (1-based) step `step`: lr·step/warmup during warm-up, then
    min_lr + (lr − min_lr)·(1 + cos(π·p))/2, p the fraction of the post-warm-up steps done."""
    if step < warmup:
        return lr * step / warmup
    p = (step - warmup) / max(1, total - warmup)
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * min(p, 1.0)))


def _recorded_fingerprint(out: Path) -> Optional[str]:
    """The result fingerprint of the streamed run recorded in out/loopscale.json (its config and
    stream settings), for a summary.json written before train-stream recorded one."""
    try:
        rec = json.loads((out / RECORD).read_text())
        return result_fingerprint(rec["config"], rec["stream"])
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def check_val_data(val_data: str | Path, tok, vocab_size: int, where: str) -> None:
    """--val-data must be tokenised with the stream's tokenizer (the hash prepared data records,
    `data.prepare_data`) and fit the model's vocabulary: one ConfigError line otherwise."""
    want = hashlib.sha256(tok.to_str(pretty=True).encode("utf-8")).hexdigest()
    why = D.tokenizer_mismatch(D.load_meta(val_data), want, vocab_size)
    if why:
        raise ConfigError(f"--val-data {val_data} does not fit stream.tokenizer {where!r}: it {why}; prepare it with "
                          f"`loopscale prepare-data --tokenizer` and the stream's tokenizer.json")


class Stream(BatchSource):
    """The batches of a streamed corpus (a `loopscale.train.BatchSource`): each rank reads its
    share of the chunks of stream `s`, resumed exactly; optional validation on prepared data."""

    def __init__(self, s: StreamConfig, cfg: RunConfig, val_data: Optional[str | Path] = None):
        tc, mc = cfg.train, cfg.model
        self.s, self.cfg, self.tok = s, cfg, load_tokenizer(s.tokenizer)
        if self.tok.get_vocab_size() > mc.vocab_size:
            raise ConfigError(f"tokenizer {s.tokenizer!r} has {self.tok.get_vocab_size()} tokens, more than "
                              f"model.vocab_size {mc.vocab_size}")
        self.validation = None
        if val_data:  # before anything trains: data of another tokenizer is refused, never evaluated after training
            check_val_data(val_data, self.tok, mc.vocab_size, s.tokenizer)
            D.check_windows(D.load_meta(val_data)["tokens"], mc.seq_len, f"--val-data {val_data}", ("validation",))
            self.validation = D.load_split(val_data, "validation")
        self.total_steps = tc.max_steps
        self.record = self.settings = {"stream": dataclasses.asdict(s)}
        self.tokenizer_json = self.tok.to_str(pretty=True).encode("utf-8")

    def start(self, dd, state: Optional[dict]) -> None:
        consumed = list(state.get("consumed") or []) if state is not None else [0] * dd.world
        if len(consumed) != dd.world:
            raise CheckpointError(f"state.pt was written by {len(consumed)} ranks, this job has {dd.world}: the "
                                  f"stream position cannot carry over; train with --no-resume to start over")
        tc = self.cfg.train
        self.dd, self.per_rank = dd, DD.micro_batch_size(tc.batch_size, dd.world, tc.grad_accum) * tc.grad_accum
        self.stream = ChunkStream(self.s, self.tok, self.cfg.model.seq_len, dd.rank, dd.world, consumed=consumed[dd.rank])
        if state is not None:
            logger.info("the stream resumes after %d chunks consumed per rank", consumed[dd.rank])

    def batches(self, step: int):  # the stream is where start() placed it
        while True:
            b = self.stream.batch(self.per_rank)
            yield b[:, :-1], b[:, 1:]

    def position(self) -> dict:
        return {"consumed": DD.gather(self.stream.consumed, self.dd)}

    def summary(self) -> dict:
        return {"chunks_consumed_per_rank": self.stream.consumed, "stream_passes": self.stream.passes}


def train_stream(cfg: RunConfig, s: StreamConfig, out_dir: str | Path, *, val_data: Optional[str | Path] = None,
                 resume: bool = True, drop_stale_state: bool = False, progress: bool = True) -> dict:
    """Train `cfg` on the stream `s` for train.max_steps optimiser steps into `out_dir`
    (`loopscale.train.fit`: metrics.jsonl, state.pt with the chunks every rank consumed,
    model.pt, the artifact files, summary.json); calling this again after a SIGTERM
    (`rundir.Preempted`) resumes exactly. The run directory is handled as `loopscale train`'s
    (`rundir.run_directory`); `drop_stale_state`: a state.pt of other settings is deleted
    instead of refused."""
    tc = cfg.train
    if not tc.max_steps:
        raise ConfigError("train.max_steps is required for a streamed run (a stream has no epochs)")
    if s.min_lr > tc.lr:  # the cosine would climb from lr to min_lr instead of decaying
        raise ConfigError(f"stream.min_lr ({s.min_lr:g}) must not exceed train.lr ({tc.lr:g})")
    out = Path(out_dir)
    fp = result_fingerprint(cfg, dataclasses.asdict(s))
    stream = {"stream": dataclasses.asdict(s)}
    with run_directory(out, "loopscale train-stream", fp, resume=resume,
                       legacy=lambda summary: _recorded_fingerprint(out) == fp,
                       drop_stale=(lambda o: drop_stale(o, cfg, stream)) if drop_stale_state else None) as done:
        if done is not None:
            return done
        # the official trainer's settings; under FSDP every rank validates (its forward needs them all)
        settings = LoopSettings(fused_adamw=False, dtype=torch.bfloat16 if s.pure_bf16 else None,
                                model_schedule=False, validate_every_rank=tc.fsdp)
        return fit(cfg, Stream(s, cfg, val_data), out, fp, resume=resume, progress=progress, settings=settings,
                   lr=lambda step: cosine_lr(step, s.warmup_steps, tc.max_steps, tc.lr, s.min_lr))


# ---------------------------------------------------------------------------
# settings (the command, `loopscale train-stream`, is loopscale.cli.run)
# ---------------------------------------------------------------------------
def stream_settings(path: Optional[str | Path] = None, overrides: Optional[dict] = None) -> StreamConfig:
    """The stream settings: the defaults <- a YAML file of them (the pipeline's RUN/stream.yaml:
    the mapping itself or the one under `stream:`) <- `overrides` (parsed `stream.*` settings)."""
    base = dataclasses.asdict(StreamConfig())
    if path:
        given = read_yaml(path)
        if not isinstance(given, dict):
            raise ConfigError(f"{path}: must hold a mapping of stream settings")
        base = merge(base, given.get("stream", given), "stream")
    return StreamConfig.from_dict(merge(base, overrides or {}, "stream"))
