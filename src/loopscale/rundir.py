"""The run directory of a trainer: its lock, its resumable state, preemption, and the finished run
(`run_directory`, `load_state`, `SigtermFlag`, `keep_finished` / `restore_finished`,
`record_failure`). An overview: docs/architecture.md, "Inside the core modules".
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

import torch

from . import distributed as DD
from .config import RESULT_FREE, ConfigError, RunConfig
from .io import (CheckpointError, atomic_torch_save, atomic_write_json, atomic_write_text, load_checkpoint,
                 run_lock)

logger = logging.getLogger("loopscale.train")  # the trainers' messages, one logger

# settings that may change between a checkpoint and its resumption without changing results
RESUME_FREE = {"max_steps", "epochs", "log_every", "ckpt_every", "eval_every", "eval_tokens",
               "eval_batch_size", "device", "threads", "compile", "activation_checkpointing", "tensorboard", "fsdp",
               "wandb"}


class Preempted(RuntimeError):
    """SIGTERM arrived; the state was checkpointed and the run can be resumed."""


def resume_comparable(cfg: dict, free=RESUME_FREE) -> dict:
    """The part of a config dict that must match between a checkpoint and its resumption
    (with `free=RESULT_FREE`: between a finished run and a request to train it again)."""
    d = json.loads(json.dumps(cfg))
    d.pop("eval", None)  # checkpoints written before evaluation settings left the run config
    for k in free:
        d.get("train", {}).pop(k, None)
    return d


def same_settings(ck: dict, cfg: RunConfig, extra: dict | None = None) -> bool:
    """state.pt `ck` was written with the training settings of `cfg` (and, for a streamed run,
    the same `extra` entries, e.g. {"stream": ...}), so training can resume from it."""
    try:
        return resume_comparable(ck["config"]) == resume_comparable(cfg.to_dict()) \
            and all(ck.get(k) == v for k, v in (extra or {}).items())
    except (KeyError, TypeError, ValueError, AttributeError):
        return False


class SigtermFlag:
    """Turns SIGTERM (SLURM preemption / time limit) into a flag checked between steps: the
    training loop (`loopscale.train.fit`) runs under it and calls `stop_if_raised` after every
    optimiser step."""

    def __init__(self):
        self.raised = False
        self._old = None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, signum, frame):
        self.raised = True

    def __exit__(self, *exc):
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)

    def stop_if_raised(self, dd: DD.Dist, step: int, total_steps: int, state_path: Path, save) -> None:
        """Where SIGTERM reached any rank, stop every rank at this step: `save()` (called on
        every rank: FSDP gathers the shards) writes the resumable state, then Preempted (the
        command exits 143; rerunning it resumes from that state). A collective: every rank
        calls it after every step."""
        if DD.any_true(torch.tensor(self.raised), dd):
            save()
            raise Preempted(f"SIGTERM at step {step}/{total_steps}: state saved to {state_path}; "
                            f"rerun the same command to resume")


def stop_with_parent(poll_s: float = 0.5) -> None:
    """End this process the way a preemption does (SIGTERM: a last state.pt, exit 143) when its
    parent dies (loopscale.io.watch_parent, started at the very top of the command line entry,
    before the heavy imports, so this is a no-op there)."""
    from .io import watch_parent
    watch_parent(poll_s)


def metrics_upto(path: Path, step: int) -> None:
    """Drop log records past `step` (written after the checkpoint a resume starts from)."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= step:
                keep.append(line)
        except json.JSONDecodeError:  # a line torn by a crash
            continue
    atomic_write_text(path, "".join(l + "\n" for l in keep))


def load_state(path: Path, cfg: RunConfig, model, opt, device, total_steps: int, dd: DD.Dist,
               extra: dict | None = None) -> dict:
    """Load a state.pt into the model, the optimiser and this rank's RNG; returns its record
    without the tensors (step, elapsed seconds, a stream's position, ...). It must hold the
    training settings of `cfg` and the `extra` entries (a streamed run's {"stream": ...}).
    Anything amiss is one CheckpointError."""
    ck = load_checkpoint(path, map_location=device)
    again = "train with --no-resume to start over"
    if not same_settings(ck, cfg, extra):
        what = " or ".join(["a different config", *(f"other {k} settings" for k in extra or {})])
        raise CheckpointError(f"checkpoint {path} was written with other settings ({what}); {again} "
                              f"(or delete the run directory {path.parent})")
    step = ck.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"checkpoint {path} is malformed (step {step!r}); {again}")
    if step > total_steps:
        raise CheckpointError(f"checkpoint {path} is at step {step}, past this run's {total_steps} steps "
                              f"(train.max_steps or train.epochs lowered); raise them, or {again}")
    try:
        DD.load_states(model, opt, ck["model"], ck["optimizer"], dd, cfg.train.fsdp)
        ranks = ck.get("rng_ranks") or [{"cpu": ck["rng_cpu"], "cuda": ck.get("rng_cuda")}]
        if dd.rank < len(ranks):  # a checkpoint of fewer ranks leaves the others their fresh seeds
            DD.set_rng_state(ranks[dd.rank], device)
        elapsed = float(ck.get("elapsed", 0.0))
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, RuntimeError) as e:
        what = f"missing {e}" if isinstance(e, KeyError) else (str(e).splitlines() or [type(e).__name__])[0][:160]
        raise CheckpointError(f"checkpoint {path} is malformed ({what}); {again}") from None
    tensors = ("model", "optimizer", "rng_cpu", "rng_cuda", "rng_ranks")
    return {**{k: v for k, v in ck.items() if k not in tensors}, "elapsed": elapsed}


