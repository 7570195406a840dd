"""The one training loop, `fit`: AdamW over a batch source (`BatchSource`: `TokenFiles` or
`loopscale.train_stream.Stream`) and a learning-rate schedule, resumable, crash-safe, and
data-parallel under torchrun (rank 0 alone writes files). A resumed run sees exactly the
batches an uninterrupted one would. The files of a run directory: docs/architecture.md,
"Inside the core modules".
"""
from __future__ import annotations

import datetime
import hashlib
import json
import logging
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

import numpy as np
import torch
from tqdm.auto import tqdm

from . import data as D
from . import distributed as DD
from .artifacts import RECORD, write_run_files
from .config import ConfigError, RunConfig
from .evaluate import exit_losses
from .io import atomic_torch_save, atomic_write_json, run_environment, weights_sha256
from .model import LoopedLM, build_model
from .objective import LossOutput, compute_loss
from .rundir import (SigtermFlag, drop_stale, invalidate_outputs, keep_finished, load_state, metrics_upto,
                     result_fingerprint, run_directory)
from .runtime import autocast, enable_tf32, resolve_device

logger = logging.getLogger("loopscale.train")


def build(cfg: RunConfig, device: torch.device, *, compile: bool | None = None, checkpoint: bool | None = None,
          dd: DD.Dist = DD.Dist(), fused: bool = True,
          dtype: torch.dtype | None = None) -> tuple[LoopedLM, torch.optim.Optimizer, torch.nn.Module]:
    """The model (initialised from the current torch seed), its AdamW, and what the training
    step calls for the forward pass (the model, its DDP wrapper or, with train.fsdp, the
    model sharded in place under torchrun; torch.compile'd with train.compile).
    `compile`/`checkpoint` default to train.compile / train.activation_checkpointing; `fused`:
    AdamW's fused kernel on CUDA (never under FSDP); `dtype`: the weights' (default float32)."""
    tc = cfg.train
    model = build_model(cfg.model).to(device)
    if dtype is not None:
        model = model.to(dtype)
    model.checkpoint_blocks = tc.activation_checkpointing if checkpoint is None else checkpoint
    model.set_objective(cfg.objective)  # parameters only some objectives train (Ouro's exit gate)
    net = DD.wrap(model, dd, tc.fsdp)  # before the optimiser: FSDP replaces the parameters
    opt = torch.optim.AdamW(model.parameters(), lr=tc.lr, betas=tuple(tc.betas), weight_decay=tc.weight_decay,
                            fused=fused and device.type == "cuda" and not (dd.enabled and tc.fsdp))
    fwd = torch.compile(net) if (tc.compile if compile is None else compile) else net
    return model, opt, fwd


class LastFinite:
    """The weights before the latest optimiser step, so a step that leaves any weight non-finite
    (an overflowing update, a NaN clip threshold) can be undone and a diverged run keeps its
    last finite weights. Costs one copy of the parameters on their device."""

    def __init__(self, params):
        # this rank's shard of each parameter (FSDP's are DTensors; DDP's and plain ones are whole)
        self.params = [p.to_local() if hasattr(p, "to_local") else p for p in params]
        self.copy = [torch.empty_like(p) for p in self.params]

    @torch.no_grad()
    def save(self) -> None:
        torch._foreach_copy_(self.copy, self.params)

    @torch.no_grad()
    def finite(self) -> torch.Tensor:
        return torch.stack(torch._foreach_norm(self.params, math.inf)).isfinite().all()

    @torch.no_grad()
    def restore(self) -> None:
        torch._foreach_copy_(self.params, self.copy)


@dataclass
class StepOutput:
    loss: LossOutput
    grad_norm: torch.Tensor  # total gradient norm before clipping
    finite: bool  # loss, gradient norm, state norms (and with a guard the weights) finite; if not, no update landed


