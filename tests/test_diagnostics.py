"""Evaluation and diagnostics: definitions, invariants, CLI errors and timings.

Models are `smoke`-shaped (trained a few dozen steps by train.train, or untrained where the
property does not need training) on a tiny synthetic corpus prepared in a temp dir. The
module runs torch single-threaded: these models are tiny, and on a busy machine extra
threads only add synchronisation stalls (results do not depend on the thread count)."""
import os

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import json
import math
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from loopscale import cli
from loopscale import data as D
from loopscale import diagnostics as G
from loopscale import evaluate as E
from loopscale import halting as Hl
from loopscale.config import DataConfig, eval_preset, preset
from loopscale.evaluate import exit_losses
from loopscale.io import atomic_torch_save
from loopscale.model import LoopedLM
from loopscale.train import train


# ---------------------------------------------------------------- fixtures
def _corpus(n_words: int, vocab: int, seed: int) -> str:
    """A synthetic language: a sparse Markov chain over made-up words, in sentences and lines."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    words = sorted({"".join(rng.choice(letters, rng.integers(2, 8))) for _ in range(vocab * 2)})[:vocab]
    succ = rng.integers(0, len(words), (len(words), 4))
    out, w, line = [], 0, []
    for i in range(n_words):
        w = succ[w, rng.integers(0, 4)] if rng.random() < 0.9 else rng.integers(0, len(words))
        line.append(words[w])
        if rng.random() < 0.08:
            line.append(rng.choice([".", ",", "!"]))
        if len(line) > 20 and rng.random() < 0.1:
            out.append(" ".join(line))
            line = []
    out.append(" ".join(line))
    return "\n".join(out) + "\n"


def _prepare(root: Path, name: str, vocab: int, seed: int, val_words: int = 6000, train_words: int = 30000) -> Path:
    src = root / f"{name}-src"
    src.mkdir()
    (src / "train.txt").write_text(_corpus(train_words, vocab, seed))
    (src / "valid.txt").write_text(_corpus(val_words, vocab, seed + 1000))
    out = root / name
    D.prepare_data(DataConfig(source="text-files", train_file=str(src / "train.txt"),
                              validation_file=str(src / "valid.txt"), vocab_size=2048, min_frequency=1),
                   out, show_progress=False)
    return out


def _smoke(**model):
    return preset("smoke", {"model": model})


def _save_untrained(path: Path, cfg, status="completed", seed=0) -> Path:
    torch.manual_seed(seed)
    model = LoopedLM(cfg.model)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_torch_save(path, {"model": model.state_dict(), "config": cfg.to_dict(), "step": 0, "status": status})
    return path


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="session")
def env(tmp_path_factory):
    n_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _make_env(tmp_path_factory)
    finally:
        torch.set_num_threads(n_threads)


def _make_env(tmp_path_factory):
    root = tmp_path_factory.mktemp("diag")
    data = _prepare(root, "data", vocab=300, seed=0)
    other = _prepare(root, "other", vocab=120, seed=7, val_words=2000, train_words=5000)
    small = _prepare(root, "small", vocab=300, seed=0, val_words=1200, train_words=3000)
    runs = {}
    t0 = time.time()
    for name, model in {"rmsnorm": {}, "raw": {"readout": "raw"}}.items():
        cfg = _smoke(**model)
        summary = train(cfg, data, root / name, progress=False)
        runs[name] = {"model": root / name / "model.pt", "summary": summary, "cfg": cfg}
    for name, model in {"layernorm": {"readout": "layernorm"}, "final_norm": {"readout": "final_norm"},
                        "inter_loop_norm": {"recurrence": "inter_loop_norm"}}.items():
        cfg = _smoke(**model)
        runs[name] = {"model": _save_untrained(root / name / "model.pt", cfg), "cfg": cfg}
    runs["diverged"] = {"model": _save_untrained(root / "diverged" / "model.pt", _smoke(), status="diverged")}
    trunc = root / "truncated" / "model.pt"
    trunc.parent.mkdir()
    blob = runs["rmsnorm"]["model"].read_bytes()
    trunc.write_bytes(blob[: len(blob) // 2])
    print(f"\nfixture: data + 2 trained smoke runs in {time.time() - t0:.1f}s")
    return {"root": root, "data": data, "other": other, "small": small, "runs": runs, "truncated": trunc}


def _open(env, name, *overrides):
    return E.open_run(env["runs"][name]["model"], env["data"], list(overrides), "cpu", progress=False,
                      eval_config=eval_preset("smoke"))


# ---------------------------------------------------------------- depth
def test_depth_at_K_equals_training_validation(env):
    run = env["runs"]["rmsnorm"]
    summary = run["summary"]
    cfg = run["cfg"]
    assert summary["status"] == "completed"
    val = summary["validation"]
    out = env["root"] / "out" / "depth.json"
    rc = cli.main(["eval", "depth", "--model", str(run["model"]), "--data", str(env["data"]), "--out", str(out),
                   "--preset", "smoke", "--set", f"eval.max_tokens={cfg.train.eval_tokens}", "--device", "cpu", "-q"])
    assert rc == 0
    res = json.loads(out.read_text())
    K = cfg.model.n_loops
    assert res["status"] == "ok" and res["diagnostic"] == "depth" and res["tokens"] == val["tokens"]
    assert res["condition"] == {"readout": "rmsnorm", "loss": "per_loop", "regularizer": "none",
                                "recurrence": "residual", "n_loops": K, "d_model": 32, "n_layers": 1}
    assert res["model_step"] == summary["steps"] and res["seed"] == cfg.train.seed
    # every exit equals the training-time validation (same windows, same code path)
    assert [r["ce"] for r in res["exits"]] == pytest.approx(val["val_ce"], rel=1e-6)
    assert [r["norm"] for r in res["exits"]] == pytest.approx(val["val_norm"], rel=1e-6)
    # and evaluate.exit_losses on the loaded model
    r = E.open_run(run["model"], env["data"], [f"eval.max_tokens={cfg.train.eval_tokens}"], "cpu",
                   eval_config=eval_preset("smoke"))
    assert r.ecfg.batch_size == cfg.train.eval_batch_size  # the batches of the training-time validation
    ref = exit_losses(r.model, r.tokens, r.ecfg.batch_size, r.ecfg.max_tokens)
    assert res["exits"][-1]["ce"] == pytest.approx(ref["ce"][-1], rel=1e-7)
    assert res["depth"][K - 1]["ce"] == pytest.approx(res["exits"][K - 1]["ce"], rel=1e-7)
    # extrapolation beyond K runs and gives finite values
    assert len(res["depth"]) == 3 * K and [d["k"] for d in res["depth"]] == list(range(1, 3 * K + 1))
    assert all(math.isfinite(d["ce"]) and d["ppl"] == pytest.approx(math.exp(d["ce"])) for d in res["depth"])


def test_depth_single_pass_equals_separate_truncations(env):
    run = _open(env, "final_norm", "eval.max_tokens=512")
    res, _ = G.depth(run)
    K = run.K
    for k in range(1, 3 * K + 1):  # one pass of 3K loops == separately run k-loop passes (final readout)
        sep = exit_losses(run.model, run.tokens, run.ecfg.batch_size, 512, n_loops=k)
        assert res["depth"][k - 1]["ce"] == pytest.approx(sep["ce"][-1], rel=1e-5)
        assert res["depth"][k - 1]["norm"] == pytest.approx(sep["norm"][-1], rel=1e-5)
    # final_norm: exits k<K read raw, the truncated depths read through the norm
    assert res["exits"][-1]["ce"] == pytest.approx(res["depth"][K - 1]["ce"], rel=1e-6)
    assert res["exits"][0]["ce"] != pytest.approx(res["depth"][0]["ce"], rel=1e-3)


# ---------------------------------------------------------------- radial
@pytest.mark.parametrize("name", ["rmsnorm", "layernorm", "raw", "final_norm", "inter_loop_norm"])
def test_radial_fraction(env, name):
    run = _open(env, name)
    res, n = G.radial(run)
    assert n == run.ecfg.radial_tokens
    fr = [r["radial_fraction"] for r in res["loops"]]
    if name == "raw":
        assert min(fr) > 1e-4, fr
    elif name == "final_norm":
        assert min(fr[:-1]) > 1e-4 and fr[-1] < 1e-6, fr
    else:  # scale-invariant readouts: float noise
        assert max(fr) < 1e-6, fr
        assert all(abs(r["mean_cos"]) < 1e-3 for r in res["loops"])


# ---------------------------------------------------------------- clamps
def test_freeze_loop1_keeps_every_loop_at_loop1_rms(env):
    run = _open(env, "raw")
    x, _ = next(E.batches(run, E.windows(run, 256)))
    with torch.no_grad():
        states = run.model(x, n_loops=6, state_fn=G.clamp_fn("freeze_loop1"))
        free = run.model(x, n_loops=6)
    rms = [h.pow(2).mean(-1).sqrt() for h in states]
    torch.testing.assert_close(states[0], free[0])
    for r in rms[1:]:
        torch.testing.assert_close(r, rms[0], rtol=1e-5, atol=0)
    assert not torch.allclose(free[-1].pow(2).mean(-1).sqrt(), rms[0], rtol=1e-2)


@pytest.mark.parametrize("name", ["raw", "inter_loop_norm"])
def test_remove_radial_removes_the_radial_update(env, name):
    """Official remove_radial: loop 1 untouched; loop k >= 2's update is orthogonal to the
    previous loop's clamped state before the recurrence (not to the normalised fed state).
    remove_radial_from_embedding: every loop's update orthogonal to the loop's input."""
    run = _open(env, name)
    x, _ = next(E.batches(run, E.windows(run, 256)))
    seen = {"remove_radial": [], "remove_radial_from_embedding": []}
    free = run.model(x)
    for mode, log in seen.items():
        fn = G.clamp_fn(mode)

        def spy(k, x_in, h):
            h = fn(k, x_in, h)
            log.append((x_in.double(), h.double()))
            return h
        with torch.no_grad():
            run.model(x, state_fn=spy)

    def cos(d, ref):
        return ((d * ref).sum(-1) / (d.norm(dim=-1) * ref.norm(dim=-1))).abs().max()
    official = seen["remove_radial"]
    torch.testing.assert_close(official[0][1], free[0].double())  # loop 1 untouched
    for (_, prev), (_, h) in zip(official, official[1:]):
        assert cos(h - prev, prev) < 1e-5
    if name == "inter_loop_norm":  # the fed state is normalised: not the reference
        assert max(cos(h - x_in, x_in) for x_in, h in official[1:]) > 1e-3
    for x_in, h in seen["remove_radial_from_embedding"]:
        assert cos(h - x_in, x_in) < 1e-5
    res, _ = G.clamp(run)
    none, emb = res["modes"]["none"], res["modes"]["remove_radial_from_embedding"]
    assert list(res["modes"]) == list(G.CLAMP_MODES)
    K = run.K
    for mode in G.CLAMP_MODES:
        assert [r["k"] for r in res["modes"][mode]] == list(range(1, K + 1))
        for a, b in zip(none, res["modes"][mode]):
            assert a["delta_ce"] == 0 and a["rel_ppl"] == 1
            assert b["delta_ce"] == pytest.approx(b["ce"] - a["ce"])
            assert b["rel_ppl"] == pytest.approx(b["ppl"] / a["ppl"])
        assert res["summary"][mode]["delta_ce_vs_none"] == res["modes"][mode][-1]["delta_ce"]
    for a, b in zip(none, emb):
        assert abs(b["radial_update"]) < 1e-5 * b["update_norm"]
        assert abs(a["radial_update"]) > 1e-3 * a["update_norm"]
    # the official clamps do not touch loop 1
    for mode in G.OFFICIAL_CLAMP_MODES:
        assert res["modes"][mode][0]["ce"] == none[0]["ce"]


def test_scale_sweep(env):
    """alpha = 1 is the unscaled model's final exit; a scale-invariant readout is flat in alpha,
    a raw one is not."""
    for name, flat in (("rmsnorm", True), ("raw", False)):
        run = _open(env, name)
        res, n = G.scale(run)
        assert n == run.ecfg.scale_tokens and res["alphas"] == list(G.SCALE_ALPHAS)
        final = G.clamp(run)[0]["modes"]["none"][-1]
        one = res["sweep"][G.SCALE_ALPHAS.index(1.0)]
        assert one["ce"] == pytest.approx(final["ce"], rel=1e-6) and one["delta_ce"] == 0
        if flat:
            assert res["summary"]["ce_range"] < 1e-4
        else:
            assert res["summary"]["ce_range"] > 0.1


# ---------------------------------------------------------------- norms and lemma
def test_norms(env):
    run = _open(env, "rmsnorm")
    res, n = G.norms(run)
    assert n == run.ecfg.norm_tokens
    f = res["final"]
    assert f["min"] <= f["median"] <= f["p99"] <= f["max"] and f["p99_over_median"] == pytest.approx(f["p99"] / f["median"])
    assert f["mean"] == pytest.approx(res["loops"][-1]["norm"]) == pytest.approx(res["norm_by_loop"][-1])
    h = res["histogram"]
    assert sum(h["counts"]) == n and len(h["edges"]) == len(h["counts"]) + 1
    assert np.all(np.diff(np.log(h["edges"])) == pytest.approx(np.diff(np.log(h["edges"]))[0]))
    # ‖H_k‖ per loop agrees with the depth evaluation's on the same tokens
    d = exit_losses(run.model, run.tokens, run.ecfg.batch_size, run.ecfg.norm_tokens)
    assert res["norm_by_loop"] == pytest.approx(d["norm"], rel=1e-5)


def test_lemma(env):
    run = _open(env, "rmsnorm", "eval.batch_size=64")  # one batch holds all lemma tokens
    res, n = G.lemma(run)
    L = run.ecfg.lemma_loops
    assert n == run.ecfg.lemma_tokens and len(res["loops"]) == L
    with torch.no_grad():
        x, _ = next(E.batches(run, E.windows(run, run.ecfg.lemma_tokens)))
        states = run.model(x, n_loops=L)
    for k in (0, L - 2):  # against a direct computation (the fixture's first batch = all lemma tokens)
        s0, s1 = states[k].double().norm(dim=-1), states[k + 1].double().norm(dim=-1)
        ang = (states[k + 1].double() / s1[..., None] - states[k].double() / s0[..., None]).norm(dim=-1)
        assert x.numel() == n
        assert res["loops"][k]["radial_increment"] == pytest.approx(float((s1 - s0).mean()), rel=1e-6)
        assert res["loops"][k]["angular_update"] == pytest.approx(float(ang.mean()), rel=1e-6)
        assert res["loops"][k]["angular_times_scale"] == pytest.approx(float((ang * s0).mean()), rel=1e-6)
    assert "angular_update" not in res["loops"][-1]


# ---------------------------------------------------------------- halting
def test_dynamic_execution_matches_the_model(env):
    for name in ("rmsnorm", "inter_loop_norm"):
        run = _open(env, name)
        x, y = next(E.batches(run, E.windows(run, 256)))
        ce_sum, loops = Hl.dynamic_batch(run.model, x, y, None, None)
        with torch.no_grad():
            h = run.model(x)[-1]
            ref = torch.nn.functional.cross_entropy(run.model.logits(h).flatten(0, 1), y.flatten(), reduction="sum")
        assert float(ce_sum) == pytest.approx(float(ref), rel=1e-5)
        assert float(loops) == run.K * y.numel()


@pytest.mark.parametrize("policy", Hl.POLICIES)
def test_dynamic_early_exit_matches_posthoc(env, policy):
    run = _open(env, "rmsnorm", "eval.batch_size=4")
    starts = E.windows(run, 1024)
    ce, conf = Hl.collect(run, starts)
    c = conf[policy].mean(axis=1)  # window confidences [S, K]
    tau = float(np.median(c[:, 0]))  # half the windows leave after loop 1
    mean_ce, mean_loops, exits = Hl.outcomes(ce, conf[policy], np.array([tau]), "sequence")
    assert 0 < (exits[0] == 0).sum() < len(starts)
    ce_sum = loops = 0.0
    for x, y in E.batches(run, starts):
        c_b, l_b = Hl.dynamic_batch(run.model, x, y, policy, tau)
        ce_sum, loops = ce_sum + float(c_b), loops + float(l_b)
    n = len(starts) * run.seq_len
    assert ce_sum / n == pytest.approx(float(mean_ce[0]), rel=1e-5)
    assert loops / n == pytest.approx(float(mean_loops[0]))


def test_halting_calibration(env):
    run = _open(env, "rmsnorm")
    res, n = G.RUNNERS["halting"](run)
    K = run.K
    assert n == run.ecfg.halting_tokens
    assert res["windows"]["calib"] + res["windows"]["test"] == n // run.seq_len
    assert len(res["policies"]) == 6
    for key, pol in res["policies"].items():
        cal, test = pol["calib"], pol["test"]
        assert cal["meets_target"] and cal["ppl_ratio"] <= 1 + run.ecfg.halting_epsilon + 1e-9, key
        assert 1 <= cal["mean_loops"] <= K and 1 <= test["mean_loops"] <= K
        assert sum(test["exit_counts"]) == (res["windows"]["test"] * (run.seq_len if pol["granularity"] == "token" else 1))
        assert test["ppl_full"] == pytest.approx(res["static_exits"]["test"][-1]["ppl"])
        assert pol["early_exit"] == (pol["threshold"] is not None)
    for p in Hl.POLICIES:  # real dynamic depth scores what the post-hoc policy predicts
        dyn = res["dynamic"][p]
        assert dyn["ppl"] == pytest.approx(dyn["posthoc_ppl"], rel=1e-4)
        assert dyn["mean_loops"] == pytest.approx(res["policies"][f"{p}/sequence"]["test"]["mean_loops"])
        assert dyn["speedup"] > 0
    assert res["dynamic"]["full_depth"]["ppl"] == pytest.approx(res["static_exits"]["test"][-1]["ppl"], rel=1e-5)


def test_calibration_picks_fewest_loops():
    # window 0 is confident at exit 1 and exit 1 is as good as exit 2; window 1 is not
    ce = np.array([[[1.0, 1.0]], [[3.0, 1.0]]])
    conf = np.array([[[0.9, 0.95]], [[0.2, 0.9]]])
    tau = Hl.calibrate(ce, conf, "sequence", 0.01)
    assert 0.2 < tau <= 0.9
    ce_m, loops, _ = Hl.outcomes(ce, conf, np.array([tau, np.inf]), "sequence")
    assert loops.tolist() == [1.5, 2.0] and ce_m.tolist() == [1.0, 1.0]
    # exiting early always costs more than epsilon: never exit early
    assert math.isinf(Hl.calibrate(np.array([[[2.0, 1.0]]]), np.array([[[0.99, 0.99]]]), "token", 0.01))


def test_throughput(env):
    run = _open(env, "rmsnorm")
    res, n = G.throughput(run)
    assert [r["k"] for r in res["depth"]] == list(range(1, 3 * run.K + 1))
    assert all(r["tokens_per_s"] > 0 for r in res["depth"])
    assert res["batch_size"] == run.ecfg.batch_size and res["seq_len"] == run.seq_len and res["threads"] >= 1
    assert n == res["batch_tokens"] * run.ecfg.throughput_batches


# ---------------------------------------------------------------- files, errors, CLI
def _cli(capsys, *argv):
    rc = cli.main([*map(str, argv)])
    err = capsys.readouterr().err
    return rc, err


@pytest.mark.parametrize("diag", G.DIAGNOSTICS + ("all",))
def test_bad_checkpoints_give_one_line_errors(env, capsys, diag, tmp_path):
    out = ["--outdir", tmp_path] if diag == "all" else ["--out", tmp_path / "x.json"]
    cases = {"missing": (env["root"] / "nope" / "model.pt", env["data"], "not found"),
             "truncated": (env["truncated"], env["data"], "truncated or corrupted"),
             "mismatched": (env["runs"]["rmsnorm"]["model"], env["other"], "evaluate with the run's own data")}
    for case, (model, data, words) in cases.items():
        rc, err = _cli(capsys, "eval", diag, "--model", model, "--data", data, *out, "-q", "--device", "cpu")
        assert rc == 2, case
        assert err.count("\n") == 1 and err.startswith("loopscale: error:") and words in err, (case, err)
    assert not list(tmp_path.iterdir())


def test_mismatch_message_names_both_vocabularies(env):
    from loopscale.io import CheckpointError
    with pytest.raises(CheckpointError, match=r"was trained on vocabulary \d+ but data dir .* has \d+"):
        E.open_run(env["runs"]["rmsnorm"]["model"], env["other"], device="cpu")
    # an untrained model without config.json beside it is checked through its data settings
    cfg = preset("smoke", {"data": {"vocab_size": 1024}})
    p = _save_untrained(env["root"] / "v1024" / "model.pt", cfg)
    with pytest.raises(CheckpointError, match="vocabulary 1024"):
        E.open_run(p, env["data"], device="cpu")


def test_diverged_model_is_reported_not_evaluated(env, capsys, tmp_path, monkeypatch):
    def boom(run):
        raise AssertionError("evaluated a diverged model")
    monkeypatch.setattr(G, "RUNNERS", {k: boom for k in G.RUNNERS})
    rc, err = _cli(capsys, "eval", "all", "--model", env["runs"]["diverged"]["model"], "--data", env["data"],
                   "--outdir", tmp_path, "-q")
    assert rc == 0, err
    for name in G.DIAGNOSTICS:
        res = json.loads((tmp_path / f"{name}.json").read_text())
        assert res["status"] == "diverged" and res["diagnostic"] == name and res["tokens"] == 0
        assert {"model_step", "condition", "seed", "device"} <= set(res)


def test_eval_all_only_loads_once_and_writes_the_requested(env, capsys, tmp_path):
    model = env["runs"]["rmsnorm"]["model"]
    rc, err = _cli(capsys, "eval", "all", "--model", model, "--data", env["data"], "--outdir", tmp_path / "all",
                   "--only", "norms,depth", "-q", "--device", "cpu")
    assert rc == 0, err
    assert sorted(f.name for f in (tmp_path / "all").iterdir()) == ["depth.json", "norms.json"]
    rc, err = _cli(capsys, "eval", "depth", "--model", model, "--data", env["data"], "--out", tmp_path / "d.json",
                   "-q", "--device", "cpu")
    assert rc == 0, err
    one, together = (json.loads(f.read_text()) for f in (tmp_path / "d.json", tmp_path / "all" / "depth.json"))
    assert one["status"] == together["status"] == "ok"
    assert one["exits"] == together["exits"] and one["depth"] == together["depth"]
    rc, err = _cli(capsys, "eval", "all", "--model", model, "--data", env["data"], "--outdir", tmp_path / "bad",
                   "--only", "norms,nroms", "-q")
    assert rc == 2 and err.count("\n") == 1 and "unknown diagnostic 'nroms'" in err
    assert not (tmp_path / "bad").exists()


def test_failed_training_gets_failed_results(env, capsys, tmp_path, monkeypatch):
    """A crash recorded by `loopscale train --record-failure` leaves summary.json and a
    model.pt without weights (status failed): `loopscale eval` writes status "failed"
    results without evaluating; loading the model names the failure."""
    from loopscale.io import CheckpointError, load_checkpoint
    from loopscale.rundir import record_failure
    run = tmp_path / "run"
    run.mkdir()
    (run / "model.safetensors").write_bytes(b"weights of an earlier run")
    record_failure(_smoke(), run, RuntimeError("CUDA out of memory"))
    assert not (run / "model.safetensors").exists()
    assert json.loads((run / "summary.json").read_text())["status"] == "failed"
    with pytest.raises(CheckpointError, match="holds no weights: training of this run failed"):
        load_checkpoint(run / "model.pt")
    monkeypatch.setattr(G, "RUNNERS", {k: None for k in G.RUNNERS})  # nothing may be evaluated
    rc, err = _cli(capsys, "eval", "all", "--model", run / "model.pt", "--data", env["data"], "--outdir", run / "eval",
                   "--only", "depth,radial", "-q")
    assert rc == 0, err
    assert sorted(f.name for f in (run / "eval").iterdir()) == ["depth.json", "radial.json"]
    for name in ("depth", "radial"):
        res = json.loads((run / "eval" / f"{name}.json").read_text())
        assert res == {"diagnostic": name, "status": "failed", "tokens": 0,
                       "note": "training failed; nothing was evaluated", "error": "RuntimeError: CUDA out of memory"}
    # a completed summary beside a missing model is an error, not a result
    (run / "summary.json").write_text(json.dumps({"status": "completed"}))
    (run / "model.pt").unlink()
    rc, err = _cli(capsys, "eval", "norms", "--model", run / "model.pt", "--data", env["data"],
                   "--out", run / "n.json", "-q")
    assert rc == 2 and "not found" in err and not (run / "n.json").exists()


def test_overrides_are_eval_only(env, capsys, tmp_path):
    rc, err = _cli(capsys, "eval", "norms", "--model", env["runs"]["rmsnorm"]["model"], "--data", env["data"],
                   "--out", tmp_path / "n.json", "--set", "model.d_model=64", "-q")
    assert rc == 2 and "eval" in err
    rc, err = _cli(capsys, "eval", "norms", "--model", env["runs"]["rmsnorm"]["model"], "--data", env["data"],
                   "--out", tmp_path / "n.json", "--set", "eval.lemma_loops=1", "-q")
    assert rc == 2 and "eval.lemma_loops" in err
    rc, err = _cli(capsys, "eval", "norms", "--model", env["runs"]["rmsnorm"]["model"], "--data", env["data"],
                   "--out", tmp_path / "n.json", "--set", "eval.norm_tokens=64", "-q")
    assert rc == 0 and json.loads((tmp_path / "n.json").read_text())["tokens"] == 64


def test_cpu_shaped_model_all_commands(env, tmp_path, capsys):
    """Every command on a cpu-preset-shaped model with the default eval sizes (capped by this
    small validation split; throughput shortened to 1 warm-up + 2 timed batches per depth);
    timings are printed, not asserted."""
    cfg = preset("cpu")
    model = _save_untrained(tmp_path / "cpu" / "model.pt", cfg)
    t0 = time.time()
    rc = cli.main(["eval", "all", "--model", str(model), "--data", str(env["small"]), "--outdir", str(tmp_path / "res"),
                   "--device", "cpu", "-q", "--set", "eval.throughput_batches=2", "--set", "eval.throughput_warmup=1"])
    assert rc == 0
    timings = {}
    for name in G.DIAGNOSTICS:
        res = json.loads((tmp_path / "res" / f"{name}.json").read_text())
        assert res["status"] == "ok" and res["condition"]["d_model"] == cfg.model.d_model
        timings[name] = (round(res["wall_time_s"], 2), res["tokens"])
    with capsys.disabled():
        print(f"\ncpu-shaped model, default eval sizes, {len(D.load_split(env['small'], 'validation'))} validation "
              f"tokens, {torch.get_num_threads()} threads: total {time.time() - t0:.1f}s; (s, tokens) {timings}")


def test_eval_config_file_and_checkpoints_from_before_the_split(env, tmp_path, capsys):
    """`--eval-config FILE` (RUN/eval.yaml) sets the sizes, `--set` wins over it, a bad value is
    refused before anything is evaluated; a model.pt whose config still has an `eval` section
    (written before evaluation settings left the run config) loads, that section ignored."""
    cfg = _smoke()
    old = cfg.to_dict()
    old["eval"] = {"batch_size": 2, "norm_tokens": 99999}  # stale: must not be used
    model = tmp_path / "old" / "model.pt"
    model.parent.mkdir()
    atomic_torch_save(model, {"model": LoopedLM(cfg.model).state_dict(), "config": old, "step": 0,
                              "status": "completed"})
    ev = tmp_path / "eval.yaml"
    ev.write_text("preset: smoke\nnorm_tokens: 128\nbatch_size: 4\n")
    out = tmp_path / "n.json"
    rc, err = _cli(capsys, "eval", "norms", "--model", model, "--data", env["data"], "--out", out,
                   "--eval-config", ev, "--set", "eval.batch_size=8", "--device", "cpu", "-q")
    assert rc == 0, err
    res = json.loads(out.read_text())
    assert res["tokens"] == 128 and res["eval"]["batch_size"] == 8
    assert res["eval"]["lemma_loops"] == 8  # from the smoke preset named in the file
    ev.write_text("lemma_loops: 1\n")
    out.unlink()
    rc, err = _cli(capsys, "eval", "all", "--model", model, "--data", env["data"], "--outdir", tmp_path / "all",
                   "--eval-config", ev, "-q")
    assert rc == 2 and err.count("\n") == 1 and "eval.lemma_loops" in err and not (tmp_path / "all").exists()
    ev.write_text("lemma_loopz: 3\n")
    rc, err = _cli(capsys, "eval", "norms", "--model", model, "--data", env["data"], "--out", out, "--eval-config", ev)
    assert rc == 2 and "unknown key 'eval.lemma_loopz'" in err and not out.exists()
