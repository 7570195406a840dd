"""Appendix B's training recipe: `loopscale train-stream`, a run trained on a streamed corpus
(FineWeb, `loopscale.fineweb`) with a cosine schedule.

The learning rate warms up linearly from 0 and decays by a cosine to `min_lr`; AdamW β =
(0.9, 0.95), as the official Ouro-track trainer. The stream feeds loopscale's training step
(`loopscale.train.train_step`: grad accumulation, autocast, DDP under torchrun, the divergence
guard), its run-directory handling (`loopscale.train.run_directory`: the run lock, a finished
run kept) and its preemption handling (`loopscale.train.SigtermFlag`: SIGTERM on any rank, as
SLURM sends before a time limit, stops every rank after the current step with a last state.pt
and exit status 143), with two differences that are deliberate: resuming is exact (a state.pt
records how many chunks each rank consumed, and the reopened stream skips exactly those; the
official trainer skips an approximate token count, and by default none), and the schedule
counts optimiser steps (the official counts micro-steps: its 1,000 warm-up micro-steps at
grad-accum 3 are 333 steps).

  loopscale train-stream --preset ouro-1.4b --out RUN [--set stream.KEY=VALUE ...]
                         [--val-data DATA]        a prepared data dir for validation
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from pathlib import Path
from typing import Optional

from .config import ConfigError, RunConfig, merge, parse_overrides, resolve
from .fineweb import ChunkStream, StreamConfig, load_tokenizer

logger = logging.getLogger("loopscale.train_stream")


def cosine_lr(step: int, warmup: int, total: int, lr: float, min_lr: float) -> float:
    """The official schedule at (1-based) step `step`: lr·step/warmup during warm-up, then
    min_lr + (lr − min_lr)·(1 + cos(π·p))/2, p the fraction of the post-warm-up steps done."""
    if step < warmup:
        return lr * step / warmup
    p = (step - warmup) / max(1, total - warmup)
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * min(p, 1.0)))


# ---------------------------------------------------------------------------
# training on the stream
# ---------------------------------------------------------------------------
def _recorded_fingerprint(out: Path) -> Optional[str]:
    """The result fingerprint of the streamed run recorded in out/loopscale.json (its config and
    stream settings), for a summary.json written before train-stream recorded one."""
    from .artifacts import RECORD
    from .rundir import result_fingerprint
    try:
        rec = json.loads((out / RECORD).read_text())
        return result_fingerprint(rec["config"], rec["stream"])
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def check_val_data(val_data: str | Path, tok, vocab_size: int, where: str) -> None:
    """--val-data must be tokenised with the stream's tokenizer (the hash prepared data records,
    `data.prepare_data`) and fit the model's vocabulary: one ConfigError line otherwise."""
    import hashlib

    from . import data as D
    want = hashlib.sha256(tok.to_str(pretty=True).encode("utf-8")).hexdigest()
    why = D.tokenizer_mismatch(D.load_meta(val_data), want, vocab_size)
    if why:
        raise ConfigError(f"--val-data {val_data} does not fit stream.tokenizer {where!r}: it {why}; prepare it with "
                          f"`loopscale prepare-data --tokenizer` and the stream's tokenizer.json")


def train_stream(cfg: RunConfig, s: StreamConfig, out_dir: str | Path, *, val_data: Optional[str | Path] = None,
                 resume: bool = True, drop_stale_state: bool = False) -> dict:
    """Train `cfg` on the stream `s` for train.max_steps optimiser steps into `out_dir`:
    metrics.jsonl, state.pt (every train.ckpt_every steps and on SIGTERM: weights, optimiser,
    every rank's RNG, step, chunks consumed), model.pt (what `loopscale eval` reads) and
    summary.json. SIGTERM raises `train.Preempted` once the state is saved; calling this again
    resumes from it exactly (the same batches, dropout masks and learning rates).

    The run directory is handled as `loopscale train` handles its own (`train.run_directory`):
    locked for the duration, and a finished run of these settings (config and stream) is
    returned as it is, one of other settings refused, unless `resume` is False.
    `drop_stale_state`: a state.pt of other settings (config or stream) is deleted, once the
    directory is locked, instead of refused."""
    from .rundir import drop_stale, result_fingerprint, run_directory

    if not cfg.train.max_steps:
        raise ConfigError("train.max_steps is required for a streamed run (a stream has no epochs)")
    if s.min_lr > cfg.train.lr:  # the cosine would climb from lr to min_lr instead of decaying
        raise ConfigError(f"stream.min_lr ({s.min_lr:g}) must not exceed train.lr ({cfg.train.lr:g})")
    out = Path(out_dir)
    fp = result_fingerprint(cfg, dataclasses.asdict(s))
    stream = {"stream": dataclasses.asdict(s)}
    with run_directory(out, "loopscale train-stream", fp, resume=resume,
                       legacy=lambda summary: _recorded_fingerprint(out) == fp,
                       drop_stale=(lambda o: drop_stale(o, cfg, stream)) if drop_stale_state else None) as done:
        if done is not None:
            return done
        return _train_stream(cfg, s, out, fp, val_data=val_data, resume=resume)


