#!/usr/bin/env python
"""GPU benchmark of the paper-sized models, prepared to finish in under 5 minutes on one GPU.

    PYTHONPATH=src python benchmarks/gpu_bench.py            # on a CUDA machine
    OUT=/some/dir PYTHONPATH=src python benchmarks/gpu_bench.py   # also writes $OUT/gpu_bench.json
    GPU_BENCH_TINY=1 PYTHONPATH=src python benchmarks/gpu_bench.py  # seconds, any device (script test)

For `paper-44m` and `paper-129m` (per-loop CE, K=4, their paper batch sizes), on random
tokens, with bf16 autocast and fp32 master weights (the training default on CUDA), TF32 on:
  1. eager:     training tokens/s (median of timed steps after warm-up), model FLOP/s, MFU
                against this GPU's measured bf16 matmul peak (8192^3), peak memory of the
                training step (torch.cuda.max_memory_allocated), the same step's peak with the
                plain CE (K full logit tensors) for comparison, and evaluation tokens/s at
                every depth k = 1..K (fp32, like the depth evaluation);
  2. compiled:  the same training measurement with torch.compile(model) (what train.compile
                does), compile time reported separately; skipped if the time budget is short.
The JSON is rewritten after every measurement, so a run cut short still leaves its figures.

Environment: OUT (directory for gpu_bench.json), GPU_BENCH_BUDGET_S (default 270: variants
that would not fit are skipped), GPU_BENCH_STEPS / GPU_BENCH_WARMUP (default 20 / 5),
GPU_BENCH_MODELS (default "paper-44m,paper-129m"), GPU_BENCH_COMPILE (default 1),
GPU_BENCH_TINY=1 (tiny shapes and 2 steps: to test the script on a CPU).
"""
from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from loopscale.bench import (bench_config, bench_eval, bench_train, environment, matmul_peak,  # noqa: E402
                             step_memory_inprocess)
from loopscale.runtime import enable_tf32, sync  # noqa: E402

T0 = time.time()
TINY = os.environ.get("GPU_BENCH_TINY", "0") == "1"
BUDGET = float(os.environ.get("GPU_BENCH_BUDGET_S", "270"))
STEPS = int(os.environ.get("GPU_BENCH_STEPS", "2" if TINY else "20"))
WARMUP = int(os.environ.get("GPU_BENCH_WARMUP", "1" if TINY else "5"))
MODELS = os.environ.get("GPU_BENCH_MODELS", "paper-44m,paper-129m").split(",")
COMPILE = os.environ.get("GPU_BENCH_COMPILE", "1") == "1"
OUT = os.environ.get("OUT")
# tiny: the same code path at toy size (d 64, 2 layers, vocab 512, seq 64, batch 4)
TINY_OVERRIDES = dict(model=dict(d_model=64, n_layers=2, n_heads=1, d_ff=256, vocab_size=512, seq_len=64),
                      data=dict(vocab_size=512), train=dict(batch_size=4, eval_batch_size=4))


def left() -> float:
    return BUDGET - (time.time() - T0)


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def save(result: dict) -> None:
    if OUT:
        Path(OUT).mkdir(parents=True, exist_ok=True)
        tmp = Path(OUT) / "gpu_bench.json.tmp"
        tmp.write_text(json.dumps(result, indent=1))
        tmp.replace(Path(OUT) / "gpu_bench.json")


def config(name: str, precision: str):
    over = {"objective": {"loss": "per_loop"}, "train": {"precision": precision}}
    for section, values in (TINY_OVERRIDES.items() if TINY else ()):
        over[section] = {**over.get(section, {}), **values}
    return bench_config(name, over)


def release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main() -> int:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not TINY:
        print("no CUDA device: run on a GPU machine, or set GPU_BENCH_TINY=1 to test the script", file=sys.stderr)
        return 2
    enable_tf32(device)
    precision = "bf16"  # bf16 autocast with fp32 master weights (train.precision=auto on CUDA)
    result = {"env": environment(device), "tiny": TINY, "steps": STEPS, "warmup": WARMUP, "budget_s": BUDGET,
              "command": "PYTHONPATH=src python benchmarks/gpu_bench.py", "models": {}}
    peak_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    result["peak"] = matmul_peak(device, peak_dtype, n=None if not TINY else 1024)
    peak = result["peak"]["flop_per_s"]
    log(f"{result['env'].get('gpu', result['env']['cpu'])}: {peak_dtype} matmul peak {peak / 1e12:.1f} TFLOP/s")
    save(result)

    for variant in (["eager", "compiled"] if COMPILE else ["eager"]):
        for name in MODELS:
            rec = result["models"].setdefault(name, {})
            need = 150 if variant == "compiled" else 30
            if left() < need:
                rec[variant] = {"skipped": f"time budget: {left():.0f}s left, {need}s needed"}
                log(f"{name} {variant}: skipped ({left():.0f}s left)")
                save(result)
                continue
            cfg = config(name, precision)
            rec.setdefault("config", cfg.to_dict())
            try:
                t = time.time()
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                train, tr = bench_train(cfg, device, STEPS, WARMUP, compile=variant == "compiled")
                train["mfu"] = train["flop_per_s"] / peak
                if device.type == "cuda":
                    train["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device)
                train["wall_s"] = time.time() - t
                rec[variant] = train
                log(f"{name} {variant}: {train['tokens_per_s']:.0f} tok/s, {train['flop_per_s'] / 1e12:.1f} TFLOP/s, "
                    f"MFU {100 * train['mfu']:.1f}%, first step {train['first_step_s']:.1f}s"
                    + (f", peak mem {train['peak_memory_bytes'] / 2 ** 30:.2f} GiB" if "peak_memory_bytes" in train else ""))
                save(result)
                if variant == "eager":
                    ev = bench_eval(cfg, tr.model, device, batches=3 if TINY else 10, warmup=1 if TINY else 3)
                    for r in ev["depth"]:
                        r["mfu"] = r["flop_per_s"] / peak
                    rec["eval"] = ev
                    log(f"{name} eval tok/s: " + ", ".join(f"k={r['k']} {r['tokens_per_s']:.0f}" for r in ev["depth"]))
                    del tr
                    release()
                    if device.type == "cuda":  # CUDA allocator stats are exact: measure in process
                        mem = {impl: step_memory_inprocess(config(name, precision), device, impl)
                               for impl in ("chunked", "plain")}
                        mem["ratio"] = mem["chunked"]["step_bytes"] / max(mem["plain"]["step_bytes"], 1)
                        rec["memory"] = mem
                        log(f"{name} step memory: chunked {mem['chunked']['step_bytes'] / 2 ** 30:.2f} GiB, "
                            f"plain {mem['plain']['step_bytes'] / 2 ** 30:.2f} GiB (ratio {mem['ratio']:.2f})")
                else:
                    del tr
                save(result)
            except Exception as e:  # keep the other measurements
                rec[variant] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
                log(f"{name} {variant}: FAILED {type(e).__name__}: {e}")
                save(result)
            release()
            sync(device)
    result["total_s"] = time.time() - T0
    save(result)
    print(json.dumps({n: {v: {k: r[v].get(k) for k in ("tokens_per_s", "mfu", "peak_memory_bytes", "skipped", "error")}
                          for v in ("eager", "compiled") if v in r}
                      for n, r in result["models"].items()}, indent=1))
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
