#!/usr/bin/env python
"""GPU benchmark of the paper-sized models (part c of benchmarks/gpu_check.py; runs alone too).

    PYTHONPATH=src python benchmarks/gpu_bench.py --out results/bench          # on a CUDA machine
    PYTHONPATH=src python benchmarks/gpu_bench.py --device cpu --tiny --out /tmp/b   # seconds, any device

For `paper-44m` and `paper-129m` (per-loop CE, K = 4, their paper batch sizes 64 / 32, seq
256), on random tokens, with bf16 autocast and fp32 master weights (the training default on
CUDA), TF32 on:
  1. eager:     training tokens/s (median of timed, synchronised steps after warm-up), model
                FLOP/s by the project's count (`bench.flop_count`, built on
                `model.flops_per_token`), MFU against the measured bf16 matmul peak (8192^3, or
                `--peak-flops` from gpu_check's environment part), peak memory of the training
                step (torch.cuda.max_memory_allocated), the same step's peak with the plain CE
                (K full logit tensors) for comparison, and evaluation tokens/s at every depth
                k = 1..K (fp32, like the depth evaluation), recorded beside the paper's 129M
                evaluation throughput (Table 5 / Figure 4: 80k / 41k / 28k / 21k tok/s at K = 1..4);
  2. compiled:  the same training measurement with torch.compile(model) (what train.compile
                does), compile time in `first_step_s`; skipped when less than
                `--compile-need-s` of the time budget is left.
The JSON (`--out DIR` -> DIR/bench.json) is rewritten after every measurement, so a run cut
short still leaves its figures. Flags default to the environment variables GPU_BENCH_BUDGET_S,
GPU_BENCH_STEPS, GPU_BENCH_WARMUP, GPU_BENCH_MODELS, GPU_BENCH_COMPILE (0/1), GPU_BENCH_TINY
(0/1) and OUT, where set.
"""
from __future__ import annotations

import argparse
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
from loopscale.io import atomic_write_json  # noqa: E402
from loopscale.runtime import enable_tf32, resolve_device, sync  # noqa: E402

MODELS = ("paper-44m", "paper-129m")
# the paper's evaluation throughput of the 129M model at depth K = 1..4 (Table 5 / Figure 4),
# tokens/s on the authors' GPU; the only throughput the paper reports
PAPER_EVAL_TOKENS_PER_S = {"paper-129m": {1: 80_000, 2: 41_000, 3: 28_000, 4: 21_000}}
# --tiny: the same code path at toy size (d 64, 2 layers, vocab 512, seq 64, batch 4)
TINY_OVERRIDES = dict(model=dict(d_model=64, n_layers=2, n_heads=1, d_ff=256, vocab_size=512, seq_len=64),
                      data=dict(vocab_size=512), train=dict(batch_size=4, eval_batch_size=4))


def config(name: str, precision: str, tiny: bool):
    over = {"objective": {"loss": "per_loop"}, "train": {"precision": precision}}
    for section, values in (TINY_OVERRIDES.items() if tiny else ()):
        over[section] = {**over.get(section, {}), **values}
    return bench_config(name, over)