_PEER_LOST = re.compile(r"gloo|nccl|connection (closed|reset) by peer|broken pipe|processgroup|rendezvous|"
                        r"timed out .*(collective|store)", re.I)


def lost_peer(error: BaseException, world: int) -> bool:
    """Whether a training error under torchrun came from the other ranks (a lost peer, a
    broken collective), not from this run: the job then fails and its retry resumes from
    state.pt; it is never recorded as the run's result (--record-failure)."""
    if world <= 1:
        return False
    dist_error = getattr(torch.distributed, "DistError", ())
    return isinstance(error, dist_error) or (isinstance(error, RuntimeError) and bool(_PEER_LOST.search(str(error))))


def record_failure(cfg: RunConfig, out_dir: str | Path, error: BaseException) -> dict:
    """Mark a run that crashed as failed (summary.json and a model.pt without weights; see
    docs/architecture.md, `rundir.py`), keeping state.pt for a later retry."""
    summary = {"status": "failed", "error": f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:500],
               "steps": None, "config_fingerprint": cfg.fingerprint()}
    state = Path(out_dir) / "state.pt"
    if state.exists():
        with contextlib.suppress(CheckpointError):
            summary["steps"] = load_checkpoint(state)["step"]
    atomic_torch_save(Path(out_dir) / "model.pt", {"status": "failed", "config": cfg.to_dict(),
                                                   "error": summary["error"]})
    from .artifacts import WEIGHTS
    (Path(out_dir) / WEIGHTS).unlink(missing_ok=True)  # weights of an earlier run: not this run's
    for kept in KEPT.values():  # nor its finished model.pt / summary.json
        (Path(out_dir) / kept).unlink(missing_ok=True)
    atomic_write_json(Path(out_dir) / "summary.json", summary)
    return summary


