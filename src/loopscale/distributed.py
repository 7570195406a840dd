"""Data-parallel training on PyTorch's own engine: torch.distributed, DDP, FSDP.

`loopscale train` runs data-parallel when launched by `torchrun`; `train.batch_size` stays the
GLOBAL batch (per-rank micro-batch = batch_size / (world size x grad_accum)). NCCL on CUDA,
gloo on CPU; everything here is a no-op in a plain single process. docs/distributed.md.
"""
from __future__ import annotations

import atexit
import datetime
import os
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from .config import ConfigError


@dataclass(frozen=True)
class Dist:
    """This process's place in the job: rank, world size, local rank, device."""
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the one rank that writes files and logs."""
        return self.rank == 0


def env_world() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's environment; (0, 1, 0) without it."""
    try:
        return (int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
                int(os.environ.get("LOCAL_RANK", 0)))
    except ValueError as e:
        raise ConfigError(f"torchrun environment: RANK/WORLD_SIZE/LOCAL_RANK must be integers ({e})") from None


def setup(device: torch.device, timeout_s: float = 1800) -> Dist:
    """Join the process group torchrun set up (NCCL on CUDA, gloo otherwise).

    On CUDA each rank takes the GPU of its local rank. Without torchrun (WORLD_SIZE unset or
    1) nothing is initialised and the given device is kept."""
    rank, world, local = env_world()
    if world <= 1:
        return Dist(device=device)
    if device.type == "cuda":
        if local >= torch.cuda.device_count():
            raise ConfigError(f"torchrun started {world} ranks but this node has "
                              f"{torch.cuda.device_count()} GPU(s) for local rank {local}")
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    elif device.type != "cpu":
        raise ConfigError(f"distributed training runs on cuda or cpu, not {device.type}")
    if not dist.is_initialized():
        atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                timeout=datetime.timedelta(seconds=timeout_s),
                                **({"device_id": device} if device.type == "cuda" else {}))
    return Dist(rank=rank, world=world, local_rank=local, device=device)


# ---------------------------------------------------------------------------
# the global batch, shared out
# ---------------------------------------------------------------------------
def micro_batch_size(batch_size: int, world: int, grad_accum: int) -> int:
    """Per-rank micro-batch of a global batch; it must divide evenly (one line if not)."""
    parts = world * grad_accum
    if batch_size % parts:
        raise ConfigError(f"train.batch_size ({batch_size}) is the global batch: it must be divisible by "
                          f"world size x train.grad_accum ({world} x {grad_accum} = {parts})")
    return batch_size // parts


def shard(indices: np.ndarray, rank: int, world: int) -> np.ndarray:
    """Rank `rank`'s contiguous share of one global batch of window indices."""
    n = len(indices) // world
    return indices[rank * n:(rank + 1) * n]


def micro_batches(indices: np.ndarray, grad_accum: int) -> list[np.ndarray]:
    """Split a rank's share into `grad_accum` equal micro-batches (in order)."""
    return np.split(indices, grad_accum)


# ---------------------------------------------------------------------------
# wrapping the model
# ---------------------------------------------------------------------------
def wrap(model: torch.nn.Module, d: Dist, fsdp: bool = False) -> torch.nn.Module:
    """The module the training step calls: the model itself (one process), DDP around it,
    or, with `fsdp`, the model sharded in place (FSDP2: each block, then the root, so the
    tied embedding/head stays in one unit). Build the optimiser AFTER this call."""
    if not d.enabled:
        return model
    if fsdp:
        from torch.distributed.fsdp import fully_shard
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        return model
    from torch.nn.parallel import DistributedDataParallel
    # gradients live in DDP's communication buckets (no second copy of every gradient)
    return DistributedDataParallel(model, device_ids=[d.device.index] if d.device.type == "cuda" else None,
                                   gradient_as_bucket_view=True)