def release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run(out_file: Path | None, *, device: str = "auto", models=MODELS, steps: int = 20, warmup: int = 5,
        compile: bool = True, budget_s: float = 270.0, tiny: bool = False, peak_flops: float | None = None,
        eval_batches: int | None = None, eval_warmup: int | None = None, compile_need_s: float = 60.0,
        eager_need_s: float = 15.0, log=print, on_save=None) -> dict:
    """Run the benchmark; the result dict is written to `out_file` (and given to `on_save`)
    after every measurement."""
    t0 = time.time()

    def left() -> float:
        return budget_s - (time.time() - t0)

    def save() -> None:
        result["elapsed_s"] = time.time() - t0
        if out_file is not None:
            atomic_write_json(out_file, result)
        if on_save is not None:
            on_save(result)

    dev = resolve_device(device)
    enable_tf32(dev)
    # bf16 autocast with fp32 master weights (train.precision=auto on CUDA); bf16 on CPU too
    precision = "bf16"
    eval_batches = eval_batches or (2 if tiny else 10)
    eval_warmup = eval_warmup if eval_warmup is not None else (1 if tiny else 3)
    result = {"env": environment(dev), "tiny": tiny, "steps": steps, "warmup": warmup, "budget_s": budget_s,
              "precision": "bf16 autocast, fp32 master weights, TF32 on", "models": {},
              "paper_eval_tokens_per_s": {m: {str(k): v for k, v in r.items()} for m, r in PAPER_EVAL_TOKENS_PER_S.items()}}
    if peak_flops:
        result["peak"] = {"flop_per_s": peak_flops, "source": "given (gpu_check environment part)"}
    else:
        result["peak"] = matmul_peak(dev, torch.bfloat16, n=256 if tiny else None)
        result["peak"]["source"] = "measured here"
    peak = result["peak"]["flop_per_s"]
    log(f"[bench] {result['env'].get('gpu', result['env']['cpu'])}: bf16 matmul peak {peak / 1e12:.2f} TFLOP/s")
    save()

    for variant in (["eager", "compiled"] if compile else ["eager"]):
        for name in models:
            rec = result["models"].setdefault(name, {})
            need = compile_need_s if variant == "compiled" else eager_need_s
            if left() < need:
                rec[variant] = {"skipped": f"time budget: {left():.0f}s left, {need:.0f}s needed"}
                log(f"[bench] {name} {variant}: skipped ({left():.0f}s left)")
                save()
                continue
            cfg = config(name, precision, tiny)
            rec.setdefault("config", cfg.to_dict())
            try:
                t = time.time()
                if dev.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(dev)
                train, tr = bench_train(cfg, dev, steps, warmup, compile=variant == "compiled")
                train["mfu"] = train["flop_per_s"] / peak
                if dev.type == "cuda":
                    train["peak_memory_bytes"] = torch.cuda.max_memory_allocated(dev)
                train["wall_s"] = time.time() - t
                rec[variant] = train
                log(f"[bench] {name} {variant}: {train['tokens_per_s']:.0f} tok/s, "
                    f"{train['flop_per_s'] / 1e12:.2f} TFLOP/s, MFU {100 * train['mfu']:.1f}%, first step "
                    f"{train['first_step_s']:.1f}s" + (f", peak mem {train['peak_memory_bytes'] / 2 ** 30:.2f} GiB"
                                                       if "peak_memory_bytes" in train else ""))
                save()
                if variant == "eager":
                    ev = bench_eval(cfg, tr.model, dev, batches=eval_batches, warmup=eval_warmup)
                    paper = PAPER_EVAL_TOKENS_PER_S.get(name, {})
                    for r in ev["depth"]:
                        r["mfu"] = r["flop_per_s"] / peak
                        r["paper_tokens_per_s"] = paper.get(r["k"])
                        r["ratio_to_paper"] = r["tokens_per_s"] / paper[r["k"]] if r["k"] in paper else None
                    rec["eval"] = ev
                    log(f"[bench] {name} eval tok/s: " + ", ".join(
                        f"k={r['k']} {r['tokens_per_s']:.0f}" + (f" (paper {r['paper_tokens_per_s']})"
                                                                  if r["paper_tokens_per_s"] else "")
                        for r in ev["depth"]))
                    del tr
                    release()
                    save()
                    if dev.type == "cuda":  # CUDA allocator statistics are exact: measured in process
                        mem = {impl: step_memory_inprocess(config(name, precision, tiny), dev, impl)
                               for impl in ("chunked", "plain")}
                        mem["ratio"] = mem["chunked"]["step_bytes"] / max(mem["plain"]["step_bytes"], 1)
                        rec["memory"] = mem
                        log(f"[bench] {name} step memory: chunked {mem['chunked']['step_bytes'] / 2 ** 30:.2f} GiB, "
                            f"plain {mem['plain']['step_bytes'] / 2 ** 30:.2f} GiB (ratio {mem['ratio']:.2f})")
                else:
                    del tr
                save()
            except Exception as e:  # keep the other measurements
                rec[variant] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
                log(f"[bench] {name} {variant}: FAILED {type(e).__name__}: {e}")
                save()
            release()
            sync(dev)
    result["done"] = True
    save()
    return result


def _env(name: str, default: str) -> str:
    return os.environ.get(name, default)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT"), help="directory for bench.json (default $OUT)")
    p.add_argument("--device", default="auto", help="auto | cuda | cpu (default auto)")
    p.add_argument("--tiny", action="store_true", default=_env("GPU_BENCH_TINY", "0") == "1",
                   help="toy shapes and few steps: to test the script anywhere")
    p.add_argument("--models", default=_env("GPU_BENCH_MODELS", ",".join(MODELS)), help="comma-separated presets")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 20; 2 with --tiny)")
    p.add_argument("--warmup", type=int, default=None, help="untimed warm-up steps (default 5; 1 with --tiny)")
    p.add_argument("--no-compile", dest="compile", action="store_false",
                   default=_env("GPU_BENCH_COMPILE", "1") == "1", help="skip the torch.compile variant")
    p.add_argument("--budget-s", type=float, default=float(_env("GPU_BENCH_BUDGET_S", "270")),
                   help="time budget: variants that no longer fit are skipped (default 270)")
    p.add_argument("--compile-need-s", type=float, default=60.0,
                   help="time a compiled variant needs to be started (default 60)")
    p.add_argument("--peak-flops", type=float, default=None, help="bf16 peak FLOP/s to use instead of measuring")
    a = p.parse_args(argv)
    a.steps = a.steps if a.steps is not None else int(_env("GPU_BENCH_STEPS", "2" if a.tiny else "20"))
    a.warmup = a.warmup if a.warmup is not None else int(_env("GPU_BENCH_WARMUP", "1" if a.tiny else "5"))
    models = [m.strip() for m in a.models.split(",") if m.strip()]
    for flag, v, lo in (("--steps", a.steps, 1), ("--warmup", a.warmup, 0), ("--budget-s", a.budget_s, 0)):
        if v < lo:
            p.error(f"{flag} must be >= {lo}, got {v}")
    from loopscale.config import MODEL_PRESETS
    bad = [m for m in models if m not in MODEL_PRESETS]
    if bad or not models:
        p.error(f"--models: unknown preset {bad[0] if bad else '(none given)'!r}; choose from {', '.join(MODEL_PRESETS)}")
    a.models = models
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    dev = resolve_device(a.device)
    if dev.type != "cuda" and not a.tiny:
        print("no CUDA device: run on a GPU machine, or add --tiny to test the script", file=sys.stderr)
        return 2
    out_file = Path(a.out) / "bench.json" if a.out else None
    r = run(out_file, device=a.device, models=a.models, steps=a.steps, warmup=a.warmup, compile=a.compile,
            budget_s=a.budget_s, tiny=a.tiny, peak_flops=a.peak_flops, compile_need_s=a.compile_need_s,
            log=lambda s: print(s, flush=True))
    print(json.dumps({n: {v: {k: rec[v].get(k) for k in ("tokens_per_s", "mfu", "peak_memory_bytes", "skipped", "error")}
                          for v in ("eager", "compiled") if v in rec}
                      for n, rec in r["models"].items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
