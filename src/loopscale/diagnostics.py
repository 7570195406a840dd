"""Evaluation and diagnostics of one trained run: depth, throughput, norms, radial, lemma,
clamp, scale (halting: halting.py), each written as one JSON file by `run_diagnostic` /
`run_all` (`loopscale eval`). Definitions and payloads: docs/diagnostics.md.
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch
from tqdm.auto import tqdm

from . import data as D
from .config import ConfigError, EvalConfig
from .evaluate import EvalRun, batches, depth_ce, exit_losses, header, open_run, windows
from .halting import halting
from .io import atomic_write_json
from .linear_ce import linear_cross_entropy
from .model import LoopedLM, flops_per_token
from .registry import DIAGNOSTICS as _REGISTRY, READOUTS
from .runtime import ppl, sync

DIAGNOSTICS = tuple(_REGISTRY)
OFFICIAL_CLAMP_MODES = ("remove_radial", "freeze_loop1")  # the release's radial_clamp_intervention.py
CLAMP_MODES = ("none", *OFFICIAL_CLAMP_MODES, "remove_radial_from_embedding")
SCALE_ALPHAS = (0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)  # the release's scale_sensitivity.py
_TINY = 1e-30  # guards divisions by a zero norm (never hit by real states)
_RMS_FLOOR = 1e-8  # per-token RMS floor of the official clamp script
_RMS_FLOOR_LEMMA = 1e-9  # ... and of the official lemma2_verification.py


def token_norms(h: torch.Tensor) -> torch.Tensor:
    """Per-token L2 norm over channels, float64, flattened over batch and positions."""
    return h.detach().double().norm(dim=-1).reshape(-1)


def depth(run: EvalRun) -> tuple[dict, int]:
    """Exits of a full K-loop pass, and every depth k=1..depth_factor·K read with the final
    readout, all from one pass where the exits' readout is the final one (docs/diagnostics.md)."""
    e, K, model = run.ecfg, run.K, run.model
    kmax = e.depth_factor * K
    deep = exit_losses(model, run.tokens, e.batch_size, e.max_tokens, n_loops=kmax, device=run.device,
                       final_readout_only=True)
    if READOUTS[run.cfg.model.readout].exits_differ:
        ex = exit_losses(model, run.tokens, e.batch_size, e.max_tokens, n_loops=K, device=run.device)
    else:
        ex = {key: v[:K] if isinstance(v, list) else v for key, v in deep.items()}

    def rows(r, n):
        return [{"k": k + 1, "ce": r["ce"][k], "ppl": r["ppl"][k], "norm": r["norm"][k]} for k in range(n)]
    return {"k_train": K, "depth_factor": e.depth_factor, "exits": rows(ex, K), "depth": rows(deep, kmax)}, deep["tokens"]


@torch.inference_mode()
def throughput(run: EvalRun) -> tuple[dict, int]:
    """Tokens/s of teacher-forced evaluation running exactly k loops + one final readout (CE),
    median of the timed pre-loaded batches (docs/diagnostics.md, "throughput")."""
    e, model, dev = run.ecfg, run.model, run.device
    starts = windows(run, 0)
    n = e.throughput_warmup + e.throughput_batches
    bs = min(e.batch_size, len(starts))
    cpu = [D.get_batch(run.tokens, starts[(np.arange(bs) + i * bs) % len(starts)], run.seq_len)
           for i in range(n)]  # cycling through the validation windows
    data = [(x.to(dev), y.to(dev)) for x, y in cpu]
    kmax = e.depth_factor * run.K
    rows = []
    for k in tqdm(range(1, kmax + 1), desc="throughput", disable=not run.progress, leave=False):
        times = []
        for i, (x, y) in enumerate(data):
            sync(dev)
            t0 = time.perf_counter()
            depth_ce(model, x, y, k)
            sync(dev)
            if i >= e.throughput_warmup:
                times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        rows.append({"k": k, "tokens_per_s": bs * run.seq_len / med, "median_s": med, "min_s": min(times),
                     "max_s": max(times), "flops_per_token": flops_per_token(run.cfg.model, k, 1)})
    payload = {"k_train": run.K, "batch_size": bs, "seq_len": run.seq_len, "batch_tokens": bs * run.seq_len,
               "warmup_batches": e.throughput_warmup, "timed_batches": e.throughput_batches,
               "threads": torch.get_num_threads(),
               "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
               "depth": rows}
    return payload, bs * run.seq_len * e.throughput_batches  # timed tokens per depth