def _train_stream(cfg: RunConfig, s: StreamConfig, out: Path, fingerprint: str, *,
                  val_data: Optional[str | Path], resume: bool) -> dict:
    import torch

    from . import data as D
    from . import distributed as DD
    from .evaluate import exit_losses
    from .io import atomic_torch_save, atomic_write_json, load_checkpoint, weights_sha256
    from .model import build_model
    from .runtime import enable_tf32, resolve_device
    from .rundir import SigtermFlag, invalidate_outputs, keep_finished, metrics_upto, same_settings
    from .train import LastFinite, global_mean, train_step

    tc, mc = cfg.train, cfg.model
    dd = DD.setup(resolve_device(tc.device))
    device, main = dd.device, dd.is_main
    enable_tf32(device)
    if tc.threads > 0:
        torch.set_num_threads(tc.threads)
    per_rank = DD.micro_batch_size(tc.batch_size, dd.world, tc.grad_accum) * tc.grad_accum
    tok = load_tokenizer(s.tokenizer)
    if tok.get_vocab_size() > mc.vocab_size:
        raise ConfigError(f"tokenizer {s.tokenizer!r} has {tok.get_vocab_size()} tokens, more than "
                          f"model.vocab_size {mc.vocab_size}")
    val_tokens = None
    if val_data:  # before anything trains: data of another tokenizer is refused, never evaluated after training
        check_val_data(val_data, tok, mc.vocab_size, s.tokenizer)
        D.check_windows(D.load_meta(val_data)["tokens"], mc.seq_len, f"--val-data {val_data}", ("validation",))
        val_tokens = D.load_split(val_data, "validation")

    torch.manual_seed(tc.seed)
    model = build_model(mc).to(device)
    if dd.rank > 0:  # own dropout masks per rank, as `loopscale train` seeds them
        torch.manual_seed(DD.rank_seed(tc.seed, dd.rank))
    if s.pure_bf16:
        model = model.to(torch.bfloat16)
    model.checkpoint_blocks = tc.activation_checkpointing
    if hasattr(model, "set_objective"):
        model.set_objective(cfg.objective)
    fwd = DD.wrap(model, dd, tc.fsdp)
    opt = torch.optim.AdamW(model.parameters(), lr=tc.lr, betas=tuple(tc.betas), weight_decay=tc.weight_decay)

    state_path, metrics_path = out / "state.pt", out / "metrics.jsonl"
    record = {"config": cfg.to_dict(), "stream": dataclasses.asdict(s)}
    step, consumed = 0, [0] * dd.world
    resumed = resume and state_path.exists()
    if resumed:
        ck = load_checkpoint(state_path, map_location=device)
        if not same_settings(ck, cfg, {"stream": record["stream"]}):
            raise ConfigError(f"{state_path} was written with other settings; train with --no-resume to start over")
        if len(ck.get("consumed", [])) != dd.world:
            raise ConfigError(f"{state_path} was written by {len(ck.get('consumed', []))} ranks, this job has "
                              f"{dd.world}: the stream position cannot carry over")
        DD.load_states(model, opt, ck["model"], ck["optimizer"], dd, tc.fsdp)
        if ck.get("rng_ranks"):  # dropout continues as in an uninterrupted run
            DD.set_rng_state(ck["rng_ranks"][dd.rank], device)
        step, consumed = int(ck["step"]), list(ck["consumed"])
        if step > tc.max_steps:
            raise ConfigError(f"{state_path} is at step {step}, past train.max_steps {tc.max_steps}")
    stream = ChunkStream(s, tok, mc.seq_len, dd.rank, dd.world, consumed=consumed[dd.rank])
    if main:  # what an earlier run of this directory left is not this run's (train.invalidate_outputs)
        invalidate_outputs(out, fresh=not resumed)
        if resumed:  # records written after that state (a crash between checkpoints) are redone
            metrics_upto(metrics_path, step)
        else:
            state_path.unlink(missing_ok=True)
            metrics_path.unlink(missing_ok=True)
    if resumed:
        logger.info("resuming at step %d (%d chunks consumed per rank)", step, consumed[dd.rank])
    DD.barrier(dd)  # rank 0 has dropped the old files before it writes new ones

    def validate() -> Optional[dict]:
        if val_tokens is None:
            return None
        r = exit_losses(model, val_tokens, tc.eval_batch_size, tc.eval_tokens, device=device)
        return {"step": step, "split": "validation", "tokens": r["tokens"], "val_ce": r["ce"], "val_norm": r["norm"]}

    def save(path: Path, extra: dict) -> None:
        weights = DD.model_state(model, dd, tc.fsdp)
        got = DD.gather(stream.consumed, dd)
        if main:
            atomic_torch_save(path, {**record, "model": weights, "weights_sha256": weights_sha256(weights),
                                     "step": step, "consumed": got, **extra})

    def save_state() -> None:  # every rank (collectives); rank 0 writes
        rng = DD.gather(DD.rng_state(device), dd)
        save(state_path, {"optimizer": DD.optimizer_state(model, opt, dd, tc.fsdp), "rng_ranks": rng})

    t0, status = time.time(), "completed"
    guard = LastFinite(model.parameters())
    log = open(metrics_path, "a") if main else None
    try:
        with SigtermFlag() as sigterm:  # SLURM's SIGTERM before a time limit: a last state.pt, exit 143
            model.train()
            while step < tc.max_steps:
                lr = cosine_lr(step + 1, s.warmup_steps, tc.max_steps, tc.lr, s.min_lr)
                for g in opt.param_groups:
                    g["lr"] = lr
                b = stream.batch(per_rank).to(device)
                is_log = (step + 1) % tc.log_every == 0 or step + 1 == tc.max_steps
                r = train_step(model, fwd, opt, b[:, :-1], b[:, 1:], cfg, device, all_exits=is_log, dd=dd, guard=guard)
                if not r.finite:
                    status = "diverged"
                    break
                step += 1
                res = global_mean(r.loss, dd) if is_log else None  # a collective: every rank
                if is_log and main:
                    log.write(json.dumps({"step": step, "lr": lr, "loss": res.total.item(), "ce": res.ce.tolist(),
                                          "norm": res.norms.tolist(), "grad_norm": r.grad_norm.item(),
                                          "tokens": step * tc.batch_size * mc.seq_len,
                                          "elapsed": time.time() - t0}) + "\n")
                    log.flush()
                if tc.eval_every and step % tc.eval_every == 0 and main and val_tokens is not None:
                    log.write(json.dumps(validate()) + "\n")
                if step % tc.ckpt_every == 0 and step < tc.max_steps:
                    save_state()
                sigterm.stop_if_raised(dd, step, tc.max_steps, state_path, save_state)
    finally:
        if log is not None:
            log.close()
    val = validate() if status == "completed" else None
    save(out / "model.pt", {"status": status})
    if main:  # the artifact files (model.safetensors, the tokenizer, config.json): loopscale.load, lm-eval
        from .artifacts import write_run_files
        weights = {k: v.detach().float() for k, v in model.state_dict().items()}
        plain = build_model(mc)
        plain.load_state_dict(weights)
        write_run_files(out, plain, {"config": cfg.to_dict(), "env": {}, "data": {}, "stream": record["stream"]},
                        tok.to_str(pretty=True).encode("utf-8"))
    summary = {"status": status, "steps": step, "tokens": step * tc.batch_size * mc.seq_len,
               "chunks_consumed_per_rank": stream.consumed, "stream_passes": stream.passes,
               "validation": val, "wall_time_s": time.time() - t0, "world_size": dd.world,
               "config_fingerprint": cfg.fingerprint(), "result_fingerprint": fingerprint}
    if main:
        if val is not None:
            with open(metrics_path, "a") as f:
                f.write(json.dumps(val) + "\n")
        atomic_write_json(out / "summary.json", summary)  # last: the run is finished
        keep_finished(out)
        state_path.unlink(missing_ok=True)
    DD.barrier(dd)
    return summary


