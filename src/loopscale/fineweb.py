"""Appendix B's training recipe: FineWeb streamed through `datasets`, trained with a cosine schedule.

The official `src/train_ouro_from_scratch_ddp.py` streams `HuggingFaceFW/fineweb`
(`sample-10BT`), shuffles it with a 10,000-document buffer, skips every document whose text,
stripped of leading and trailing whitespace, has fewer than 50 characters, tokenises the rest
with the Ouro tokenizer (no special tokens) and concatenates them into one token stream cut
into chunks of seq+1 tokens that overlap by one (chunk i = tokens [i·seq, (i+1)·seq]). Under
data parallelism each rank reads its own shard of the stream (`IterableDataset.shard`), or
every world-th chunk where the stream cannot be sharded. The learning rate warms up linearly
from 0 and decays by a cosine to `min_lr`; AdamW β = (0.9, 0.95).

Here the same stream feeds loopscale's training step (`loopscale.train.train_step`: grad
accumulation, autocast, DDP under torchrun, the divergence guard) and its preemption handling
(`loopscale.train.SigtermFlag`: SIGTERM on any rank, as SLURM sends before a time limit, stops
every rank after the current step with a last state.pt and exit status 143), with two differences that
are deliberate: resuming is exact (a state.pt records how many chunks each rank consumed, and
the reopened stream skips exactly those; the official `--exact-stream-resume` skips an
approximate token count, and by default none), and the schedule counts optimiser steps (the
official counts micro-steps: its 1,000 warm-up micro-steps at grad-accum 3 are 333 steps).

  loopscale train-stream --preset ouro-1.4b --out RUN [--set stream.KEY=VALUE ...]
                         [--val-data DATA]        a prepared data dir for validation

Settings (`StreamConfig`, `--set stream.*`): `dataset`, `subset`, `data_files` (local parquet
files in FineWeb's schema instead of the hub), `shuffle_buffer`, `min_chars`, `tokenizer` (a
directory holding tokenizer.json, a tokenizer.json, or a hub name), `warmup_steps`, `min_lr`,
`pure_bf16` (weights and optimiser state in bf16, as the official trainer keeps them).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional

from .config import ConfigError, RunConfig, _build, merge, parse_overrides, resolve

logger = logging.getLogger("loopscale.fineweb")


@dataclass
class StreamConfig:
    dataset: str = "HuggingFaceFW/fineweb"
    subset: str = "sample-10BT"
    split: str = "train"
    data_files: list = field(default_factory=list)  # local parquet files (FineWeb's schema) instead of the hub
    text_key: str = "text"
    shuffle_buffer: int = 10_000  # documents; 0: stream order
    shuffle_seed: int = 42  # official: the run's seed
    min_chars: int = 50  # documents whose stripped text is shorter are skipped
    tokenizer: str = "ByteDance/Ouro-1.4B"  # a dir with tokenizer.json, a tokenizer.json, or a hub name
    warmup_steps: int = 333  # optimiser steps of linear warm-up from 0
    min_lr: float = 3e-5  # the cosine's floor (train.lr is its peak)
    pure_bf16: bool = False  # weights, gradients and AdamW state in bf16 (official), instead of fp32 master weights
    heldout_documents: int = 0  # the first N documents of the unshuffled stream are never trained on (evaluation)

    @classmethod
    def from_dict(cls, d: dict) -> "StreamConfig":
        s = _build(cls, d, "stream")
        for name in ("shuffle_buffer", "min_chars", "warmup_steps", "shuffle_seed", "heldout_documents"):
            if getattr(s, name) < 0:
                raise ConfigError(f"stream.{name} must be >= 0, got {getattr(s, name)!r}")
        if not (math.isfinite(s.min_lr) and s.min_lr >= 0):
            raise ConfigError(f"stream.min_lr must be a finite number >= 0, got {s.min_lr!r}")
        if not all(isinstance(f, str) for f in s.data_files):
            raise ConfigError("stream.data_files must be a list of file paths")
        return s


# the settings of StreamConfig that a pipeline experiment sets in its `stream:` block (the
# training recipe); the corpus and the tokenizer come from its `data:` (source=fineweb)
RECIPE_KEYS = ("shuffle_buffer", "warmup_steps", "min_lr", "pure_bf16")


def stream_settings(data: dict, recipe: Optional[dict] = None, seed: int = 42) -> dict:
    """The StreamConfig (as a dict, validated) of a pipeline run: corpus, tokenizer, filter and
    held-out documents from its data settings (source=fineweb), the recipe from `recipe`, the
    shuffle seeded by the run's seed (as the official trainer seeds it)."""
    recipe = dict(recipe or {})
    bad = sorted(set(recipe) - set(RECIPE_KEYS))
    if bad:
        raise ConfigError(f"unknown key 'stream.{bad[0]}'; choose one of {', '.join(RECIPE_KEYS)} (the corpus and "
                          f"the tokenizer are data settings)")
    d = {"dataset": data["stream_dataset"], "subset": data["stream_subset"], "data_files": list(data["data_files"]),
         "tokenizer": data["pretrained_tokenizer"], "min_chars": data["min_chars"],
         "heldout_documents": data["heldout_documents"], "shuffle_seed": int(seed), **recipe}
    s = StreamConfig.from_dict(merge(dataclasses.asdict(StreamConfig()), d, "stream"))
    return dataclasses.asdict(s)