# ---------------------------------------------------------------------------
# norms
# ---------------------------------------------------------------------------
def distribution(x: np.ndarray) -> dict:
    """Summary of a per-token distribution (float64 input)."""
    med = float(np.median(x))
    p99 = float(np.percentile(x, 99))
    return {"mean": float(x.mean()), "median": med, "p99": p99, "max": float(x.max()),
            "std": float(x.std()), "min": float(x.min()), "p99_over_median": p99 / med if med > 0 else None}


def log_histogram(x: np.ndarray, bins: int = 60) -> dict:
    """Histogram with log-spaced bin edges spanning the positive values of x."""
    pos = x[x > 0]
    lo, hi = (float(pos.min()), float(pos.max())) if len(pos) else (1.0, 1.0)
    if hi <= lo:
        lo, hi = lo / 1.01, hi * 1.01
    edges = np.geomspace(lo, hi, bins + 1)
    counts, _ = np.histogram(pos, bins=edges)
    return {"edges": edges.tolist(), "counts": counts.tolist(), "spacing": "log", "nonpositive": int((x <= 0).sum())}


@torch.inference_mode()
def norms(run: EvalRun) -> tuple[dict, int]:
    """Per loop k: ‖H_k‖ (mean per-token L2 norm) and its distribution; per-token ‖H_K‖ distribution."""
    per_loop = [[] for _ in range(run.K)]
    for x, _ in batches(run, windows(run, run.ecfg.norm_tokens), "norms"):
        for k, h in enumerate(run.model(x)):
            per_loop[k].append(token_norms(h).cpu())
    arrs = [torch.cat(p).numpy() for p in per_loop]
    loops = [{"k": k + 1, "norm": float(a.mean()), **distribution(a)} for k, a in enumerate(arrs)]
    final = arrs[-1]
    payload = {"k_train": run.K, "norm_by_loop": [r["norm"] for r in loops], "loops": loops,
               "final": {"k": run.K, "n_tokens": int(len(final)), **distribution(final)}, "histogram": {"k": run.K, **log_histogram(final)}}
    return payload, len(final)


