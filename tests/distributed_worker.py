"""`loopscale train` under torchrun with one fault injected, for tests/test_distributed.py.

    torchrun ... tests/distributed_worker.py FAULT AT RANK -- <loopscale train arguments>

FAULT  kill     every rank dies (os._exit) at its AT-th checkpoint, rank 0 once state.pt is written
       sigterm  rank RANK receives SIGTERM during step AT (the other ranks do not)
       nonfinite  rank RANK alone sees a non-finite hidden-state norm at step AT
"""
import os
import signal
import sys

import torch

from loopscale import cli
from loopscale import train as T

fault, at, on_rank = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
args = sys.argv[sys.argv.index("--") + 1:]
rank = int(os.environ["RANK"])

if fault == "kill":  # rank 0 dies once its file is written, the others once their part is done
    save, saved = T.atomic_torch_save, []
    opt_state, calls = T.DD.optimizer_state, [0]

    def killing_save(path, obj):
        save(path, obj)
        if path.name == "state.pt":
            saved.append(obj["step"])
            if len(saved) == at:
                os._exit(9)

    def killing_opt_state(*a, **kw):  # the last piece every rank contributes to a checkpoint
        out = opt_state(*a, **kw)
        calls[0] += 1
        if rank != 0 and calls[0] == at:
            os._exit(9)
        return out
    T.atomic_torch_save = killing_save
    T.DD.optimizer_state = killing_opt_state
elif fault in ("sigterm", "nonfinite"):
    loss, calls = T.compute_loss, [0]

    def faulty_loss(*a, **kw):
        res = loss(*a, **kw)
        calls[0] += 1
        if rank == on_rank and calls[0] == at:
            if fault == "sigterm":
                os.kill(os.getpid(), signal.SIGTERM)
            else:  # only this rank's logged norm is bad: the ranks must agree through the flag
                res.norms[-1] = float("nan")
        return res
    T.compute_loss = faulty_loss
else:
    sys.exit(f"unknown fault {fault!r}")

sys.exit(cli.main(["train", *args]))
