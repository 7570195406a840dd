"""Shared by the report tests (test_report, test_report_metrics, test_claims_rules): synthetic
run directories and the per-condition statistics the claims' rules read. A helper module, not a test file."""
from __future__ import annotations

import json
import math
from pathlib import Path

from loopscale.config import preset
from loopscale.report.claims import CondStats
from loopscale.report.runs import find_run_dirs
from loopscale.report.runs import load_runs

D, K = 32, 3  # d_model and loops of the synthetic runs


def make_run(root: Path, readout="rmsnorm", loss="per_loop", regularizer="none", recurrence="residual", seed=42,
             status="completed", exit_ppl=(30.0, 20.0, 10.0), norm_k=(5.0, 8.0, 12.0), radial=None, clamp_dce=None,
             diags=("depth", "throughput", "norms", "radial", "lemma", "clamp", "halting", "scale"), config_json=True,
             summary=True, diverged_at=17) -> Path:
    cfg = preset("smoke", {"model": {"readout": readout, "recurrence": recurrence},
                           "objective": {"loss": loss, "regularizer": regularizer},
                           "train": {"seed": seed}}).to_dict()
    d = root / f"{readout}-{loss}-{regularizer}-{recurrence}" / f"seed{seed}"
    d.mkdir(parents=True)
    env = {"loopscale": "0.1.0", "git_commit": "abc123", "torch": "2.13.0", "python": "3.12", "platform": "test",
           "device": "cpu", "cpu_threads": 1}
    if config_json:
        (d / "config.json").write_text(json.dumps({"config": cfg, "env": env, "data": {"vocab_size": 2048}}))
    else:
        import yaml
        (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    ces = [math.log(p) for p in exit_ppl]
    metrics = [{"step": s, "tokens": s * 256, "loss": 5.0, "ce": ces, "norm": [n * s / 30 for n in norm_k],
                "penalty": 0.0, "grad_norm": 1.0, "lr": 1e-3, "tok_per_s": 1000.0, "elapsed": s / 10}
               for s in (10, 20, 30)]
    if status == "completed":
        metrics.append({"step": 30, "split": "validation", "tokens": 2048, "val_ce": ces, "val_norm": list(norm_k)})
    (d / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    if summary:
        s = {"status": status, "steps": 30, "total_steps": 30, "tokens": 7680, "params": 70000, "wall_time_s": 12.5,
             "device": "cpu"}
        if status == "completed":
            s["validation"] = {"step": 30, "tokens": 2048, "val_ce": ces, "val_norm": list(norm_k)}
        elif status == "diverged":
            s.update(steps=diverged_at - 1, diverged_at_step=diverged_at, last_finite=metrics[0])
        else:
            s["error"] = "RuntimeError: boom"
        (d / "summary.json").write_text(json.dumps(s))
    if status == "diverged":  # the diagnostics of a diverged model only write their header
        (d / "eval").mkdir()
        for name in diags:
            (d / "eval" / f"{name}.json").write_text(json.dumps({"diagnostic": name, "status": "diverged",
                                                                 "seed": seed}))
    if status != "completed":
        return d
    hdr = {"status": "ok", "seed": seed, "wall_time_s": 1.0,
           "condition": {"readout": readout, "loss": loss, "regularizer": regularizer, "recurrence": recurrence}}
    rows = [{"k": k + 1, "ce": ces[k], "ppl": exit_ppl[k], "norm": norm_k[k]} for k in range(K)]
    deep = rows + [{"k": k, "ce": ces[-1] + 0.1 * (k - K), "ppl": math.exp(ces[-1] + 0.1 * (k - K)),
                    "norm": norm_k[-1] * k / K} for k in range(K + 1, 3 * K + 1)]
    radial = radial if radial is not None else ([1e-12] * K if readout in ("rmsnorm", "layernorm") else [1e-2] * K)
    clamp_dce = clamp_dce if clamp_dce is not None else {"remove_radial": 0.001, "freeze_loop1": 0.002}
    alphas = (0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)
    slope = 0.0 if readout in ("rmsnorm", "layernorm", "final_norm") else 0.5  # raw final readout: CE rises with |log alpha|
    payloads = {
        "scale": {"alphas": list(alphas), "sweep": [
            {"alpha": a, "ce": ces[-1] + slope * abs(math.log(a)), "ppl": math.exp(ces[-1] + slope * abs(math.log(a))),
             "delta_ce": slope * abs(math.log(a))} for a in alphas]},
        "depth": {"k_train": K, "exits": rows, "depth": deep},
        "throughput": {"depth": [{"k": k, "tokens_per_s": 9000.0 / k} for k in range(1, 3 * K + 1)]},
        "norms": {"loops": [{"k": k + 1, "norm": norm_k[k], "mean": norm_k[k]} for k in range(K)],
                  "final": {"k": K, "mean": norm_k[-1], "median": norm_k[-1] * 0.9, "p99": norm_k[-1] * 2,
                            "max": norm_k[-1] * 3, "std": 1.0, "min": 0.5, "p99_over_median": 2.2},
                  "histogram": {"edges": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0], "counts": [1, 5, 20, 10, 2]}},
        "radial": {"loops": [{"k": k + 1, "readout": readout, "radial_fraction": radial[k], "mean_cos": 0.0}
                             for k in range(K)]},
        "lemma": {"loops": [{"k": k, "scale": 2.0 * k, **({"radial_increment": 2.0, "relative_increment": 1 / k,
                                                           "angular_update": 0.5 / k, "angular_times_scale": 1.0}
                                                          if k < 8 else {})} for k in range(1, 9)]},
        "clamp": {"modes": {m: [{"k": k + 1, "ce": ces[k] + dv, "ppl": math.exp(ces[k] + dv), "norm": 3.0,
                                 "delta_ce": dv, "rel_ppl": math.exp(dv)} for k in range(K)]
                            for m, dv in {"none": 0.0, **clamp_dce}.items()}},
        "halting": {"policies": {f"{p}/{g}": {"policy": p, "granularity": g, "threshold": 0.5, "early_exit": True,
                                              "calib": {"mean_loops": 2.0, "ppl": 10.05, "ppl_full": 10.0,
                                                        "ppl_ratio": 1.005, "meets_target": True},
                                              "test": {"mean_loops": 2.1, "ppl": 10.2, "ppl_full": 10.1,
                                                       "ppl_ratio": 1.01, "meets_target": True}}
                                 for p in ("max_prob", "margin", "entropy") for g in ("sequence", "token")},
                    "dynamic": {"full_depth": {"time_s": 1.0}, "max_prob": {"speedup": 1.3, "mean_loops": 2.2},
                                "margin": {"speedup": 1.2, "mean_loops": 2.4},
                                "entropy": {"speedup": 1.1, "mean_loops": 2.6}}},
    }
    (d / "eval").mkdir()
    for name in diags:
        (d / "eval" / f"{name}.json").write_text(json.dumps({"diagnostic": name, **hdr, **payloads[name]}))
    return d


def make_grid(root: Path) -> Path:
    """A small grid: 2 seeds of the drifting and the raw model, 1 diverged and 1 failed seed,
    one run without any eval file, and an inter-loop run."""
    make_run(root, seed=1, exit_ppl=(10.0, 10.0, 10.0), norm_k=(50.0, 300.0, 1000.0))
    make_run(root, seed=2, exit_ppl=(12.0, 12.0, 12.0), norm_k=(50.0, 300.0, 1400.0))
    make_run(root, seed=3, status="diverged", diverged_at=17)
    make_run(root, seed=4, status="failed", summary=False)
    make_run(root, readout="raw", seed=1, exit_ppl=(30.0, 12.0, 8.0), norm_k=(5.0, 8.0, 12.0))
    make_run(root, readout="raw", seed=2, exit_ppl=(30.0, 12.0, 8.0), norm_k=(5.0, 8.0, 12.0), diags=())
    make_run(root, recurrence="inter_loop_norm", seed=1, exit_ppl=(20.0, 11.0, 9.0), norm_k=(6.0, 7.0, 8.0))
    return root


def runs_of(root: Path):
    return load_runs(find_run_dirs([str(root)]))


def cs(cond, norm=10.0, ppl=(20.0, 15.0, 12.0), radial=(), clamp=None, n=2, d_model=64):
    ce = math.log(ppl[-1])
    return CondStats(cond=cond, n=n, n_runs=max(n, 1), d_model=d_model, K=len(ppl), runs_text=f"{n} completed",
                     norm_K=norm, ppl_K=ppl[-1], ce_K=ce, exit_ppl=list(ppl), radial=list(radial),
                     clamp_dce=dict(clamp or {}))


def verdict(fn, *stats_):
    return fn({s.cond: s for s in stats_}).verdict


def cs_exits(cond, ppl, norms, growth=float("nan"), d_model=64, n=2):
    s = cs(cond, norm=norms[-1], ppl=ppl, n=n, d_model=d_model)
    s.exit_norm = list(norms)
    s.accumulation = norms[-1] / norms[0]
    s.growth = growth
    return s
