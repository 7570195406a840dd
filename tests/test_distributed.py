"""Data-parallel training (loopscale.distributed) on CPU with the gloo backend.

Fast: sharding of the global batch, config checks, gradient accumulation in one process.
Slow (torchrun, 2 ranks): DDP and FSDP give the single-process losses and weights on the
same global batch; SIGTERM on one rank and a hard kill of all ranks both resume exactly;
a non-finite value on one rank stops every rank at the same step.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from loopscale import distributed as DD
from loopscale.config import ConfigError, preset
from loopscale.model import count_params
from loopscale.train import train

TESTS = Path(__file__).resolve().parent
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
STEPS = dict(max_steps=16, log_every=4, ckpt_every=8, threads=1)


def cfg(**train_kw):
    return preset("smoke", {"train": {**STEPS, **train_kw}})


def records(run_dir):
    return [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir):
    return [(r["step"], r["loss"], r["ce"], r["norm"]) for r in records(run_dir) if "loss" in r]


def weights(run_dir):
    return torch.load(run_dir / "model.pt", weights_only=True)["model"]


def assert_close_runs(a, b, rtol=1e-5, atol=1e-5):
    la, lb = losses(a), losses(b)
    assert [r[0] for r in la] == [r[0] for r in lb]
    for ra, rb in zip(la, lb):
        np.testing.assert_allclose(np.array([ra[1], *ra[2], *ra[3]]), np.array([rb[1], *rb[2], *rb[3]]), rtol=rtol)
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=rtol, atol=atol, msg=k)


def torchrun(data, out, *sets, worker=None, check=True, nproc=2):
    """`loopscale train --preset smoke` through torchrun with `nproc` CPU ranks (gloo)."""
    args = ["train", "--preset", "smoke", "--data", str(data), "--out", str(out), "-q"]
    for k, v in {**STEPS, **dict(s.split("=", 1) for s in sets)}.items():
        args += ["--set", f"{k if '.' in k else 'train.' + k}={v}"]
    target = [str(TESTS / "distributed_worker.py"), *worker, "--", *args[1:]] if worker else ["-m", "loopscale.cli", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(TESTS.parent / "src")}
    proc = subprocess.run([TORCHRUN, "--standalone", "--nproc-per-node", str(nproc), *target],
                          capture_output=True, text=True, timeout=300, env=env)
    if check and proc.returncode != 0:
        pytest.fail(f"torchrun exited {proc.returncode}\n{proc.stderr[-4000:]}", pytrace=False)
    return proc


# ---------------------------------------------------------------------------
# fast
# ---------------------------------------------------------------------------
def test_ranks_share_out_the_global_batch():
    batch = np.arange(100, 112)
    shares = [DD.shard(batch, r, 3) for r in range(3)]
    assert np.array_equal(np.concatenate(shares), batch)  # disjoint, in order, all of it
    micro = DD.micro_batches(shares[1], 2)
    assert [m.tolist() for m in micro] == [[104, 105], [106, 107]]
    assert DD.micro_batch_size(8, 4, 2) == 1
    with pytest.raises(ConfigError, match="global batch.*4 x 2 = 8"):
        DD.micro_batch_size(12, 4, 2)


def test_single_process_helpers_are_no_ops():
    d = DD.Dist()
    assert not d.enabled and d.is_main
    flags = torch.tensor([False, True])
    assert DD.any_true(flags, d).tolist() == [False, True]
    t = torch.tensor([1.0, 2.0])
    assert DD.mean(t, d) is t and DD.gather("x", d) == ["x"]
    assert DD.rank_seed(42, 1) != DD.rank_seed(42, 2) != DD.rank_seed(43, 1)


def test_paper_1_4b_preset():
    c = preset("paper-1.4b")
    m, t = c.model, c.train
    assert (m.d_model, m.n_layers, m.n_heads, m.d_ff, m.seq_len, m.n_loops) == (2048, 20, 16, 8192, 256, 4)
    assert c.objective.loss == "terminal" and (t.batch_size, t.epochs, t.lr, t.precision) == (8, 2.0, 2e-4, "bf16")
    assert 1.35e9 < count_params(m) < 1.45e9


def test_grad_accum_is_checked():
    with pytest.raises(ConfigError, match="train.grad_accum"):
        preset("smoke", {"train": {"grad_accum": 0}})
    with pytest.raises(ConfigError, match="divisible by train.grad_accum"):
        preset("smoke", {"train": {"batch_size": 8, "grad_accum": 3}})


def test_grad_accum_gives_the_full_batch_result(smoke_data, tmp_path):
    train(cfg(), smoke_data, tmp_path / "one", progress=False)
    train(cfg(grad_accum=4), smoke_data, tmp_path / "accum", progress=False)
    assert_close_runs(tmp_path / "one", tmp_path / "accum")
    assert records(tmp_path / "accum")[-2]["tokens"] == 16 * 8 * 32  # global batch: 8 x seq 32


# ---------------------------------------------------------------------------
# slow: torchrun, 2 CPU ranks
# ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def single(smoke_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("single") / "run"
    train(cfg(), smoke_data, out, progress=False)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("sets", [(), ("fsdp=true", "grad_accum=2")], ids=["ddp", "fsdp-accum2"])
def test_two_ranks_equal_one_process(single, smoke_data, tmp_path, sets):
    out = tmp_path / "run"
    torchrun(smoke_data, out, *sets)
    assert_close_runs(single, out)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["world_size"] == 2
    info = json.loads((out / "loopscale.json").read_text())
    assert info["env"]["distributed"] == {"world_size": 2, "fsdp": "fsdp=true" in sets, "backend": "gloo"}
    assert len(records(out)) == 5  # logged once (rank 0): 4 training records + validation


@pytest.mark.slow
def test_sigterm_on_one_rank_and_a_hard_kill_resume_exactly(smoke_data, tmp_path):
    dropout = "model.dropout=0.1"  # each rank's RNG must be restored too
    full = tmp_path / "full"
    torchrun(smoke_data, full, dropout)
    run = tmp_path / "run"
    # SIGTERM reaches rank 1 alone during step 5: both ranks stop after step 5, state saved
    p = torchrun(smoke_data, run, dropout, worker=["sigterm", "5", "1"], check=False)
    assert p.returncode != 0 and "SIGTERM at step 5/16" in p.stderr
    state = torch.load(run / "state.pt", weights_only=False)
    assert state["step"] == 5 and state["world_size"] == 2 and len(state["rng_ranks"]) == 2
    assert not torch.equal(state["rng_ranks"][0]["cpu"], state["rng_ranks"][1]["cpu"])
    # resumed, then every rank killed hard right after the step-8 checkpoint
    p = torchrun(smoke_data, run, dropout, worker=["kill", "1", "0"], check=False)
    assert p.returncode != 0 and torch.load(run / "state.pt", weights_only=False)["step"] == 8
    torchrun(smoke_data, run, dropout)
    assert losses(run) == losses(full)
    wf, wr = weights(full), weights(run)
    assert all(torch.equal(wf[k], wr[k]) for k in wf)


@pytest.mark.slow
def test_non_finite_on_one_rank_stops_all_ranks(smoke_data, tmp_path):
    run = tmp_path / "run"
    torchrun(smoke_data, run, worker=["nonfinite", "6", "1"])
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "diverged" and summary["diverged_at_step"] == 6 and summary["steps"] == 5
    assert torch.load(run / "model.pt", weights_only=True)["step"] == 5


# ---------------------------------------------------------------------------
# the pipeline: torchrun when an experiment asks for more than one GPU per run
# ---------------------------------------------------------------------------
def test_paper_1_4b_experiment_trains_on_4_gpus_per_run():
    from workflow_support import REPO, SCHEMA
    from loopscale import pipeline as P
    _, exps = P.load_and_validate(REPO / "params.yaml", SCHEMA)
    e = exps["paper-1.4b"]
    assert [r.condition.id for r in e.runs] == ["rmsnorm-terminal-none-residual", "raw-terminal-none-residual"]
    assert e.train_resources == {"gpu": 4} and e.gpu == 1
    assert e.train_launcher == "torchrun --standalone --nproc-per-node 4 -m loopscale.cli train"
    assert all(r.config.train.batch_size == 8 for r in e.runs)  # the paper's global batch
    assert exps["paper"].train_launcher == "loopscale train" and exps["paper"].train_resources == {"gpu": 1}


def test_multi_node_launch_and_bad_gpu_counts(tmp_path):
    from workflow_support import REPO, load
    import yaml
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    exp = params["experiments"]["paper-1.4b"]
    exp.update(gpus_per_run=8, nodes_per_run=2)
    e = load(params, tmp_path)[1]["paper-1.4b"]
    assert e.train_resources == {"nodes": 2, "tasks": 2, "mpi": "srun", "gres": "gpu:4"}
    assert e.train_launcher.startswith('srun --ntasks-per-node=1 torchrun --nnodes "$SLURM_NNODES" '
                                       '--nproc-per-node 4 --rdzv-backend c10d')
    exp.update(gpus_per_run=3, nodes_per_run=1)  # global batch 8 does not split over 3 ranks
    with pytest.raises(P_error(), match=r"experiments.paper-1.4b.gpus_per_run: train.batch_size 8 .*3 x 1"):
        load(params, tmp_path)
    exp.update(gpus_per_run=4, nodes_per_run=3)
    with pytest.raises(P_error(), match=r"gpus_per_run: 4 ranks do not split evenly over nodes_per_run 3"):
        load(params, tmp_path)
    exp.update(gpus_per_run=0, nodes_per_run=1)
    with pytest.raises(P_error(), match=r"gpus_per_run: 0 is less than the minimum of 1"):
        load(params, tmp_path)


def P_error():
    from loopscale.pipeline import ParamsError
    return ParamsError


@pytest.mark.slow
def test_smoke_run_trains_through_torchrun_in_the_pipeline(tmp_path):
    from workflow_support import copy_worktree, edit_params, smk
    repo = copy_worktree(tmp_path / "repo")
    edit_params(repo, lambda p: p["experiments"]["smoke"].update(gpus_per_run=2))  # gpu 0: CPU ranks
    run = "runs/smoke/smoke/rmsnorm-per_loop-none-residual/seed42"
    proc = smk(repo, "--cores", "2", "-p", f"{run}/summary.json", "--config", "experiment=smoke")
    assert "torchrun --standalone --nproc-per-node 2 -m loopscale.cli train" in proc.stdout + proc.stderr
    summary = json.loads((repo / run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["world_size"] == 2 and summary["steps"] == 20
    assert json.loads((repo / run / "loopscale.json").read_text())["env"]["distributed"]["world_size"] == 2
