"""`loopscale bench`: training and evaluation speed, FLOP/s, MFU and memory of one config,
on random token batches with exactly the training step of `loopscale train`. What is
measured and how (peak, train, eval, memory; the `paper-cpu` shape): docs/performance.md.
"""
from __future__ import annotations

import contextlib
import gc
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from .config import BENCH_PRESETS, RunConfig, merge, preset
from .evaluate import depth_ce
from .model import count_params, flops_per_token
from .objective import compute_loss
from .runtime import autocast, enable_tf32, resolve_device, sync, uses_bf16
from .train import build, train_step

# ---------------------------------------------------------------------------
# small helpers
# ---------------------------------------------------------------------------
def _proc_status_kib(field: str) -> int | None:
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return None


def current_rss() -> int:
    """Resident set size of this process now, bytes (Linux /proc; falls back to the high-water mark)."""
    kib = _proc_status_kib("VmRSS")
    return kib * 1024 if kib is not None else max_rss()


def max_rss() -> int:
    """Peak resident set size of this process so far, bytes (VmHWM = ru_maxrss)."""
    kib = _proc_status_kib("VmHWM")
    if kib is not None:
        return kib * 1024
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r if sys.platform == "darwin" else r * 1024


def reset_max_rss() -> bool:
    """Reset the peak-RSS high-water mark to the current RSS (Linux >= 4.0: clear_refs 5)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def cpu_name() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def environment(device: torch.device) -> dict:
    from .io import git_commit
    env = {"torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
           "device": str(device), "threads": torch.get_num_threads(), "cpu": cpu_name(),
           "cpu_count": os.cpu_count(), "git_commit": git_commit()}
    with contextlib.suppress(OSError):
        env["load_average_1m"] = os.getloadavg()[0]
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    return env


def bench_config(name: str | None, overrides: dict | None = None) -> RunConfig:
    """A preset or bench shape plus nested overrides."""
    if name in BENCH_PRESETS:
        base, extra = BENCH_PRESETS[name]
        d = merge(preset(base).to_dict(), extra)
    else:
        d = preset(name or "cpu").to_dict()
    if overrides:
        d = merge(d, overrides)
    return RunConfig.from_dict(d)


def flop_count(cfg: RunConfig) -> dict:
    """Model FLOPs of one training token and how they are counted."""
    m = cfg.model
    K = m.n_loops
    R = K if cfg.objective.loss in ("per_loop", "adaptive") else 1  # readouts whose CE enters the loss
    fwd, stack = flops_per_token(m, K, R), flops_per_token(m, K, 0)
    return {"forward_per_token": fwd, "train_per_token": 3 * fwd, "stack_forward_per_token": stack,
            "head_forward_per_token": fwd - stack, "loops": K, "readouts": R,
            "rule": ("train = 3 x forward matmul FLOPs (2 per multiply-add); forward = model.flops_per_token: "
                     "K x (n_layers x [2(2d^2 + 2 d d_kv + 3 d d_ff) + 2 T d (causal QK^T and AV)] + the exit "
                     "gate's 2d) + readouts x 2 d V; embeddings, norms, softmax and optimizer not counted; the "
                     "chunked CE adds no recomputation")}


def matmul_peak(device: torch.device, dtype: torch.dtype, n: int | None = None, reps: int = 10,
                warmup: int = 3) -> dict:
    """FLOP/s of an n x n x n matmul in `dtype`: best and median of `reps` timed runs."""
    n = n or (8192 if device.type == "cuda" else 2048)
    g = torch.Generator(device="cpu").manual_seed(0)
    a, b = (torch.randn(n, n, generator=g).to(device=device, dtype=dtype) for _ in range(2))
    out = torch.empty(n, n, device=device, dtype=dtype)
    for _ in range(warmup):
        torch.mm(a, b, out=out)
    sync(device)
    times, cpu = [], []
    for _ in range(reps):
        c0, t0 = time.process_time(), time.perf_counter()
        torch.mm(a, b, out=out)
        sync(device)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    flops = 2 * n ** 3
    out = {"dtype": str(dtype).replace("torch.", ""), "n": n, "flops": flops, "reps": reps,
           "threads": torch.get_num_threads() if device.type == "cpu" else None,
           "best_s": min(times), "median_s": statistics.median(times),
           "flop_per_s": flops / min(times), "flop_per_s_median": flops / statistics.median(times)}
    if device.type == "cpu":  # per CPU-second x threads: the peak of an idle machine
        out["flop_per_s_cpu_time"] = flops * torch.get_num_threads() / min(cpu)
    return out


# ---------------------------------------------------------------------------
# the training step (train.py's own)
# ---------------------------------------------------------------------------
class Trainer:
    """Model, AdamW and `train.train_step` of `loopscale train`, on random token batches."""

    def __init__(self, cfg: RunConfig, device: torch.device, compile: bool = False, seed: int = 0,
                 checkpoint: bool = False):
        self.cfg, self.device = cfg, device
        torch.manual_seed(seed)
        self.model, self.opt, self.fwd = build(cfg, device, compile=compile, checkpoint=checkpoint)
        self.model.train()

    def batch(self, batch_size: int | None = None, generator: torch.Generator | None = None):
        B = batch_size or self.cfg.train.batch_size
        V, T = self.cfg.model.vocab_size, self.cfg.model.seq_len
        return tuple(torch.randint(0, V, (B, T), generator=generator).to(self.device)
                     for _ in range(2))

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        if not train_step(self.model, self.fwd, self.opt, x, y, self.cfg, self.device).finite:
            raise FloatingPointError("non-finite loss or gradient in the benchmark step")


def bench_train(cfg: RunConfig, device: torch.device, steps: int, warmup: int, compile: bool = False,
                checkpoint: bool = False) -> dict:
    tr = Trainer(cfg, device, compile, checkpoint=checkpoint)
    g = torch.Generator().manual_seed(1)
    batches = [tr.batch(generator=g) for _ in range(min(steps + warmup, 4))]
    times, cpu_times, faults = [], [], []
    first = None
    for i in range(warmup + steps):
        x, y = batches[i % len(batches)]
        sync(device)
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        c0, t0 = time.process_time(), time.perf_counter()
        tr.step(x, y)
        sync(device)
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        if i == 0:
            first = dt
        if i >= warmup:
            times.append(dt)
            cpu_times.append(dc)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    tokens = cfg.train.batch_size * cfg.model.seq_len
    med = statistics.median(times)
    fl = flop_count(cfg)
    out = {"batch_size": cfg.train.batch_size, "seq_len": cfg.model.seq_len, "batch_tokens": tokens,
           "steps": steps, "warmup": warmup, "compile": compile, "activation_checkpointing": checkpoint,
           "precision": "bf16-autocast" if uses_bf16(device, cfg.train.precision) else "fp32",
           "first_step_s": first, "median_step_s": med, "min_step_s": min(times), "max_step_s": max(times),
           "step_times_s": times, "tokens_per_s": tokens / med,
           "flop_per_s": fl["train_per_token"] * tokens / med, "flops": fl}
    if device.type == "cpu":
        # CPU seconds of this process per step (all threads): on a shared machine the wall
        # clock includes time other processes held the cores; cpu_time / threads does not
        # (with one thread it is the step time of an idle machine)
        cmed = statistics.median(cpu_times)
        share = cmed / (med * torch.get_num_threads())
        out.update(median_step_cpu_s=cmed, step_cpu_times_s=cpu_times, cpu_share=share,
                   contended=share < 0.9,  # other processes held our cores: the wall clock understates
                   flop_per_s_cpu_time=fl["train_per_token"] * tokens * torch.get_num_threads() / cmed,
                   minor_page_faults_per_step=statistics.median(faults))
    return out, tr


@torch.inference_mode()
def bench_eval(cfg: RunConfig, model: torch.nn.Module, device: torch.device, batches: int, warmup: int,
               fwd=None) -> dict:
    """Tokens/s of teacher-forced evaluation at each depth k = 1..K (fp32, dropout off)."""
    fwd = fwd or model
    was_training = model.training
    model.eval()
    B, T, V = cfg.train.eval_batch_size, cfg.model.seq_len, cfg.model.vocab_size
    g = torch.Generator().manual_seed(2)
    data = [(torch.randint(0, V, (B, T), generator=g).to(device), torch.randint(0, V, (B, T), generator=g).to(device))
            for _ in range(min(batches + warmup, 3))]
    rows = []
    try:
        for k in range(1, cfg.model.n_loops + 1):
            times = []
            for i in range(warmup + batches):
                x, y = data[i % len(data)]
                sync(device)
                t0 = time.perf_counter()
                depth_ce(model, x, y, k, fwd)
                sync(device)
                if i >= warmup:
                    times.append(time.perf_counter() - t0)
            med = statistics.median(times)
            fpt = flops_per_token(cfg.model, k, 1)
            rows.append({"k": k, "tokens_per_s": B * T / med, "median_s": med, "min_s": min(times),
                         "forward_flops_per_token": fpt, "flop_per_s": fpt * B * T / med})
    finally:
        model.train(was_training)
    return {"batch_size": B, "seq_len": T, "batches": batches, "warmup": warmup, "precision": "fp32",
            "depth": rows}


# ---------------------------------------------------------------------------
# memory of one training step, in a fresh process
# ---------------------------------------------------------------------------
# glibc: every allocation >= 64 KiB is its own mapping, returned to the OS when freed, so the
# resident set follows the live tensors (the dynamic mmap threshold would otherwise keep freed
# blocks in the heap and blur the measurement)
_MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "131072"}


def _peak_of(fn, device: torch.device) -> dict:
    """Peak memory of running `fn()` above the memory held before it."""
    gc.collect()
    if device.type == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        sync(device)
        peak = torch.cuda.max_memory_allocated(device)
        return {"method": "torch.cuda.max_memory_allocated minus memory_allocated before",
                "base_bytes": base, "peak_bytes": peak, "step_bytes": peak - base, "reliable": True}
    reset = reset_max_rss()
    base, hw0 = current_rss(), max_rss()
    fn()
    hw1 = max_rss()
    return {"method": "peak RSS (VmHWM, reset before) minus the RSS before, fresh process" if reset
            else "ru_maxrss high-water mark of a fresh process minus the RSS before",
            "base_bytes": base, "peak_bytes": hw1, "step_bytes": hw1 - base, "reliable": reset or hw1 > hw0}


def step_memory(cfg: RunConfig, device: torch.device, checkpoint: bool = False) -> dict:
    """Peak memory of one training step of `cfg` above the memory held before it, after a
    one-sequence warm-up step (docs/performance.md, "Memory"; on CPU: see `measure_memory`)."""
    tr = Trainer(cfg, device, compile=False, checkpoint=checkpoint)
    tr.step(*tr.batch(1, torch.Generator().manual_seed(3)))
    x, y = tr.batch(generator=torch.Generator().manual_seed(4))
    out = _peak_of(lambda: tr.step(x, y), device)
    out["model_state_bytes"] = sum(p.numel() * p.element_size() * 4 for p in tr.model.parameters())  # w, g, m, v
    return out


def ce_memory(cfg: RunConfig, device: torch.device) -> dict:
    """Peak memory of the objective alone (forward + backward of all K exits' CE, readout
    norms included) on K random states that are leaves: what the CE implementation costs."""
    tr = Trainer(cfg, device, compile=False)
    m, B = cfg.model, cfg.train.batch_size
    g = torch.Generator().manual_seed(6)

    def run(batch):
        states = [torch.randn(batch, m.seq_len, m.d_model, generator=g).to(device).requires_grad_(True)
                  for _ in range(m.n_loops)]
        y = torch.randint(0, m.vocab_size, (batch, m.seq_len), generator=g).to(device)

        def step():
            with autocast(device, cfg.train.precision):
                res = compute_loss(tr.model, states, y, cfg.objective, all_exits=False)
            res.total.backward()
        return step

    run(1)()  # warm-up
    return _peak_of(run(B), device)


def step_memory_inprocess(cfg: RunConfig, device: torch.device, ce_impl: str | None = None,
                          checkpoint: bool = False) -> dict:
    """`step_memory` in this process (exact on CUDA; on CPU use `measure_memory`)."""
    if ce_impl:
        cfg = RunConfig.from_dict(merge(cfg.to_dict(), {"objective": {"ce_impl": ce_impl}}))
    try:
        return step_memory(cfg, device, checkpoint)
    finally:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _memory_child(payload: dict) -> dict:
    cfg = RunConfig.from_dict(payload["config"])
    device = torch.device(payload["device"])
    if payload.get("threads"):
        torch.set_num_threads(payload["threads"])
    enable_tf32(device)
    if payload.get("what") == "ce":
        return ce_memory(cfg, device)
    return step_memory(cfg, device, payload.get("checkpoint", False))


def measure_memory(cfg: RunConfig, device: torch.device, threads: int | None = None, what: str = "step",
                   checkpoint: bool = False, timeout: float = 1800) -> dict:
    """Peak memory of one training step of `cfg` (what="step") or of its objective alone
    (what="ce"), measured in a fresh Python process."""
    payload = {"config": cfg.to_dict(), "device": str(device), "threads": threads, "what": what,
               "checkpoint": checkpoint}
    env = dict(os.environ, **(_MEMORY_ENV if device.type == "cpu" else {}))
    src = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.run([sys.executable, "-m", "loopscale.bench", "--memory-child"], input=json.dumps(payload),
                          capture_output=True, text=True, env=env, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"memory measurement subprocess failed: {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def memory_comparison(cfg: RunConfig, device: torch.device, threads: int | None = None,
                      checkpoint: bool = False) -> dict:
    """Memory with the chunked CE (as configured) against the plain CE (K full logit tensors
    through F.cross_entropy): of a whole training step, and of the objective alone."""
    out = {"step": {}, "ce": {}}
    for what in ("step", "ce"):
        for impl in ("chunked", "plain"):
            c = RunConfig.from_dict(merge(cfg.to_dict(), {"objective": {"ce_impl": impl}}))
            out[what][impl] = measure_memory(c, device, threads, what, checkpoint)
        out[what]["ratio"] = out[what]["chunked"]["step_bytes"] / max(out[what]["plain"]["step_bytes"], 1)
    out["step"]["ratio_process_peak"] = out["step"]["chunked"]["peak_bytes"] / max(out["step"]["plain"]["peak_bytes"], 1)
    m, n = cfg.model, cfg.train.batch_size * cfg.model.seq_len
    R = m.n_loops if cfg.objective.loss == "per_loop" else 1
    acc = 4  # logits and softmax in fp32
    out["logit_tensor_bytes"] = n * m.vocab_size * acc
    out["plain_saved_logit_bytes"] = R * n * m.vocab_size * acc  # one [n, V] log-softmax per readout kept for backward
    out["chunked_block_bytes"] = min(cfg.objective.ce_chunk_tokens, n) * m.vocab_size * acc
    out["ce_chunk_tokens"] = cfg.objective.ce_chunk_tokens
    out["activation_checkpointing"] = checkpoint
    return out


def profile_step(tr: Trainer, top: int = 25) -> dict:
    """Top operators (self time) of one training step, via torch.profiler."""
    from torch.profiler import ProfilerActivity, profile
    cuda = tr.device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    x, y = tr.batch(generator=torch.Generator().manual_seed(5))
    tr.step(x, y)
    with profile(activities=acts) as prof:
        tr.step(x, y)
        sync(tr.device)
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = prof.key_averages()
    total = sum(getattr(e, attr, 0) for e in events)
    # sorted by self time (older torch: self_cuda_time_total where self_device_time_total is 0)
    fallback = "self_cuda_time_total" if cuda else attr
    ev = sorted(events, key=lambda e: getattr(e, attr, 0) or getattr(e, fallback, 0), reverse=True)
    rows = [{"op": e.key, "calls": e.count, "self_ms": getattr(e, attr, 0) / 1e3,
             "share": getattr(e, attr, 0) / max(total, 1)} for e in ev[:top]]
    return {"total_self_ms": total / 1e3, "top": rows}


# ---------------------------------------------------------------------------
# the whole benchmark
# ---------------------------------------------------------------------------
def run_bench(cfg: RunConfig, *, steps: int = 5, warmup: int = 2, compile: bool = False, eval_batches: int = 5,
              eval_warmup: int = 1, memory: bool = True, do_eval: bool = True, profile: bool = False,
              threads: int | None = None, device: str | None = None, checkpoint: bool = False, log=print) -> dict:
    dev = resolve_device(device or cfg.train.device)
    if (threads or cfg.train.threads) > 0:
        torch.set_num_threads(threads or cfg.train.threads)
    enable_tf32(dev)
    result = {"config": cfg.to_dict(), "params": count_params(cfg.model), "env": environment(dev)}
    peak_dtype = torch.bfloat16 if uses_bf16(dev, cfg.train.precision) else torch.float32
    log(f"[bench] {dev}, {torch.get_num_threads()} threads, {result['params'] / 1e6:.2f}M parameters; "
        f"matmul peak ({peak_dtype}) ...")
    result["peak"] = matmul_peak(dev, peak_dtype)
    log(f"[bench] peak {result['peak']['flop_per_s'] / 1e9:.1f} GFLOP/s; training {warmup}+{steps} steps ...")
    train, tr = bench_train(cfg, dev, steps, warmup, compile, checkpoint)
    # the peak again after the training steps: the MFU uses the better of the two measurements
    peak2 = matmul_peak(dev, peak_dtype)
    result["peak"]["flop_per_s_after"] = peak2["flop_per_s"]
    peak = max(result["peak"]["flop_per_s"], peak2["flop_per_s"])
    result["peak"]["flop_per_s_used"] = peak
    train["mfu"] = train["flop_per_s"] / peak
    if "flop_per_s_cpu_time" in train:
        cpu_peak = max(result["peak"]["flop_per_s_cpu_time"], peak2["flop_per_s_cpu_time"])
        result["peak"]["flop_per_s_cpu_time_used"] = cpu_peak
        train["mfu_cpu_time"] = train["flop_per_s_cpu_time"] / cpu_peak
    result["train"] = train
    log(f"[bench] train {train['tokens_per_s']:.0f} tok/s, {train['flop_per_s'] / 1e9:.1f} GFLOP/s, "
        f"MFU {100 * train['mfu']:.1f}%")
    if profile:
        result["profile"] = profile_step(tr)
    if do_eval:
        result["eval"] = bench_eval(cfg, tr.model, dev, eval_batches, eval_warmup, tr.fwd)
        for r in result["eval"]["depth"]:
            r["mfu"] = r["flop_per_s"] / peak
        log("[bench] eval tok/s by depth: " + ", ".join(f"k={r['k']}: {r['tokens_per_s']:.0f}"
                                                         for r in result["eval"]["depth"]))
    del tr
    gc.collect()
    if memory:
        log("[bench] memory: one training step per CE implementation, each in a fresh process ...")
        result["memory"] = memory_comparison(cfg, dev, threads or (cfg.train.threads or None), checkpoint)
    return result


def _mib(b: float) -> str:
    return f"{b / 2 ** 20:.0f} MiB"


def summary(r: dict) -> str:
    t, p, m = r["train"], r["peak"], r["config"]["model"]
    lines = [
        f"config      d={m['d_model']} layers={m['n_layers']} heads={m['n_heads']} d_ff={m['d_ff']} "
        f"V={m['vocab_size']} T={m['seq_len']} K={m['n_loops']} batch={t['batch_size']} "
        f"loss={r['config']['objective']['loss']} ({r['params'] / 1e6:.2f}M params)",
        f"device      {r['env']['device']} ({r['env'].get('gpu') or r['env']['cpu']}), {r['env']['threads']} threads",
        f"peak        {p['flop_per_s_used'] / 1e9:.1f} GFLOP/s ({p['dtype']} {p['n']}^3 matmul, best of {p['reps']})",
        f"FLOPs       {t['flops']['train_per_token'] / 1e6:.1f} MFLOP/token trained "
        f"(3 x {t['flops']['forward_per_token'] / 1e6:.1f} forward: stack x{t['flops']['loops']} "
        f"{t['flops']['stack_forward_per_token'] / 1e6:.1f} + head x{t['flops']['readouts']} "
        f"{t['flops']['head_forward_per_token'] / 1e6:.1f})",
        f"train       {t['tokens_per_s']:.0f} tok/s, {t['median_step_s']:.3f} s/step (median of {t['steps']}), "
        f"{t['flop_per_s'] / 1e9:.1f} GFLOP/s, MFU {100 * t['mfu']:.1f}% [{t['precision']}"
        f"{', compiled' if t['compile'] else ''}{', activation checkpointing' if t['activation_checkpointing'] else ''}]",
    ]
    if "mfu_cpu_time" in t:
        lines.append(f"  cpu time  {t['median_step_cpu_s']:.3f} CPU-s/step over {r['env']['threads']} threads "
                     f"(got {100 * t['cpu_share']:.0f}% of them; load avg {r['env'].get('load_average_1m', 0):.1f}): "
                     f"{t['flop_per_s_cpu_time'] / 1e9:.1f} GFLOP per thread-second x threads, MFU "
                     f"{100 * t['mfu_cpu_time']:.1f}% of {p['flop_per_s_cpu_time_used'] / 1e9:.1f} on the same basis")
        if t.get("contended"):
            lines.append("  WARNING   other processes held the cores during the timed steps: wall-clock figures "
                         "understate this code; rerun on an idle machine or with --threads 1")
    if "eval" in r:
        lines.append("eval        " + ", ".join(f"k={d['k']}: {d['tokens_per_s']:.0f} tok/s"
                                                for d in r["eval"]["depth"]))
    if "memory" in r:
        st, ce = r["memory"]["step"], r["memory"]["ce"]
        lines.append(f"memory      training step: chunked {_mib(st['chunked']['step_bytes'])} vs plain "
                     f"{_mib(st['plain']['step_bytes'])} (ratio {st['ratio']:.2f}; process peak "
                     f"{_mib(st['chunked']['peak_bytes'])} vs {_mib(st['plain']['peak_bytes'])})")
        lines.append(f"            per-loop CE alone: chunked {_mib(ce['chunked']['step_bytes'])} vs plain "
                     f"{_mib(ce['plain']['step_bytes'])} (ratio {ce['ratio']:.2f})")
    if "profile" in r:
        lines.append("profile     top ops by self time:")
        for o in r["profile"]["top"][:15]:
            lines.append(f"              {o['op'][:48]:48s} {o['self_ms']:9.1f} ms {100 * o['share']:5.1f}%  x{o['calls']}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# the memory measurement's subprocess: python -m loopscale.bench --memory-child
# (the command is loopscale.cli.bench)
# ---------------------------------------------------------------------------
if __name__ == "__main__":
    if sys.argv[1:] != ["--memory-child"]:
        sys.exit("python -m loopscale.bench only runs the memory measurement's subprocess; "
                 "the benchmark is `loopscale bench`")
    print(json.dumps(_memory_child(json.loads(sys.stdin.read()))))
