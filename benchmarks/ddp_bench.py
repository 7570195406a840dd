#!/usr/bin/env python
"""Data-parallel benchmark of paper-1.4b: training tokens/s and memory per GPU on 1 and N GPUs.

    PYTHONPATH=src python benchmarks/ddp_bench.py                 # on a machine with N GPUs
    OUT=/some/dir PYTHONPATH=src python benchmarks/ddp_bench.py   # also writes $OUT/ddp_bench.json
    DDP_BENCH_TINY=1 PYTHONPATH=src python benchmarks/ddp_bench.py   # seconds, CPU, 2 gloo ranks

Each measurement is a real `loopscale train` run (the code path of a pipeline run) started
by `torchrun --standalone --nproc-per-node N` on a small slice of the builtin corpus, with
the paper-1.4b preset: global batch 8 (8/N per GPU), seq 256, K 4, terminal CE, bf16
autocast, DDP (and, with DDP_BENCH_FSDP=1, FSDP too). Figures come from the run's own
metrics.jsonl (one record per step): tokens/s of the whole job = median over the steps
after the warm-up, and the peak CUDA memory of rank 0 (torch.cuda.max_memory_allocated:
weights, gradients, AdamW state and activations). The JSON is rewritten after every
measurement, so a run cut short still leaves its figures.

Environment: OUT, DDP_BENCH_GPUS (default "1,<all GPUs>"), DDP_BENCH_STEPS (default 12),
DDP_BENCH_WARMUP (default 4), DDP_BENCH_FSDP (default 0), DDP_BENCH_TIMEOUT_S (per run,
default 600), DDP_BENCH_TINY=1 (tiny model on CPU, world sizes 1 and 2: tests the script).
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from loopscale.bench import environment  # noqa: E402
from loopscale.io import atomic_write_json  # noqa: E402

TINY = os.environ.get("DDP_BENCH_TINY", "0") == "1"
STEPS = int(os.environ.get("DDP_BENCH_STEPS", "6" if TINY else "12"))
WARMUP = int(os.environ.get("DDP_BENCH_WARMUP", "2" if TINY else "4"))
FSDP = os.environ.get("DDP_BENCH_FSDP", "0") == "1"
TIMEOUT = float(os.environ.get("DDP_BENCH_TIMEOUT_S", "600"))
OUT = os.environ.get("OUT")
N_GPUS = torch.cuda.device_count()
WORLDS = [int(w) for w in os.environ.get("DDP_BENCH_GPUS", "1,2" if TINY else f"1,{N_GPUS}").split(",")]
# tiny: the same code path at toy size on CPU (d 64, 2 layers, vocab 2048, seq 64)
TINY_SETS = ["model.d_model=64", "model.n_layers=2", "model.n_heads=2", "model.d_ff=256", "model.seq_len=64",
             "model.vocab_size=2048", "train.precision=fp32", "train.device=cpu", "train.threads=1"]
T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def save(result: dict) -> None:
    if OUT:
        Path(OUT).mkdir(parents=True, exist_ok=True)
        atomic_write_json(Path(OUT) / "ddp_bench.json", result)


def env() -> dict:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK"))}
    e["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), e.get("PYTHONPATH", "")])
    e.setdefault("OMP_NUM_THREADS", "1" if TINY else "4")
    return e


def prepare(root: Path) -> Path:
    data = root / "data"
    cmd = [sys.executable, "-m", "loopscale.cli", "prepare-data", "--preset", "paper-1.4b",
           "--set", "data.source=builtin", "--set", f"data.max_documents={20 if TINY else 60}",
           "--set", f"data.vocab_size={2048 if TINY else 20000}", "--out", str(data)]
    subprocess.run(cmd, check=True, env=env(), capture_output=True, text=True)
    return data


def measure(data: Path, root: Path, world: int, fsdp: bool) -> dict:
    out = root / f"run-{world}-{'fsdp' if fsdp else 'ddp'}"
    sets = [f"train.max_steps={STEPS}", "train.log_every=1", f"train.ckpt_every={STEPS + 1}",
            "train.eval_tokens=2048", f"train.fsdp={str(fsdp).lower()}", *(TINY_SETS if TINY else [])]
    if TINY:
        sets.append("data.vocab_size=2048")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
           "-m", "loopscale.cli", "train",
           "--preset", "paper-1.4b", "--data", str(data), "--out", str(out), "-q"]
    for s in sets:
        cmd += ["--set", s]
    t = time.time()
    proc = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=TIMEOUT)
    if proc.returncode != 0:
        return {"error": f"exit {proc.returncode}", "stderr": proc.stderr[-3000:]}
    recs = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "tok_per_s" in r][WARMUP:]
    res = {"world_size": world, "fsdp": fsdp, "global_batch": 8, "per_rank_batch": 8 // world,
           "steps_timed": len(steps), "tokens_per_s": statistics.median(r["tok_per_s"] for r in steps),
           "wall_s": time.time() - t, "command": " ".join(cmd)}
    res["tokens_per_s_per_gpu"] = res["tokens_per_s"] / world
    if steps and "max_memory_bytes" in steps[-1]:
        res["max_memory_bytes_rank0"] = max(r["max_memory_bytes"] for r in steps)
    return res


def main() -> int:
    if not TINY and N_GPUS == 0:
        print("no CUDA device: run on a GPU machine, or set DDP_BENCH_TINY=1 to test the script", file=sys.stderr)
        return 2
    device = torch.device("cuda" if N_GPUS and not TINY else "cpu")
    from loopscale.model import count_params
    from loopscale.config import preset
    result = {"env": environment(device), "tiny": TINY, "steps": STEPS, "warmup": WARMUP,
              "params": count_params(preset("paper-1.4b").model),
              "command": "PYTHONPATH=src python benchmarks/ddp_bench.py", "runs": []}
    with tempfile.TemporaryDirectory(prefix="ddp-bench-") as tmp:
        root = Path(tmp)
        log("preparing data (builtin corpus slice)")
        data = prepare(root)
        for world in dict.fromkeys(WORLDS):
            for fsdp in ([False, True] if FSDP and world > 1 else [False]):
                log(f"{world} rank(s){' FSDP' if fsdp else ''}: training {STEPS} steps")
                try:
                    r = measure(data, root, world, fsdp)
                except subprocess.TimeoutExpired:
                    r = {"world_size": world, "fsdp": fsdp, "error": f"timeout after {TIMEOUT:.0f}s"}
                result["runs"].append(r)
                save(result)
                if "error" in r:
                    log(f"  FAILED: {r['error']} {r.get('stderr', '')[-500:]}")
                else:
                    mem = r.get("max_memory_bytes_rank0")
                    log(f"  {r['tokens_per_s']:.0f} tok/s ({r['tokens_per_s_per_gpu']:.0f} per rank)"
                        + (f", peak memory rank 0 {mem / 2 ** 30:.1f} GiB" if mem else ""))
    result["total_s"] = time.time() - T0
    save(result)
    return 0 if all("error" not in r for r in result["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