def train_step(model: LoopedLM, fwd, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
               cfg: RunConfig, device: torch.device, *, all_exits: bool = False,
               dd: DD.Dist = DD.Dist(), guard: LastFinite | None = None) -> StepOutput:
    """One optimiser step (docs/architecture.md, `train.py`): `fwd` runs the forward pass,
    `model` gives the readout and head; `all_exits` also measures the exits outside the loss;
    with a `guard` a step that left any weight non-finite is undone."""
    parts = cfg.train.grad_accum
    opt.zero_grad(set_to_none=True)
    res = None
    for j, (xm, ym) in enumerate(zip(x.chunk(parts), y.chunk(parts))):
        with DD.no_sync(fwd, sync=j == parts - 1):
            with autocast(device, cfg.train.precision):
                states = fwd(xm)
                r = compute_loss(model, states, ym, cfg.objective, all_exits=all_exits)
            (r.total / parts).backward()
        res = r if res is None else _add(res, r)
    if parts > 1:
        res = _scale(res, 1 / parts)
    gnorm = DD.full_tensor(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip))
    bad = ~(torch.isfinite(res.total) & torch.isfinite(gnorm) & torch.isfinite(res.norms).all())
    if guard is None:
        finite = not bool(DD.any_true(bad, dd))
        if finite:
            opt.step()
        return StepOutput(res, gnorm, finite)
    guard.save()
    opt.step()
    finite = not bool(DD.any_true(bad | ~guard.finite(), dd))  # still one synchronisation
    if not finite:
        guard.restore()
    return StepOutput(res, gnorm, finite)


def _add(a: LossOutput, b: LossOutput) -> LossOutput:
    return LossOutput(a.total.detach() + b.total.detach(), a.ce + b.ce, a.norms + b.norms, a.penalty + b.penalty)


def _scale(a: LossOutput, f: float) -> LossOutput:
    return LossOutput(a.total * f, a.ce * f, a.norms * f, a.penalty * f)


def global_mean(res: LossOutput, dd: DD.Dist) -> LossOutput:
    """The global batch's loss values: the mean of every rank's (one all-reduce)."""
    if not dd.enabled:
        return res
    K = res.ce.numel()
    flat = DD.mean(torch.cat([res.total.detach().float().view(1), res.penalty.float().view(1), res.ce, res.norms]), dd)
    return LossOutput(flat[0], flat[2:2 + K], flat[2 + K:], flat[1])