def no_sync(fwd: torch.nn.Module, sync: bool):
    """Context for one micro-batch's forward+backward: gradients are reduced across ranks
    only on the last micro-batch of a step (`sync`)."""
    if sync or not hasattr(fwd, "no_sync"):
        if hasattr(fwd, "set_requires_gradient_sync"):  # FSDP2
            fwd.set_requires_gradient_sync(sync)
        return nullcontext()
    return fwd.no_sync()  # DDP


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a (possibly sharded) DTensor result, e.g. FSDP's gradient norm."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


# ---------------------------------------------------------------------------
# collectives on small things
# ---------------------------------------------------------------------------
def any_true(flags: torch.Tensor, d: Dist) -> torch.Tensor:
    """Element-wise OR of a small bool/0-1 tensor over ranks (e.g. [non-finite, SIGTERM]),
    so every rank takes the same decision at the same step."""
    if not d.enabled:
        return flags.bool()
    t = flags.to(d.device, torch.int32)  # NCCL reduces CUDA tensors only
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.bool()


def mean(t: torch.Tensor, d: Dist) -> torch.Tensor:
    """Mean over ranks of a (float) tensor: the global batch's value of a per-rank mean."""
    if not d.enabled:
        return t
    t = t.detach().clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t / d.world


def gather(obj, d: Dist) -> list:
    """Every rank's `obj` (picklable), in rank order, on every rank."""
    if not d.enabled:
        return [obj]
    out = [None] * d.world
    dist.all_gather_object(out, obj)
    return out


def barrier(d: Dist) -> None:
    if d.enabled:
        dist.barrier()


def rank_seed(seed: int, rank: int) -> int:
    """The RNG seed of rank `rank` after model construction (dropout masks): rank 0 keeps
    the single-process stream, the others draw independent ones."""
    return int(np.random.SeedSequence([seed, rank]).generate_state(1)[0])


# ---------------------------------------------------------------------------
# checkpoint state: the single-process format on every path
# ---------------------------------------------------------------------------
def model_state(model: torch.nn.Module, d: Dist, fsdp: bool) -> dict:
    """The full (unsharded) model state dict (with FSDP: on CPU on rank 0, empty elsewhere).
    A collective under FSDP: every rank must call it."""
    if not (d.enabled and fsdp):
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def optimizer_state(model: torch.nn.Module, opt: torch.optim.Optimizer, d: Dist, fsdp: bool) -> dict:
    """The optimiser state in torch's own single-process layout (parameters numbered in
    `model.parameters()` order), so a checkpoint resumes on any number of ranks, with or
    without FSDP. A collective under FSDP: every rank must call it."""
    if not (d.enabled and fsdp):
        return opt.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    full = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not d.is_main:
        return {}
    ids = {name: i for i, (name, _) in enumerate(model.named_parameters())}
    return {"state": {ids[n]: s for n, s in full["state"].items()},
            "param_groups": [{**g, "params": [ids[n] for n in g["params"]]} for g in full["param_groups"]]}


def load_states(model: torch.nn.Module, opt: torch.optim.Optimizer, model_sd: dict, opt_sd: dict,
                d: Dist, fsdp: bool) -> None:
    """Load a checkpoint's (single-process layout) model and optimiser state."""
    if not (d.enabled and fsdp):
        model.load_state_dict(model_sd)
        opt.load_state_dict(opt_sd)
        return
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)
    names = [name for name, _ in model.named_parameters()]
    fqn = {"state": {names[i]: s for i, s in opt_sd["state"].items()},
           "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in opt_sd["param_groups"]]}
    opts = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, model_sd, options=opts)
    set_optimizer_state_dict(model, opt, fqn, options=opts)


def plain_model(model: torch.nn.Module, weights: dict, d: Dist, fsdp: bool) -> torch.nn.Module:
    """The model as one plain module holding `weights` (model_state's full state dict):
    the model itself unless it is sharded, else a copy built on those CPU tensors."""
    if not (d.enabled and fsdp):
        return model
    with torch.device("meta"):
        plain = type(model)(model.cfg)
    plain.load_state_dict(weights, assign=True)
    return plain


def rng_state(device: torch.device) -> dict:
    return {"cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and state.get("cuda") is not None:
        torch.cuda.set_rng_state(state["cuda"], device)