def result_fingerprint(cfg: RunConfig | dict, stream: dict | None = None) -> str:
    """Hash of the settings a finished run's files depend on (not eval, threads, device, ...);
    with `stream` (a streamed run's StreamConfig as a dict, `loopscale train-stream`) those too."""
    d = resume_comparable(cfg if isinstance(cfg, dict) else cfg.to_dict(), RESULT_FREE)
    if stream is not None:
        d = {"config": d, "stream": stream}
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def finished_summary(out: Path, fingerprint: str, legacy: Callable[[dict], bool] | None = None) -> dict | None:
    """The summary of a finished run in `out` whose result_fingerprint is `fingerprint`, if
    there is one (`legacy(summary)` decides for a summary written before result fingerprints);
    a finished run of other settings is refused (like a state.pt of other settings), never
    overwritten."""
    try:
        summary = json.loads((out / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    if not (isinstance(summary, dict) and summary.get("status") in ("completed", "diverged")
            and (out / "model.pt").exists()):
        return None
    if "result_fingerprint" in summary:
        same = summary["result_fingerprint"] == fingerprint
    else:  # written before result fingerprints
        same = legacy is not None and legacy(summary)
    if not same:
        raise CheckpointError(f"{out} holds a finished run of other settings; train with --no-resume to "
                              f"replace it, or choose another --out")
    return summary


def clean_leftovers(out: Path) -> None:
    """Temporary files of writes a kill interrupted (`.NAME.*.tmp`, see io.atomic_write)."""
    for tmp in out.glob(".*.tmp"):
        if tmp.is_file():
            tmp.unlink(missing_ok=True)


def run_outputs(out: Path) -> list[Path]:
    """What a finished run writes beside its training state: the outputs of training
    (model.pt, summary.json, the artifact files) and of its evaluations (eval/<diagnostic>.json)."""
    from .artifacts import HF_CONFIG, MODELING, TOKENIZER_FILES, WEIGHTS
    from .registry import DIAGNOSTICS
    names = ["summary.json", HF_CONFIG, "model.pt", WEIGHTS, MODELING, *TOKENIZER_FILES,
             *(d.file for d in DIAGNOSTICS.values())]
    return [out / n for n in names]


# A finished run keeps a second name (a hard link: no second copy) of model.pt and summary.json.
# Snakemake deletes a job's outputs before rerunning it as "incomplete", also when the job in
# fact finished (snakemake alone interrupted with Ctrl-C or SIGINT waits for the running job,
# then records it incomplete, and `--rerun-incomplete` deletes the finished model.pt): with both
# files gone and these names holding a finished run of the same settings, the run is restored,
# never retrained from step 0.
KEPT = {"model.pt": ".finished.model.pt", "summary.json": ".finished.summary.json"}


def keep_finished(out: Path) -> None:
    """Second names for a finished run's model.pt and summary.json (skipped where the file
    system has no hard links)."""
    for name, kept in KEPT.items():
        (out / kept).unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            os.link(out / name, out / kept)


def restore_finished(out: Path, fingerprint: str) -> bool:
    """Put back a finished run of these settings whose model.pt and summary.json were both
    deleted (see KEPT); True when it did. Anything else the second names hold is dropped."""
    if any((out / n).exists() for n in KEPT) or not all((out / k).is_file() for k in KEPT.values()):
        return False
    try:
        summary = json.loads((out / KEPT["summary.json"]).read_text())
        same = (isinstance(summary, dict) and summary.get("status") in ("completed", "diverged")
                and summary.get("result_fingerprint") == fingerprint)
    except (OSError, ValueError):
        same = False
    if not same:
        for kept in KEPT.values():
            (out / kept).unlink(missing_ok=True)
        return False
    now = time.time()
    for name, kept in KEPT.items():  # model.pt first: summary.json, last, says the run is finished
        tmp = out / f".{name}.restore.tmp"
        tmp.unlink(missing_ok=True)
        os.link(out / kept, tmp)
        os.utime(tmp, (now, now))  # newer than its inputs, as a just-finished job's outputs are
        os.replace(tmp, out / name)
    logger.info("%s: kept the finished run (its model.pt and summary.json had been deleted, e.g. by "
                "snakemake --rerun-incomplete after an interrupt); train with --no-resume to retrain it", out)
    return True


def invalidate_outputs(out: Path, fresh: bool) -> None:
    """Before training starts or resumes, remove the finished-run files an earlier run of this
    directory left (docs/architecture.md, `rundir.py`); a fresh start also drops tensorboard/."""
    for p in [*(out / k for k in KEPT.values()), *run_outputs(out)]:
        p.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        (out / "eval").rmdir()  # only when empty: it may hold files that are not ours
    if fresh:
        shutil.rmtree(out / "tensorboard", ignore_errors=True)  # nothing there: a no-op


def drop_stale(run_dir: str | Path, cfg: RunConfig, extra: dict | None = None) -> bool:
    """Delete RUN/state.pt when it was written with other training settings than `cfg` (or
    other `extra` entries, e.g. {"stream": ...}): resuming it would raise. `--drop-stale-state`
    calls it inside the run lock, so a running trainer's state.pt is never touched. True when
    it was deleted."""
    state = Path(run_dir) / "state.pt"
    if not state.exists():
        return False
    try:
        same = same_settings(load_checkpoint(state), cfg, extra)
    except CheckpointError:
        same = False
    if not same:
        state.unlink(missing_ok=True)
        logger.warning("%s belonged to other settings; training starts over", state)
        return True
    return False


@contextlib.contextmanager
def run_directory(out_dir: str | Path, what: str, fingerprint: str, *, resume: bool,
                  legacy: Callable[[dict], bool] | None = None,
                  drop_stale: Callable[[Path], object] | None = None) -> Iterator[dict | None]:
    """The run directory of a trainer, created and locked for the block (docs/architecture.md,
    `rundir.py`). Yields the summary of a finished run of these settings (`fingerprint`), which
    the trainer returns instead of training, or None (train, resuming state.pt); a finished run
    of other settings is refused (CheckpointError) unless `resume=False`. `drop_stale`
    (--drop-stale-state) is called once the directory is locked."""
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise ConfigError(f"run directory {out} is a file or lies under one; choose another --out") from None
    main = DD.env_world()[0] == 0  # under torchrun only rank 0 writes files, so only it locks
    with run_lock(out, what) if main else contextlib.nullcontext():
        if main:
            clean_leftovers(out)
        if drop_stale is not None:
            drop_stale(out)
        if resume:
            restore_finished(out, fingerprint)
        done = finished_summary(out, fingerprint, legacy) if resume else None
        if done is not None:  # these very settings are already trained: keep the run untouched
            (out / "state.pt").unlink(missing_ok=True)  # a kill between model.pt and its removal
            if main:
                logger.info("%s is already finished (%s, %s steps): kept as it is, not trained again; "
                            "train with --no-resume to retrain it", out, done.get("status"), done.get("steps"))
        yield done

