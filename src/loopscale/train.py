"""Training one run: AdamW at a constant learning rate, resumable, crash-safe.

Files written into the run directory:
  loopscale.json  fully resolved config + provenance (package, git commit, torch, device)
  metrics.jsonl   one JSON record every `log_every` steps (+ validation records)
  state.pt        resumable state every `ckpt_every` steps and on SIGTERM
                  (model, optimiser, RNG, step); removed once the run is finished
  model.pt        final weights + config (+ status), what the evaluations read; like state.pt
                  it records its weights' content hash (verified on load) and the data's identity
  model.safetensors, config.json (Hugging Face), modeling_loopscale.py, tokenizer.json,
  tokenizer_config.json, special_tokens_map.json
                  the run as a self-contained artifact (artifacts.py, `loopscale.load`, loopscale.hf)
  summary.json    status (completed | diverged), steps, tokens, final validation, wall time

The data order is a pure function of (seed, epoch), so a resumed run sees exactly the
batches an uninterrupted one would, and with the RNG state restored it computes the same
losses bit for bit on CPU.

Launched by torchrun, the same function trains data-parallel (loopscale.distributed): each
rank computes on its share of the same global batch, rank 0 alone writes the files above
(state.pt holds every rank's RNG state), and SIGTERM or a non-finite value on any rank
stops every rank at the same step.
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

import numpy as np
import torch
from tqdm.auto import tqdm

from . import data as D
from . import distributed as DD
from .config import ConfigError, RunConfig
from .evaluate import exit_losses
from .io import atomic_torch_save, atomic_write_json, run_environment, weights_sha256
from .model import LoopedLM, build_model
from .objective import LossOutput, compute_loss
from .rundir import (SigtermFlag, drop_stale, invalidate_outputs, keep_finished, load_state, metrics_upto,
                     result_fingerprint, run_directory)
from .runtime import autocast, enable_tf32, resolve_device

logger = logging.getLogger("loopscale.train")


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
        from .config import ConfigError
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
        from .config import ConfigError
        raise ConfigError("train.wandb needs the wandb package: pip install 'loopscale[wandb]'") from None
    import hashlib
    import os
    run_id = hashlib.sha1(str(out.resolve()).encode()).hexdigest()[:16]
    try:
        return wandb.init(project=os.environ.get("WANDB_PROJECT", "loopscale"), name=f"{out.parent.name}/{out.name}",
                          id=run_id, resume="allow", dir=str(out), config=cfg.to_dict())
    except Exception as e:  # no login, no network: one line, before any step is trained
        from .config import ConfigError
        msg = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise ConfigError(f"train.wandb: W&B could not start ({msg}); run `wandb login` or set "
                          f"WANDB_MODE=offline") from None


def build(cfg: RunConfig, device: torch.device, *, compile: bool | None = None,
          checkpoint: bool | None = None, dd: DD.Dist = DD.Dist()) -> tuple[LoopedLM, torch.optim.Optimizer, torch.nn.Module]:
    """The model (initialised from the current torch seed), its AdamW, and what the training
    step calls for the forward pass (the model, its DDP wrapper or, with train.fsdp, the
    model sharded in place under torchrun; torch.compile'd with train.compile).
    `compile`/`checkpoint` default to train.compile / train.activation_checkpointing."""
    tc = cfg.train
    model = build_model(cfg.model).to(device)
    model.checkpoint_blocks = tc.activation_checkpointing if checkpoint is None else checkpoint
    if hasattr(model, "set_objective"):  # parameters only some objectives train (Ouro's exit gate)
        model.set_objective(cfg.objective)
    net = DD.wrap(model, dd, tc.fsdp)  # before the optimiser: FSDP replaces the parameters
    opt = torch.optim.AdamW(model.parameters(), lr=tc.lr, betas=tuple(tc.betas), weight_decay=tc.weight_decay,
                            fused=device.type == "cuda" and not (dd.enabled and tc.fsdp))
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
    """One optimiser step: forward under autocast, the objective, backward, gradient clipping,
    the divergence check, AdamW. A non-finite loss, gradient or norm is caught before the
    update, so a diverged update never lands (one host synchronisation per step). With a
    `guard` (training passes one) the weights after the update are checked too, and a step
    that made any of them non-finite is undone.

    `fwd` runs the forward pass (the model, its compiled or a data-parallel wrapper); `model`
    gives the readout and head the objective reads. `all_exits` also measures the exits that
    are not in the loss (for logging).

    Data-parallel (`dd` of a torchrun job): x, y are this rank's share of the global batch;
    the gradients are averaged over the ranks, and the divergence check is agreed by all of
    them (one all-reduce), so every rank updates or stops at the same step. The returned
    loss values are this rank's (`global_mean` gives the global batch's). With
    train.grad_accum > 1, x, y are split into that many micro-batches, their gradients
    summed before one update (reduced across ranks once, after the last)."""
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


def train(cfg: RunConfig, data_dir: str | Path, out_dir: str | Path, *, resume: bool = True,
          progress: bool = True, drop_stale_state: bool = False) -> dict:
    """Train one run; returns the summary dict (also written to summary.json).

    The run directory is locked for the duration (a second trainer on it is refused);
    leftovers of a killed run are removed first; a finished run of these settings is
    returned as it is (run_directory). `drop_stale_state`: a state.pt of other settings is
    deleted (training starts over) instead of refused."""
    with run_directory(out_dir, "loopscale train", result_fingerprint(cfg), resume=resume,
                       legacy=lambda summary: summary.get("config_fingerprint") == cfg.fingerprint(),
                       drop_stale=(lambda out: drop_stale(out, cfg)) if drop_stale_state else None) as done:
        if done is not None:
            return done
        return _train(cfg, data_dir, Path(out_dir), resume=resume, progress=progress)


def _train(cfg: RunConfig, data_dir: str | Path, out: Path, *, resume: bool, progress: bool) -> dict:
    t0 = time.time()
    tc, mc = cfg.train, cfg.model
    if tc.threads > 0:
        torch.set_num_threads(tc.threads)
    dd = DD.setup(resolve_device(tc.device))  # a no-op Dist(world=1) outside torchrun
    device, main = dd.device, dd.is_main
    enable_tf32(device)

    meta = D.load_meta(data_dir)
    if meta["vocab_size"] > mc.vocab_size:
        raise D.DataError(f"data vocabulary ({meta['vocab_size']}) exceeds model.vocab_size ({mc.vocab_size}); "
                          f"raise model.vocab_size or re-prepare the data")
    # a split shorter than one window would train on nothing or fail at the first validation,
    # after training: refused here, naming the split, before anything is built
    D.check_windows(meta["tokens"], mc.seq_len, f"data {data_dir}", ("train", "validation"))
    train_tokens = D.load_split(data_dir, "train")
    val_tokens = D.load_split(data_dir, "validation")
    starts = D.train_window_starts(len(train_tokens), mc.seq_len, tc.stride)
    steps_per_epoch = len(starts) // tc.batch_size
    if steps_per_epoch == 0:
        raise D.DataError(f"training split has {len(starts)} windows, fewer than one batch of "
                          f"{tc.batch_size}; lower train.batch_size or use a larger corpus")
    total_steps = tc.max_steps or max(1, math.ceil(tc.epochs * steps_per_epoch))
    DD.micro_batch_size(tc.batch_size, dd.world, tc.grad_accum)  # checks the global batch divides

    torch.manual_seed(tc.seed)
    model, opt, fwd = build(cfg, device, dd=dd)
    if dd.rank > 0:  # own dropout masks per rank (rank 0 keeps the single-process stream)
        torch.manual_seed(DD.rank_seed(tc.seed, dd.rank))

    state_path, metrics_path = out / "state.pt", out / "metrics.jsonl"
    step, elapsed_before = 0, 0.0
    if resume and state_path.exists():
        step, elapsed_before = load_state(state_path, cfg, model, opt, device, total_steps, dd)
        if main:
            invalidate_outputs(out, fresh=False)
            metrics_upto(metrics_path, step)
            logger.info("resuming from %s at step %d/%d", state_path, step, total_steps)
    elif main:
        invalidate_outputs(out, fresh=True)  # a run that starts over: nothing of the old one stays
        state_path.unlink(missing_ok=True)
        metrics_path.unlink(missing_ok=True)
    DD.barrier(dd)  # rank 0 has read or dropped the old files before it writes new ones

    # the data's identity travels with every checkpoint, so a model file copied on its own is
    # still checked against the corpus and tokenizer it is evaluated on
    data_record = {k: meta.get(k) for k in ("vocab_size", "tokens", "source_sha256", "tokenizer_sha256")}
    if main:
        env = run_environment(str(device))
        if dd.enabled:
            env["distributed"] = {"world_size": dd.world, "fsdp": tc.fsdp, "backend": torch.distributed.get_backend()}
        atomic_write_json(out / "loopscale.json", {"config": cfg.to_dict(), "env": env, "data": data_record})

    def model_record(weights: dict) -> dict:
        return {"model": weights, "weights_sha256": weights_sha256(weights), "data": data_record}

    def save_state():  # every rank calls it (FSDP gathers the shards); rank 0 writes
        rng = DD.gather(DD.rng_state(device), dd)
        weights, optim = DD.model_state(model, dd, tc.fsdp), DD.optimizer_state(model, opt, dd, tc.fsdp)
        if main:
            atomic_torch_save(state_path, {**model_record(weights), "optimizer": optim, "config": cfg.to_dict(),
                                           "step": step, "rng_cpu": rng[0]["cpu"], "rng_cuda": rng[0]["cuda"],
                                           "rng_ranks": rng, "world_size": dd.world,
                                           "elapsed": elapsed_before + time.time() - t0, "status": "running"})

    def validate() -> dict:
        model.schedule(step, total_steps)  # TaperNorm's gate at this step, as the official trainer validates
        r = exit_losses(model, val_tokens, tc.eval_batch_size, tc.eval_tokens, device=device)
        return {"step": step, "split": "validation", "tokens": r["tokens"], "val_ce": r["ce"],
                "val_norm": r["norm"]}

    log = open(metrics_path, "a") if main else open(os.devnull, "w")
    perm_epoch, perm = -1, None
    guard = LastFinite(model.parameters())
    last_good: dict | None = None
    status, diverged_at = "completed", None
    # a progress bar on a terminal; otherwise (pipeline logs, SLURM) a log line every log_every steps
    show_bar = progress and main and sys.stderr.isatty()
    bar = tqdm(total=total_steps, initial=step, disable=not show_bar, desc=out.name, mininterval=1.0,
               dynamic_ncols=True)
    tb = _tensorboard(out / "tensorboard") if tc.tensorboard and main else None
    wb = _wandb(out, cfg) if tc.wandb and main else None
    t_log, tok_log = time.time(), 0
    try:
        with SigtermFlag() as sigterm:
            model.train()
            while step < total_steps:
                epoch, i = divmod(step, steps_per_epoch)
                if epoch != perm_epoch:  # data order: a function of (seed, epoch) only
                    perm = np.random.default_rng([tc.seed, epoch]).permutation(len(starts))
                    perm_epoch = epoch
                batch = perm[i * tc.batch_size:(i + 1) * tc.batch_size]  # the global batch
                x, y = D.get_batch(train_tokens, starts[DD.shard(batch, dd.rank, dd.world)], mc.seq_len)
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                is_log = (step + 1) % tc.log_every == 0 or step + 1 == total_steps
                model.schedule(step, total_steps)  # settings that follow the step (TaperNorm's gate)
                done_step = train_step(model, fwd, opt, x, y, cfg, device, all_exits=is_log, dd=dd, guard=guard)
                if not done_step.finite:  # the update was not applied (on any rank)
                    status, diverged_at = "diverged", step + 1
                    break
                res, gnorm = done_step.loss, done_step.grad_norm
                step += 1
                tokens_per_step = tc.batch_size * mc.seq_len
                tok_log += tokens_per_step
                bar.update(1)
                if is_log:
                    now = time.time()
                    res = global_mean(res, dd)
                    rec = {"step": step, "tokens": step * tokens_per_step, "loss": res.total.item(),
                           "ce": res.ce.tolist(), "norm": res.norms.tolist(), "penalty": res.penalty.item(),
                           "grad_norm": gnorm.item(), "lr": tc.lr,
                           "tok_per_s": tok_log / max(now - t_log, 1e-9),
                           "elapsed": elapsed_before + now - t0}
                    if device.type == "cuda":  # this rank's peak (the ranks' shapes are equal)
                        rec["max_memory_bytes"] = torch.cuda.max_memory_allocated(device)
                    t_log, tok_log = now, 0
                    last_good = rec
                    log.write(json.dumps(rec) + "\n")
                    log.flush()
                    bar.set_postfix(loss=f"{rec['loss']:.3f}", normK=f"{rec['norm'][-1]:.3g}")
                    if not show_bar and main:
                        logger.info(_progress_line(rec, total_steps, tokens_per_step))
                    if tb is not None:
                        tb.add_scalar("train/loss", rec["loss"], step)
                        tb.add_scalar("train/norm_K", rec["norm"][-1], step)
                        tb.add_scalar("train/grad_norm", rec["grad_norm"], step)
                        tb.add_scalar("train/tok_per_s", rec["tok_per_s"], step)
                        for k, (ce, norm) in enumerate(zip(rec["ce"], rec["norm"]), 1):
                            tb.add_scalar(f"ce/loop{k}", ce, step)
                            tb.add_scalar(f"norm/loop{k}", norm, step)
                    if wb is not None:  # the same curves as TensorBoard's
                        wb.log({"train/loss": rec["loss"], "train/norm_K": rec["norm"][-1],
                                "train/grad_norm": rec["grad_norm"], "train/tok_per_s": rec["tok_per_s"],
                                **{f"ce/loop{k}": c for k, c in enumerate(rec["ce"], 1)},
                                **{f"norm/loop{k}": n for k, n in enumerate(rec["norm"], 1)}}, step=step)
                if tc.eval_every and step % tc.eval_every == 0 and step < total_steps:
                    log.write(json.dumps(validate()) + "\n")
                    log.flush()
                if step % tc.ckpt_every == 0 and step < total_steps:
                    save_state()
                sigterm.stop_if_raised(dd, step, total_steps, state_path, save_state)  # on any rank: all stop
    finally:
        bar.close()
        log.close()
        if tb is not None:
            tb.close()
        if wb is not None:
            wb.finish(exit_code=0 if status == "completed" else 1)

    summary = {"status": status, "steps": step, "total_steps": total_steps,
               "config_fingerprint": cfg.fingerprint(), "result_fingerprint": result_fingerprint(cfg),
               "tokens": step * tc.batch_size * mc.seq_len, "params": model.num_params(),
               "wall_time_s": elapsed_before + time.time() - t0, "device": str(device), "world_size": dd.world}
    if status == "diverged":
        summary.update(diverged_at_step=diverged_at, last_finite=last_good)
        val = None
    else:
        val = validate()
        if main:
            with open(metrics_path, "a") as f:
                f.write(json.dumps(val) + "\n")
        summary.update(final_train=last_good, validation=val)
        if main:
            logger.info("done: %d steps, validation CE %s", step, " ".join(f"{c:.4f}" for c in val["val_ce"]))
    # the final model: last finite weights (a diverged update is never applied)
    weights = DD.model_state(model, dd, tc.fsdp)  # every rank (FSDP gathers the shards)
    if main:
        atomic_torch_save(out / "model.pt", {**model_record(weights), "config": cfg.to_dict(),
                                             "step": step, "status": status})
        from .artifacts import write_artifacts  # model.safetensors + tokenizer files (artifacts.py)
        write_artifacts(out, DD.plain_model(model, weights, dd, tc.fsdp), cfg, data_dir)  # config.json last
        atomic_write_json(out / "summary.json", summary)  # last: the run is finished
        keep_finished(out)
        state_path.unlink(missing_ok=True)
    DD.barrier(dd)  # no rank reports the run finished before its files exist
    return summary
