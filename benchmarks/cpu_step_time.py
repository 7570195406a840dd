"""CPU time of one training step of the cpu preset at other shapes (calibrates CPU experiments).

    PYTHONPATH=src python benchmarks/cpu_step_time.py D,LAYERS,HEADS,D_FF,SEQ,BATCH [...] \
        [--optimizer default|foreach|fused] [--steps 12]

Prints, per shape, the process CPU time of a full step (forward with the per-loop CE of all
K exits, backward, clip, AdamW) on one thread: min and median over the timed steps. CPU time,
not wall time, so figures taken on a busy machine stay comparable; run the cpu preset's shape
(64,2,2,256,64,16) beside the candidates and compare ratios.
"""
from __future__ import annotations

import argparse
import time

import torch

from loopscale.config import preset
from loopscale.model import LoopedLM
from loopscale.objective import compute_loss


def step_times(d, layers, heads, d_ff, seq, batch, steps=12, optimizer="default") -> tuple[list, int]:
    cfg = preset("cpu", {"model": {"d_model": d, "n_layers": layers, "n_heads": heads, "d_ff": d_ff, "seq_len": seq},
                         "train": {"batch_size": batch}})
    torch.manual_seed(0)
    model = LoopedLM(cfg.model).train()
    kw = {"foreach": True} if optimizer == "foreach" else {"fused": True} if optimizer == "fused" else {}
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay, **kw)
    x = torch.randint(0, cfg.model.vocab_size, (batch, seq))
    y = torch.randint(0, cfg.model.vocab_size, (batch, seq))
    times = []
    for i in range(steps + 2):  # two warm-up steps
        t0 = time.process_time()
        res = compute_loss(model, model(x), y, cfg.objective, all_exits=False)
        opt.zero_grad(set_to_none=True)
        res.total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        opt.step()
        if i >= 2:
            times.append(time.process_time() - t0)
    return sorted(times), model.num_params()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("shapes", nargs="+", help="D,LAYERS,HEADS,D_FF,SEQ,BATCH")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--optimizer", choices=["default", "foreach", "fused"], default="default")
    a = p.parse_args()
    torch.set_num_threads(1)
    for spec in a.shapes:
        d, layers, heads, d_ff, seq, batch = map(int, spec.split(","))
        t, n = step_times(d, layers, heads, d_ff, seq, batch, a.steps, a.optimizer)
        print(f"d{d} L{layers} H{heads} ff{d_ff} seq{seq} batch{batch} ({n / 1e3:.0f}k params, {a.optimizer} AdamW): "
              f"step CPU time min {1e3 * t[0]:.0f} ms, median {1e3 * t[len(t) // 2]:.0f} ms", flush=True)


if __name__ == "__main__":
    main()