# ---------------------------------------------------------------------------
# batch sources and the loop's settings
# ---------------------------------------------------------------------------
class BatchSource:
    """What `fit` trains on: this rank's batches of every step, and what the run records of them.
    Two small subclasses: `TokenFiles` (below) and `loopscale.train_stream.Stream`.
      total_steps     optimiser steps of the run
      record          what the run record and every checkpoint say about the data ({"data": ...})
      settings        entries a state.pt must hold to be resumed (a stream's settings)
      validation      validation tokens, or None
      tokenizer_json  the tokenizer's bytes for the run's artifact, or None"""

    total_steps: int
    record: dict
    settings: dict = {}
    validation: Optional[np.ndarray] = None
    tokenizer_json: Optional[bytes] = None
    dd: DD.Dist = DD.Dist()

    def start(self, dd: DD.Dist, state: Optional[dict]) -> None:
        """Place the source for this rank; `state`: the record of the state.pt resumed, or None."""
        self.dd = dd

    def batches(self, step: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's (x, y) of every step from `step` on."""
        raise NotImplementedError

    def position(self) -> dict:
        """What a checkpoint records of the source's position (a collective: every rank calls it)."""
        return {}

    def summary(self) -> dict:
        """What summary.json reports of the source."""
        return {}


class TokenFiles(BatchSource):
    """The batches of a prepared data directory: windows of its train split, in an order that
    is a function of (seed, epoch) only (the position is the step itself)."""

    def __init__(self, data_dir: str | Path, cfg: RunConfig):
        tc, mc = cfg.train, cfg.model
        meta = D.load_meta(data_dir)
        if meta["vocab_size"] > mc.vocab_size:
            raise D.DataError(f"data vocabulary ({meta['vocab_size']}) exceeds model.vocab_size ({mc.vocab_size}); "
                              f"raise model.vocab_size or re-prepare the data")
        # a split shorter than one window would train on nothing or fail at the first validation,
        # after training: refused here, naming the split, before anything is built
        D.check_windows(meta["tokens"], mc.seq_len, f"data {data_dir}", ("train", "validation"))
        self.tokens = D.load_split(data_dir, "train")
        self.validation = D.load_split(data_dir, "validation")
        self.starts = D.train_window_starts(len(self.tokens), mc.seq_len, tc.stride)
        self.steps_per_epoch = len(self.starts) // tc.batch_size
        if self.steps_per_epoch == 0:
            raise D.DataError(f"training split has {len(self.starts)} windows, fewer than one batch of "
                              f"{tc.batch_size}; lower train.batch_size or use a larger corpus")
        self.total_steps = tc.max_steps or max(1, math.ceil(tc.epochs * self.steps_per_epoch))
        # the data's identity travels with every checkpoint, so a model file copied on its own is
        # still checked against the corpus and tokenizer it is evaluated on
        self.record = {"data": {k: meta.get(k) for k in ("vocab_size", "tokens", "source_sha256", "tokenizer_sha256")}}
        tok = Path(data_dir) / "tokenizer.json"
        self.tokenizer_json = tok.read_bytes() if tok.is_file() else None
        self.seed, self.batch_size, self.seq_len = tc.seed, tc.batch_size, mc.seq_len

    def batches(self, step: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        perm_epoch = -1
        while True:
            epoch, i = divmod(step, self.steps_per_epoch)
            if epoch != perm_epoch:  # data order: a function of (seed, epoch) only
                perm, perm_epoch = np.random.default_rng([self.seed, epoch]).permutation(len(self.starts)), epoch
            batch = perm[i * self.batch_size:(i + 1) * self.batch_size]  # the global batch
            yield D.get_batch(self.tokens, self.starts[DD.shard(batch, self.dd.rank, self.dd.world)], self.seq_len)
            step += 1


@dataclass(frozen=True)
class LoopSettings:
    """What the entry points run differently (the defaults are `loopscale train`'s)."""
    fused_adamw: bool = True  # AdamW's fused kernel on CUDA
    dtype: Optional[torch.dtype] = None  # the weights' dtype (stream.pure_bf16: bfloat16); None: float32
    model_schedule: bool = True  # model.schedule(step, total) before every step and validation (TaperNorm's gate)
    validate_every_rank: bool = True  # the periodic validation on every rank, else on rank 0 alone


# ---------------------------------------------------------------------------
# the loop
# ---------------------------------------------------------------------------
def train(cfg: RunConfig, data_dir: str | Path, out_dir: str | Path, *, resume: bool = True,
          progress: bool = True, drop_stale_state: bool = False) -> dict:
    """Train one run on a prepared data directory in the locked run directory `out_dir`
    (rundir.run_directory: a finished run of these settings is returned as it is); returns the
    summary (summary.json). `drop_stale_state`: a state.pt of other settings is deleted
    (training starts over) instead of refused."""
    fp = result_fingerprint(cfg)
    with run_directory(out_dir, "loopscale train", fp, resume=resume,
                       legacy=lambda summary: summary.get("config_fingerprint") == cfg.fingerprint(),
                       drop_stale=(lambda out: drop_stale(out, cfg)) if drop_stale_state else None) as done:
        if done is not None:
            return done
        return fit(cfg, TokenFiles(data_dir, cfg), Path(out_dir), fp, resume=resume, progress=progress)


def fit(cfg: RunConfig, source: BatchSource, out: Path, fingerprint: str, *, lr: Optional[Callable[[int], float]] = None,
        resume: bool = True, progress: bool = True, settings: LoopSettings = LoopSettings()) -> dict:
    """Train `cfg` on the batches of `source` into the run directory `out` (locked by the
    caller, rundir.run_directory) and return the summary (summary.json). `lr(step)`: the rate
    of the 1-based optimiser step (default: train.lr); `fingerprint`: rundir.result_fingerprint;
    `resume`: continue from a state.pt of the same settings; `progress`: a bar on a terminal."""
    t0, tc = time.time(), cfg.train
    if tc.threads > 0:
        torch.set_num_threads(tc.threads)
    dd = DD.setup(resolve_device(tc.device))  # a no-op Dist(world=1) outside torchrun
    device, main, total = dd.device, dd.is_main, source.total_steps
    enable_tf32(device)
    DD.micro_batch_size(tc.batch_size, dd.world, tc.grad_accum)  # checks the global batch divides
    torch.manual_seed(tc.seed)
    model, opt, fwd = build(cfg, device, dd=dd, fused=settings.fused_adamw, dtype=settings.dtype)
    if dd.rank > 0:  # own dropout masks per rank (rank 0 keeps the single-process stream)
        torch.manual_seed(DD.rank_seed(tc.seed, dd.rank))
    state_path, status = out / "state.pt", "completed"
    step, elapsed_before, record = _start(out, cfg, source, model, opt, dd, resume and state_path.exists(), total)

    def save(path: Path, resumable: bool) -> dict:  # every rank calls it (collectives: FSDP gathers the shards)
        rng = DD.gather(DD.rng_state(device), dd) if resumable else None
        weights = DD.model_state(model, dd, tc.fsdp)
        extra = {"status": status}
        if resumable:  # + optimiser, every rank's RNG, time so far
            extra = {"optimizer": DD.optimizer_state(model, opt, dd, tc.fsdp), "rng_cpu": rng[0]["cpu"],
                     "rng_cuda": rng[0]["cuda"], "rng_ranks": rng, "world_size": dd.world,
                     "elapsed": elapsed_before + time.time() - t0, "status": "running"}
        extra.update(source.position())
        if main:
            atomic_torch_save(path, {"model": weights, "weights_sha256": weights_sha256(weights), **source.record,
                                     "config": cfg.to_dict(), "step": step, **extra})
        return weights

    def save_state() -> None:
        save(state_path, resumable=True)

    def validate() -> Optional[dict]:
        if source.validation is None:
            return None
        if settings.model_schedule:
            model.schedule(step, total)  # TaperNorm's gate at this step, as the official trainer validates
        r = exit_losses(model, source.validation, tc.eval_batch_size, tc.eval_tokens, device=device)
        return {"step": step, "split": "validation", "tokens": r["tokens"], "val_ce": r["ce"], "val_norm": r["norm"]}

    log = _Log(out, cfg, total, step, main, progress, t0 - elapsed_before)
    guard, last_good, diverged_at = LastFinite(model.parameters()), None, None
    try:
        with SigtermFlag() as sigterm:
            model.train()
            batches = source.batches(step)
            while step < total:
                x, y = (t.to(device, non_blocking=True) for t in next(batches))
                rate = lr(step + 1) if lr is not None else tc.lr
                for g in opt.param_groups:
                    g["lr"] = rate
                is_log = (step + 1) % tc.log_every == 0 or step + 1 == total
                if settings.model_schedule:
                    model.schedule(step, total)  # settings that follow the step (TaperNorm's gate)
                done = train_step(model, fwd, opt, x, y, cfg, device, all_exits=is_log, dd=dd, guard=guard)
                if not done.finite:  # the update was not applied (on any rank)
                    status, diverged_at = "diverged", step + 1
                    break
                step += 1
                log.step()
                if is_log:  # global_mean is a collective: every rank
                    last_good = log.train(step, global_mean(done.loss, dd), done.grad_norm, rate, device)
                if tc.eval_every and step % tc.eval_every == 0 and step < total and (settings.validate_every_rank or main):
                    log.write(validate())
                if step % tc.ckpt_every == 0 and step < total:
                    save_state()
                sigterm.stop_if_raised(dd, step, total, state_path, save_state)  # on any rank: all stop
    finally:
        log.close(status)

    summary = {"status": status, "steps": step, "total_steps": total, "config_fingerprint": cfg.fingerprint(),
               "result_fingerprint": fingerprint, "tokens": step * tc.batch_size * cfg.model.seq_len,
               "params": model.num_params(), "wall_time_s": elapsed_before + time.time() - t0, "device": str(device),
               "world_size": dd.world, **source.summary()}
    val = None
    if status == "diverged":
        summary.update(diverged_at_step=diverged_at, last_finite=last_good)
    else:
        val = validate()
        summary.update(final_train=last_good, validation=val)
        if main and val is not None:
            with open(out / "metrics.jsonl", "a") as f:
                f.write(json.dumps(val) + "\n")
            logger.info("done: %d steps, validation CE %s", step, " ".join(f"{c:.4f}" for c in val["val_ce"]))
    weights = save(out / "model.pt", resumable=False)  # the last finite weights (a diverged update never lands)
    if main:  # the artifact files in float32 (model.safetensors, the tokenizer; config.json last)
        write_run_files(out, DD.plain_model(model, weights, dd, tc.fsdp).float(), record, source.tokenizer_json)
        atomic_write_json(out / "summary.json", summary)  # last: the run is finished
        keep_finished(out)
        state_path.unlink(missing_ok=True)
    DD.barrier(dd)  # no rank reports the run finished before its files exist
    return summary


def _start(out: Path, cfg: RunConfig, source: BatchSource, model: LoopedLM, opt, dd: DD.Dist, resume: bool,
           total: int) -> tuple[int, float, Optional[dict]]:
    """Resume from state.pt (`resume`) or start over; either way what an earlier run of the
    directory left is removed first (rundir.invalidate_outputs). Then rank 0 writes the run
    record. Returns (step, elapsed seconds, the run record; None on the other ranks)."""
    state_path, metrics_path = out / "state.pt", out / "metrics.jsonl"
    state = load_state(state_path, cfg, model, opt, dd.device, total, dd, source.settings) if resume else None
    source.start(dd, state)
    if dd.is_main and state is not None:
        invalidate_outputs(out, fresh=False)
        metrics_upto(metrics_path, state["step"])  # records written after that state (a crash) are redone
        logger.info("resuming from %s at step %d/%d", state_path, state["step"], total)
    elif dd.is_main:
        invalidate_outputs(out, fresh=True)  # a run that starts over: nothing of the old one stays
        state_path.unlink(missing_ok=True)
        metrics_path.unlink(missing_ok=True)
    DD.barrier(dd)  # rank 0 has read or dropped the old files before it writes new ones
    record = None
    if dd.is_main:
        env = run_environment(str(dd.device))
        if dd.enabled:
            env["distributed"] = {"world_size": dd.world, "fsdp": cfg.train.fsdp,
                                  "backend": torch.distributed.get_backend()}
        record = {"config": cfg.to_dict(), "env": env, **source.record}
        atomic_write_json(out / RECORD, record)
    return (state["step"], state["elapsed"], record) if state is not None else (0, 0.0, record)


class _Log:
    """Where training reports: metrics.jsonl (rank 0), a progress bar on a terminal or else a
    progress line every log_every steps (pipeline logs, SLURM), TensorBoard and W&B
    (train.tensorboard / train.wandb; the same curves)."""

    def __init__(self, out: Path, cfg: RunConfig, total: int, step: int, main: bool, progress: bool, t0: float):
        tc = cfg.train
        self.main, self.total, self.t0 = main, total, t0  # t0: when the run started, resumed time included
        self.tokens_per_step, self.tokens, self.t = tc.batch_size * cfg.model.seq_len, 0, time.time()
        self.tb = _tensorboard(out / "tensorboard") if tc.tensorboard and main else None
        self.wb = _wandb(out, cfg) if tc.wandb and main else None
        self.show_bar = progress and main and sys.stderr.isatty()
        self.bar = tqdm(total=total, initial=step, disable=not self.show_bar, desc=out.name, mininterval=1.0,
                        dynamic_ncols=True)
        self.file = open(out / "metrics.jsonl", "a") if main else open(os.devnull, "w")

    def write(self, rec: Optional[dict]) -> None:
        if rec is not None:
            self.file.write(json.dumps(rec) + "\n")
            self.file.flush()

    def step(self) -> None:
        self.tokens += self.tokens_per_step
        self.bar.update(1)

    def train(self, step: int, res: LossOutput, grad_norm: torch.Tensor, lr: float, device: torch.device) -> dict:
        """The record of a logged step (every rank computes it; rank 0 writes it)."""
        now = time.time()
        rec = {"step": step, "tokens": step * self.tokens_per_step, "loss": res.total.item(),
               "ce": res.ce.tolist(), "norm": res.norms.tolist(), "penalty": res.penalty.item(),
               "grad_norm": grad_norm.item(), "lr": lr, "tok_per_s": self.tokens / max(now - self.t, 1e-9),
               "elapsed": now - self.t0}
        if device.type == "cuda":  # this rank's peak (the ranks' shapes are equal)
            rec["max_memory_bytes"] = torch.cuda.max_memory_allocated(device)
        self.t, self.tokens = now, 0
        self.write(rec)
        self.bar.set_postfix(loss=f"{rec['loss']:.3f}", normK=f"{rec['norm'][-1]:.3g}")
        if not self.show_bar and self.main:
            logger.info(_progress_line(rec, self.total, self.tokens_per_step))
        curves = {"train/loss": rec["loss"], "train/norm_K": rec["norm"][-1], "train/grad_norm": rec["grad_norm"],
                  "train/tok_per_s": rec["tok_per_s"], **{f"ce/loop{k}": c for k, c in enumerate(rec["ce"], 1)},
                  **{f"norm/loop{k}": n for k, n in enumerate(rec["norm"], 1)}}
        if self.tb is not None:
            for name, value in curves.items():
                self.tb.add_scalar(name, value, step)
        if self.wb is not None:
            self.wb.log(curves, step=step)
        return rec

    def close(self, status: str) -> None:
        self.bar.close()
        self.file.close()
        if self.tb is not None:
            self.tb.close()
        if self.wb is not None:
            self.wb.finish(exit_code=0 if status == "completed" else 1)


def _progress_line(rec: dict, total_steps: int, tokens_per_step: int) -> str:
    """One progress line: step, loss, ||H_K||, tok/s and the time left at this speed."""
    eta = (total_steps - rec["step"]) * tokens_per_step / max(rec["tok_per_s"], 1e-9)
    return (f"step {rec['step']}/{total_steps}  loss {rec['loss']:.4f}  |H_K| {rec['norm'][-1]:.4g}  "
            f"tok/s {rec['tok_per_s']:,.0f}  ETA {datetime.timedelta(seconds=round(eta))}")


def _tensorboard(log_dir: Path):
    """A TensorBoard SummaryWriter (train.tensorboard: true; needs the `tensorboard` extra)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ConfigError("train.tensorboard needs the tensorboard package: "
                          "pip install 'loopscale[tensorboard]'") from None
    return SummaryWriter(log_dir=str(log_dir))


def _wandb(out: Path, cfg: RunConfig):
    """A Weights & Biases run (train.wandb: true; needs the `wandb` extra). Project from
    $WANDB_PROJECT (default loopscale), files under RUN/wandb/; WANDB_MODE=offline logs locally
    (`wandb sync RUN/wandb/offline-run-*` uploads later). A resumed run continues the same W&B run
    (its id is derived from the run directory)."""
    try:
        import wandb
    except ImportError:
        raise ConfigError("train.wandb needs the wandb package: pip install 'loopscale[wandb]'") from None
    run_id = hashlib.sha1(str(out.resolve()).encode()).hexdigest()[:16]
    try:
        return wandb.init(project=os.environ.get("WANDB_PROJECT", "loopscale"), name=f"{out.parent.name}/{out.name}",
                          id=run_id, resume="allow", dir=str(out), config=cfg.to_dict())
    except Exception as e:  # no login, no network: one line, before any step is trained
        msg = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise ConfigError(f"train.wandb: W&B could not start ({msg}); run `wandb login` or set "
                          f"WANDB_MODE=offline") from None