# ---------------------------------------------------------------------------
# radial gradient fraction
# ---------------------------------------------------------------------------
def radial_stats(model: LoopedLM, h: torch.Tensor, y: torch.Tensor, final: bool,
                 k: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token cos(g, H) and cos²(g, H) (float64) for g = ∂CE/∂H of one exit's immediate loss.

    H is detached into a leaf; the sum-reduced CE makes g per token."""
    with torch.enable_grad():
        leaf = h.detach().requires_grad_(True)
        ce = linear_cross_entropy(model.readout(leaf, final, k=k), model.head_weight.detach(), y) * y.numel()
        (g,) = torch.autograd.grad(ce, leaf)
    g64 = g.double().reshape(-1, g.shape[-1])
    h64 = leaf.detach().double().reshape(-1, g.shape[-1])
    dot = (g64 * h64).sum(-1)
    denom = g64.norm(dim=-1) * h64.norm(dim=-1)
    cos = dot / denom.clamp_min(_TINY)
    return cos, cos * cos


def radial(run: EvalRun) -> tuple[dict, int]:
    """Radial gradient fraction per exit k: mean_t cos²(∂CE_k/∂H_k, H_k), and the signed mean cosine."""
    K, model = run.K, run.model
    sums = torch.zeros(3, K, dtype=torch.float64)  # rows: cos, cos², |cos|
    n = 0
    for x, y in batches(run, windows(run, run.ecfg.radial_tokens), "radial"):
        with torch.no_grad():
            states = model(x)
        for k, h in enumerate(states):
            cos, cos2 = radial_stats(model, h, y, final=k == K - 1, k=k + 1)
            sums[:, k] += torch.stack([cos.sum(), cos2.sum(), cos.abs().sum()]).cpu()
        n += y.numel()

    spec = READOUTS[run.cfg.model.readout]
    mean_cos, frac, mean_abs = (sums / n).tolist()
    loops = [{"k": k + 1, "readout": spec.norm_at(k + 1, K), "radial_fraction": frac[k],
              "mean_cos": mean_cos[k], "mean_abs_cos": mean_abs[k]} for k in range(K)]
    return {"k_train": K, "loops": loops}, n


@torch.inference_mode()
def lemma(run: EvalRun) -> tuple[dict, int]:
    """The activity lemma (paper Lemma 2) over `lemma_loops` loops, per token, in L2 units
    (`loops`: s_k = ‖H_k‖) and in the paper's (`paper_units`, Table 12: s_k = RMS(H_k), as the
    release's lemma2_verification.py); H_k is the state after loop k, before the recurrence.
    Definitions: docs/diagnostics.md, "lemma"."""
    L = run.ecfg.lemma_loops
    # rows: s, radial increment, relative increment, angular update, angular x s (transitions: 0..L-2)
    l2 = torch.zeros(5, L, dtype=torch.float64)
    paper = torch.zeros(4, L, dtype=torch.float64)  # rows: s (RMS), radial increment, angular step, b_perp
    n = 0
    for x, _ in batches(run, windows(run, run.ecfg.lemma_tokens), "lemma"):
        states = run.model(x, n_loops=L)
        prev = None
        for k, h in enumerate(states):
            h64 = h.double().reshape(-1, h.shape[-1])
            s = h64.norm(dim=-1)
            u = h64 / s.clamp_min(_TINY)[:, None]
            r = h64.pow(2).mean(-1).sqrt().clamp_min(_RMS_FLOOR_LEMMA)  # paper units
            v = h64 / r[:, None]
            l2[0, k] += s.sum().cpu()
            paper[0, k] += r.sum().cpu()
            if prev is not None:
                prev_h, prev_s, prev_u, prev_r, prev_v = prev
                ang, step = (u - prev_u).norm(dim=-1), (v - prev_v).norm(dim=-1)
                l2[1:, k - 1] += torch.stack([(s - prev_s).sum(), ((s - prev_s) / prev_s.clamp_min(_TINY)).sum(),
                                              ang.sum(), (ang * prev_s).sum()]).cpu()
                paper[1:, k - 1] += torch.stack([(prev_v * (h64 - prev_h)).sum(-1).sum(), step.sum(),
                                                 (step * prev_r).sum()]).cpu()
            prev = (h64, s, u, r, v)
        n += x.numel()
    loops, paper_loops = [], []
    l2, paper = (l2 / n).tolist(), (paper / n).tolist()
    for k in range(L):
        row = {"k": k + 1, "scale": l2[0][k]}
        prow = {"k": k + 1, "s": paper[0][k]}
        if k < L - 1:  # transition k -> k+1
            row.update(radial_increment=l2[1][k], relative_increment=l2[2][k], angular_update=l2[3][k],
                       angular_times_scale=l2[4][k])
            prow.update(radial_increment=paper[1][k], angular_step=paper[2][k], b_perp_estimate=paper[3][k])
        loops.append(row)
        paper_loops.append(prow)
    prod = np.array([r["angular_times_scale"] for r in loops[:-1]])
    tail = prod[1:] if len(prod) > 1 else prod  # loop 1->2 leaves the embedding regime
    summary = {"angular_times_scale_first": float(prod[0]), "angular_times_scale_last": float(prod[-1]),
               "angular_times_scale_cv": float(tail.std() / tail.mean()) if tail.mean() != 0 else None,
               "angular_update_first": loops[0]["angular_update"], "angular_update_last": loops[-2]["angular_update"],
               "scale_first": loops[0]["scale"], "scale_last": loops[-1]["scale"]}
    return {"k_train": run.K, "n_loops": L, "loops": loops, "summary": summary,
            "paper_units": {"loops": paper_loops}}, n


# ---------------------------------------------------------------------------
# scale clamps
# ---------------------------------------------------------------------------
def token_rms(h: torch.Tensor) -> torch.Tensor:
    """Per-token RMS over channels, [.., 1], fp32, floored at 1e-8 (the official clamp script's)."""
    return h.float().pow(2).mean(-1, keepdim=True).sqrt().clamp_min(_RMS_FLOOR)


def clamp_fn(mode: str) -> Optional[Callable]:
    """The `state_fn(k, x_in, h)` of LoopedLM.forward implementing an inference-time clamp:
    the official remove_radial and freeze_loop1 (the release's radial_clamp_intervention.py,
    claim (g)) and loopscale's remove_radial_from_embedding; defined in docs/diagnostics.md,
    "clamp". The closures keep the previous state of the current pass (reset at k = 1)."""
    if mode == "none":
        return None
    prev: dict = {}
    if mode == "remove_radial":
        def remove_radial(k, x_in, h):
            if k > 1:
                p = prev["h"].float()
                u = p / token_rms(p)
                a = (u * (h.float() - p)).mean(-1, keepdim=True)  # first-order radial increment (RMS units)
                h = (h.float() - a * u).to(h.dtype)
            prev["h"] = h
            return h
        return remove_radial
    if mode == "freeze_loop1":
        def freeze_loop1(k, x_in, h):
            if k == 1:
                prev["rms"] = token_rms(h)
                return h
            return (h.float() * (prev["rms"] / token_rms(h))).to(h.dtype)
        return freeze_loop1
    if mode == "remove_radial_from_embedding":
        def remove_radial_from_embedding(k, x_in, h):
            d = h - x_in
            u = x_in / x_in.norm(dim=-1, keepdim=True).clamp_min(_TINY)
            return x_in + d - (d * u).sum(-1, keepdim=True) * u
        return remove_radial_from_embedding
    raise ValueError(f"unknown clamp mode {mode!r}; choose one of {', '.join(CLAMP_MODES)}")


def _recording(fn: Optional[Callable], log: dict) -> Callable:
    """Wrap a clamp so the update actually applied at each loop is measured (float64, per
    token) against the loop's input x_in: its radial part <Δ, x̂_in>, |radial| and ‖Δ‖."""
    def state_fn(k, x_in, h):
        if fn is not None:
            h = fn(k, x_in, h)
        x64, h64 = x_in.double(), h.double()
        u = x64 / x64.norm(dim=-1, keepdim=True).clamp_min(_TINY)
        d = h64 - x64
        radial = (d * u).sum(-1)
        log.setdefault(k, torch.zeros(3, dtype=torch.float64))
        log[k] += torch.stack([radial.sum(), radial.abs().sum(), d.norm(dim=-1).sum()]).cpu()
        return h
    return state_fn


@torch.inference_mode()
def clamp(run: EvalRun) -> tuple[dict, int]:
    """Per loop CE/PPL/‖H_k‖/RMS(H_k) of a full K-loop pass under each clamp, with ΔCE and PPL
    ratio vs none at the same exit; per mode a summary at exit K like the official
    radial_clamp_summary.csv (ΔCE, PPL ratio and ‖H_K‖ ratio vs none)."""
    K, model = run.K, run.model
    starts = windows(run, run.ecfg.clamp_tokens)
    modes = {}
    for mode in CLAMP_MODES:
        sums = torch.zeros(3, K, dtype=torch.float64)  # rows: token sums of CE, ‖H_k‖, RMS(H_k)
        log: dict = {}
        n = 0
        for x, y in batches(run, starts, f"clamp {mode}"):
            states = model(x, state_fn=_recording(clamp_fn(mode), log))
            for k, h in enumerate(states):
                ce = linear_cross_entropy(model.readout(h, k == K - 1, k=k + 1), model.head_weight, y)
                sums[:, k] += torch.stack([ce.double() * y.numel(), token_norms(h).sum(),
                                           token_rms(h).double().sum()]).cpu()
            n += y.numel()
        ces, nrm, rms = (sums / n).tolist()
        modes[mode] = [{"k": k + 1, "ce": ces[k], "ppl": ppl(ces[k]), "norm": nrm[k], "norm_rms": rms[k],
                        **dict(zip(("radial_update", "abs_radial_update", "update_norm"),
                                   (log[k + 1] / n).tolist()))} for k in range(K)]
    summary = {}
    for mode in CLAMP_MODES:
        for row, base in zip(modes[mode], modes["none"]):
            row["delta_ce"] = row["ce"] - base["ce"]
            row["rel_ppl"] = row["ppl"] / base["ppl"] if base["ppl"] not in (0.0, float("inf")) else None
        first, last, base = modes[mode][0], modes[mode][-1], modes["none"][-1]
        summary[mode] = {"ce_K1": first["ce"], "ce_K": last["ce"], "ppl_K1": first["ppl"], "ppl_K": last["ppl"],
                         "norm_K1": first["norm"], "norm_K": last["norm"], "delta_ce_vs_none": last["delta_ce"],
                         "rel_ppl_vs_none": last["rel_ppl"],
                         "norm_ratio_vs_none": last["norm"] / max(base["norm"], 1e-12)}
    return {"k_train": K, "official_modes": list(OFFICIAL_CLAMP_MODES), "modes": modes, "summary": summary}, n


@torch.inference_mode()
def scale(run: EvalRun) -> tuple[dict, int]:
    """CE/PPL of the final readout of α·H_K (before any normalisation) for every α of
    SCALE_ALPHAS (the official scale_sensitivity.py); ΔCE relative to α = 1 (docs/diagnostics.md)."""
    K, model = run.K, run.model
    ce_sum = torch.zeros(len(SCALE_ALPHAS), dtype=torch.float64)
    n = 0
    for x, y in batches(run, windows(run, run.ecfg.scale_tokens), "scale"):
        h = model(x)[-1]
        for i, a in enumerate(SCALE_ALPHAS):
            ce = linear_cross_entropy(model.readout(h * a, final=True), model.head_weight, y)
            ce_sum[i] += ce.double().cpu() * y.numel()
        n += y.numel()
    ces = (ce_sum / n).tolist()
    base = ces[SCALE_ALPHAS.index(1.0)]
    rows = [{"alpha": a, "ce": c, "ppl": ppl(c), "delta_ce": c - base} for a, c in zip(SCALE_ALPHAS, ces)]
    summary = {"ce_alpha1": base, "ce_min": min(ces), "ce_max": max(ces), "ce_range": max(ces) - min(ces),
               "max_abs_delta_ce": max(abs(r["delta_ce"]) for r in rows)}
    return {"k_train": K, "alphas": list(SCALE_ALPHAS), "sweep": rows, "summary": summary}, n


# ---------------------------------------------------------------------------
# running diagnostics
# ---------------------------------------------------------------------------
RUNNERS: dict[str, Callable[[EvalRun], tuple[dict, int]]] = {
    "depth": depth, "throughput": throughput, "norms": norms, "radial": radial, "lemma": lemma,
    "clamp": clamp, "halting": halting, "scale": scale}


def evaluate_diagnostic(name: str, run: EvalRun) -> dict:
    """The result dict of one diagnostic (header + payload); a diverged model is not evaluated."""
    _check_names([name])
    if run.status == "diverged":
        return {**header(name, run, 0), "note": "the model diverged in training; nothing was evaluated"}
    t0 = time.time()
    payload, tokens = RUNNERS[name](run)
    return {**header(name, run, tokens), "wall_time_s": time.time() - t0, **payload}


def failed_training(model_path) -> Optional[dict]:
    """The run's summary.json (beside `model_path`) when it says training failed, else None.

    A failed run (`loopscale train --record-failure`) has no weights to evaluate: its
    diagnostics are written as status "failed" without opening the model file."""
    try:
        summary = json.loads((Path(model_path).parent / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) and summary.get("status") == "failed" else None


def failed_result(name: str, summary: dict) -> dict:
    """The result file of diagnostic `name` for a run whose training failed."""
    return {"diagnostic": name, "status": "failed", "tokens": 0, "note": "training failed; nothing was evaluated",
            "error": summary.get("error")}


def _check_names(names) -> None:
    unknown = [n for n in names if n not in RUNNERS]
    if unknown or not names:
        raise ConfigError(f"unknown diagnostic {(unknown or [''])[0]!r}; choose one of {', '.join(DIAGNOSTICS)}")


def run_diagnostic(name: str, model_path, data_dir, out=None, overrides: Optional[list[str]] = None,
                   device: Optional[str] = None, progress: bool = True,
                   eval_config: Optional[EvalConfig] = None) -> dict:
    """Open a run, evaluate one diagnostic, write `out` (atomic JSON) if given; return the result."""
    return run_all(model_path, data_dir, None, overrides, device, progress, (name,), {name: out}, eval_config)[name]


def run_all(model_path, data_dir, outdir, overrides: Optional[list[str]] = None, device: Optional[str] = None,
            progress: bool = True, names=DIAGNOSTICS, outs: Optional[dict] = None,
            eval_config: Optional[EvalConfig] = None) -> dict[str, dict]:
    """The diagnostics `names` on one run, the model loaded once, with the evaluation settings
    `eval_config` (default: EvalConfig()) + `overrides`; writes `outdir/<diagnostic>.json`
    (or `outs[name]` when given; neither: nothing written). A run whose training failed gets
    status "failed" results, a diverged one "diverged", without evaluating."""
    _check_names(names)
    if outs is None:
        outs = {n: Path(outdir) / f"{n}.json" for n in names} if outdir is not None else {}
    summary = failed_training(model_path)
    run = None if summary else open_run(model_path, data_dir, overrides, device, progress, eval_config)
    results = {}
    for name in names:
        results[name] = failed_result(name, summary) if summary else evaluate_diagnostic(name, run)
        if outs.get(name) is not None:
            atomic_write_json(outs[name], results[name])
    return results