# ---------------------------------------------------------------------------
# the stream
# ---------------------------------------------------------------------------
def load_tokenizer(spec: str):
    """A `tokenizers.Tokenizer` from a directory holding tokenizer.json, a tokenizer.json file,
    or the hub (e.g. ByteDance/Ouro-1.4B; needs network or the local hub cache)."""
    from tokenizers import Tokenizer
    p = Path(spec)
    if p.is_dir():
        if not (p / "tokenizer.json").is_file():
            raise FileNotFoundError(f"tokenizer directory {p} has no tokenizer.json")
        return Tokenizer.from_file(str(p / "tokenizer.json"))
    if p.is_file():
        return Tokenizer.from_file(str(p))
    try:
        return Tokenizer.from_pretrained(spec)
    except Exception as e:
        raise FileNotFoundError(f"tokenizer {spec!r}: not a local directory or file, and the hub did not "
                                f"give it ({type(e).__name__}); download it or pass a local path") from None


def _raw_documents(s: StreamConfig):
    from datasets import load_dataset
    if s.data_files:
        missing = [f for f in s.data_files if not Path(f).is_file()]
        if missing:
            raise FileNotFoundError(f"stream.data_files: {missing[0]} not found")
        return load_dataset("parquet", data_files=list(s.data_files), split="train", streaming=True)
    return load_dataset(s.dataset, name=s.subset or None, split=s.split, streaming=True)


def head_documents(s: StreamConfig, n: int) -> list[str]:
    """The texts of the first n documents of the stream in file order (before shuffling and
    filtering): the held-out documents (`heldout_documents`)."""
    import itertools
    return [doc.get(s.text_key) or "" for doc in itertools.islice(_raw_documents(s), n)]


def text_key(text: str) -> str:
    import hashlib
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def open_documents(s: StreamConfig, rank: int = 0, world: int = 1) -> tuple[Iterable[dict], bool]:
    """(the document stream of this rank, whether it is already sharded by rank). With
    heldout_documents N, every document whose text is one of the first N documents' (held
    out for evaluation) is left out, wherever the shuffle and the sharding put it."""
    ds = _raw_documents(s)
    if s.heldout_documents:
        held = {text_key(t) for t in head_documents(s, s.heldout_documents)}
        ds = ds.filter(lambda doc: text_key(doc.get(s.text_key) or "") not in held)
    if s.shuffle_buffer > 0:
        ds = ds.shuffle(seed=s.shuffle_seed, buffer_size=s.shuffle_buffer)
    if world > 1 and getattr(ds, "num_shards", 1) >= world:
        return ds.shard(num_shards=world, index=rank), True
    return ds, False


def chunks(docs: Iterable[dict], encode: Callable[[str], list[int]], seq_len: int, min_chars: int = 50,
           text_key: str = "text", rank: int = 0, world: int = 1) -> Iterator[list[int]]:
    """The official chunking: documents with fewer than `min_chars` characters once stripped are
    skipped, the others' tokens concatenated and cut into seq_len+1 chunks overlapping by one
    token; with world > 1 this rank keeps chunks rank, rank+world, ..."""
    buf: list[int] = []
    i = 0
    for doc in docs:
        text = doc.get(text_key) or ""
        if len(text.strip()) < min_chars:
            continue
        buf.extend(encode(text))
        while len(buf) >= seq_len + 1:
            chunk, buf = buf[:seq_len + 1], buf[seq_len:]
            if i % world == rank:
                yield chunk
            i += 1