# ---------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------
def cmd_train_stream(args) -> int:
    from .cli import train_or_record
    from .distributed import env_world

    run_sets = [o for o in args.overrides if not o.startswith("stream.")]
    stream_sets = parse_overrides([o for o in args.overrides if o.startswith("stream.")]).get("stream", {})
    cfg = resolve(args.config, args.preset, run_sets)
    base = dataclasses.asdict(StreamConfig())
    if args.stream_config:  # a file of stream settings (the pipeline's RUN/stream.yaml)
        from .config import read_yaml
        given = read_yaml(args.stream_config)
        if not isinstance(given, dict):
            raise ConfigError(f"{args.stream_config}: must hold a mapping of stream settings")
        base = merge(base, given.get("stream", given), "stream")
    s = StreamConfig.from_dict(merge(base, stream_sets, "stream"))
    if args.stop_with_parent:
        from .rundir import stop_with_parent
        stop_with_parent()
    summary = train_or_record(cfg, args, lambda: train_stream(cfg, s, args.out, val_data=args.val_data,
                                                              resume=not args.no_resume,
                                                              drop_stale_state=args.drop_stale_state))
    if summary is not None and env_world()[0] == 0:
        print(json.dumps({k: summary[k] for k in ("status", "steps", "tokens")}))
    return 0


def add_cli(subparsers) -> None:
    p = subparsers.add_parser("train-stream", help="train one run on a streamed corpus (FineWeb, Appendix B)")
    p.add_argument("--config", "-c", help="run config (YAML/JSON); may name a `preset:`")
    p.add_argument("--preset", help="start from this preset (e.g. ouro-1.4b)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a run setting (train.lr=...) or a stream setting (stream.tokenizer=DIR)")
    p.add_argument("--stream-config", help="a YAML file of stream settings (below --set stream.*)")
    p.add_argument("--out", required=True, help="run directory")
    p.add_argument("--val-data", "--data", dest="val_data",
                   help="a prepared data directory (same tokenizer) for validation")
    from .cli import add_run_dir_args
    add_run_dir_args(p, quiet_help="accepted for the pipeline (progress is logged)")
    p.set_defaults(func=cmd_train_stream)