class ChunkStream:
    """This rank's chunks of the stream, counting what it handed out (`consumed`), so a resumed
    run reopens the stream and skips exactly that many. The stream restarts at its end."""

    def __init__(self, s: StreamConfig, tokenizer, seq_len: int, rank: int = 0, world: int = 1,
                 consumed: int = 0):
        self.s, self.seq_len, self.rank, self.world = s, seq_len, rank, world
        self.encode = lambda text: tokenizer.encode(text, add_special_tokens=False).ids
        self.consumed, self.passes = 0, 0
        self._it = self._open()
        for _ in range(consumed):
            self._next()

    def _open(self) -> Iterator[list[int]]:
        docs, sharded = open_documents(self.s, self.rank, self.world)
        r, w = (0, 1) if sharded else (self.rank, self.world)
        return chunks(docs, self.encode, self.seq_len, self.s.min_chars, self.s.text_key, r, w)

    def _next(self) -> list[int]:
        try:
            c = next(self._it)
        except StopIteration:
            self.passes += 1
            self._it = self._open()
            try:
                c = next(self._it)
            except StopIteration:
                raise ConfigError(f"the stream gives no chunk of seq_len+1 = {self.seq_len + 1} tokens "
                                  f"(documents too short, or all filtered)") from None
        self.consumed += 1
        return c

    def batch(self, n: int) -> torch.Tensor:
        """The next n chunks, [n, seq_len+1] (int64)."""
        import torch
        return torch.tensor([self._next() for _ in range(n)], dtype=torch.long)


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
    from .train import result_fingerprint
    try:
        rec = json.loads((out / RECORD).read_text())
        return result_fingerprint(rec["config"], rec["stream"])
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def train_stream(cfg: RunConfig, s: StreamConfig, out_dir: str | Path, *, val_data: Optional[str | Path] = None,
                 resume: bool = True) -> dict:
    """Train `cfg` on the stream `s` for train.max_steps optimiser steps into `out_dir`:
    metrics.jsonl, state.pt (every train.ckpt_every steps and on SIGTERM: weights, optimiser,
    every rank's RNG, step, chunks consumed), model.pt (what `loopscale eval` reads) and
    summary.json. SIGTERM raises `train.Preempted` once the state is saved; calling this again
    resumes from it exactly (the same batches, dropout masks and learning rates).

    The run directory is handled as `loopscale train` handles its own (`train.run_directory`):
    locked for the duration, and a finished run of these settings (config and stream) is
    returned as it is, one of other settings refused, unless `resume` is False."""
    from .train import result_fingerprint, run_directory

    if not cfg.train.max_steps:
        raise ConfigError("train.max_steps is required for a streamed run (a stream has no epochs)")
    out = Path(out_dir)
    fp = result_fingerprint(cfg, dataclasses.asdict(s))
    with run_directory(out, "loopscale train-stream", fp, resume=resume,
                       legacy=lambda summary: _recorded_fingerprint(out) == fp) as done:
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
    from .train import (LastFinite, SigtermFlag, _invalidate_outputs, _keep_finished, _metrics_upto, global_mean,
                        resume_comparable, train_step)

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
    val_tokens = D.load_split(val_data, "validation") if val_data else None

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
        if resume_comparable(ck.get("config") or {}) != resume_comparable(record["config"]) \
                or ck.get("stream") != record["stream"]:
            raise ConfigError(f"{state_path} was written with other settings; delete it to start over")
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
    if main:  # what an earlier run of this directory left is not this run's (train._invalidate_outputs)
        _invalidate_outputs(out, fresh=not resumed)
        if resumed:  # records written after that state (a crash between checkpoints) are redone
            _metrics_upto(metrics_path, step)
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
        _keep_finished(out)
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
        from .train import stop_with_parent
        stop_with_parent()
    if args.drop_stale_state:
        from .pipeline import drop_stale_state
        drop_stale_state(args.out, cfg)
    summary = train_or_record(cfg, args, lambda: train_stream(cfg, s, args.out, val_data=args.val_data,
                                                              resume=not args.no_resume))
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
    p.add_argument("--no-resume", action="store_true", help="ignore an existing state.pt")
    p.add_argument("--quiet", "-q", action="store_true", help="accepted for the pipeline (progress is logged)")
    p.add_argument("--record-failure", action="store_true",
                   help="on a crash, write summary.json with status 'failed' and exit 0 (pipeline use)")
    p.add_argument("--drop-stale-state", action="store_true",
                   help="delete a state.pt written with other training settings instead of refusing it (pipeline use)")
    p.add_argument("--stop-with-parent", action="store_true",
                   help="stop as on SIGTERM (checkpoint, exit 143) when the parent process dies (pipeline use)")
    p.set_defaults(func=cmd_train_stream)
