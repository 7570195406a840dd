"""Linear cross-entropy: mean CE of logits = x @ W.T, without a [tokens, vocab] logit tensor.

`linear_cross_entropy` (impl "chunked", the default) walks the tokens in chunks and, when
a gradient is wanted, computes each chunk's contribution to the input and weight gradients
right in the forward pass, so no logits are kept or recomputed. Values and gradients equal
the plain `F.cross_entropy(x @ W.T, y)` (impl "plain") up to float rounding
(tests/test_objective.py, tests/test_equivalence.py).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _exp_floor(dtype: torch.dtype) -> float:
    """A floor for the softmax exponents (logit minus row max): half the log of the smallest
    normal float (-43.7 in fp32, -354 in fp64).

    Below it, probabilities (and the gradient terms built from them) would reach subnormal
    floats, which x86 CPUs process at a small fraction of normal speed, in the exp kernel and
    above all in the two gradient matmuls: training steps ran 7x slower at init, where N(0,1)
    tied embeddings give logits of standard deviation sqrt(d). Each floored probability
    moves by less than exp(floor) (1e-19 in fp32, against a total of 1), so the loss and
    its gradients are unchanged at the dtype's rounding level (tests/test_equivalence.py)."""
    return 0.5 * math.log(torch.finfo(dtype).tiny)


def _softmax_rows_(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: logits [c, V] -> unnormalised exp(logits - rowmax); returns the row sums
    [c, 1] and the row logsumexp [c]."""
    m = logits.amax(dim=1, keepdim=True)
    torch.sub(logits, m, out=logits).clamp_min_(_exp_floor(logits.dtype)).exp_()
    sumexp = logits.sum(dim=1, keepdim=True)
    return sumexp, (m + sumexp.log()).squeeze(1)


class _Blocks:
    """One reusable [chunk, V] block (plus a low-precision twin under bf16/fp16), so the
    chunk loop allocates (and page-faults) the block once per call, not once per chunk."""

    def __init__(self, x: torch.Tensor, weight: torch.Tensor, chunk: int, acc: torch.dtype):
        rows = min(chunk, x.shape[0])
        self.acc = torch.empty(rows, weight.shape[0], dtype=acc, device=x.device)
        self.low = None if x.dtype == acc else torch.empty(rows, weight.shape[0], dtype=x.dtype,
                                                           device=x.device)

    def logits(self, xc: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
        c = xc.shape[0]
        if self.low is None:
            return torch.mm(xc, wt, out=self.acc[:c])
        return self.acc[:c].copy_(torch.mm(xc, wt, out=self.low[:c]))

    def cast(self, block: torch.Tensor) -> torch.Tensor:
        return block if self.low is None else self.low[:block.shape[0]].copy_(block)


def _chunked_ce(x, weight, targets, chunk, need_x=False, need_w=False):
    """sum_i CE(x_i @ W.T, y_i) one [chunk, V] block at a time, with the input and weight
    gradients of that sum where asked (each block turned in place into softmax - onehot)."""
    acc = torch.promote_types(x.dtype, torch.float32)  # softmax in fp32 (fp64 stays fp64)
    total = torch.zeros((), dtype=acc, device=x.device)
    grad_x = torch.empty(x.shape, dtype=x.dtype, device=x.device) if need_x else None
    grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
    blocks, wt = _Blocks(x, weight, chunk, acc), weight.t()
    for s in range(0, x.shape[0], chunk):
        xc, yc = x[s:s + chunk], targets[s:s + chunk, None]
        logits = blocks.logits(xc, wt)
        tgt = logits.gather(1, yc).squeeze(1)
        sumexp, lse = _softmax_rows_(logits)
        total += (lse - tgt).sum()
        if not (need_x or need_w):  # evaluation: the loss only
            continue
        logits.div_(sumexp).scatter_add_(1, yc, logits.new_full(yc.shape, -1.0))  # softmax - onehot
        g = blocks.cast(logits)
        if need_x:
            torch.mm(g, weight, out=grad_x[s:s + chunk])
        if need_w:
            if g.dtype == acc:
                grad_w.addmm_(g.t(), xc)
            else:
                grad_w += (g.t() @ xc).to(acc)
    return total, grad_x, grad_w


class _ChunkedLinearCE(torch.autograd.Function):
    """mean_i CE(x_i @ W.T, y_i), chunked over tokens, gradients computed in the forward pass.

    Each [chunk, V] logit block is built once: the forward turns it in place into
    softmax - onehot (the gradient of the summed CE w.r.t. the logits) and immediately
    contracts it into grad_x (rows of the chunk) and grad_w (accumulated). Only these two
    small tensors ([n, d] and [V, d]) are kept for backward, which just scales them by
    grad_out / n. So the head costs the 3 matmuls of forward + backward (no recomputation)
    and one [chunk, V] block (reused across chunks) is the only vocabulary-sized tensor."""

    @staticmethod
    def forward(ctx, x, weight, targets, chunk):
        total, grad_x, grad_w = _chunked_ce(x, weight, targets, chunk, *ctx.needs_input_grad[:2])
        ctx.save_for_backward(grad_x, grad_w)
        ctx.n, ctx.w_dtype = x.shape[0], weight.dtype
        return total / ctx.n

    @staticmethod
    def backward(ctx, grad_out):
        grad_x, grad_w = ctx.saved_tensors
        gx = gw = None
        if grad_x is not None:
            gx = grad_x * (grad_out / ctx.n).to(grad_x.dtype)
        if grad_w is not None:
            gw = (grad_w * (grad_out / ctx.n).to(grad_w.dtype)).to(ctx.w_dtype)
        return gx, gw, None, None


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         impl: str = "chunked", chunk_tokens: int = 4096) -> torch.Tensor:
    """Mean cross-entropy of logits = x @ weight.T against targets, over all leading dims."""
    x = x.reshape(-1, x.shape[-1])
    targets = targets.reshape(-1)
    if impl == "plain":
        logits = F.linear(x, weight)  # softmax in fp32 at least (fp64 stays fp64)
        return F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)), targets)
    if torch.is_autocast_enabled(x.device.type):  # match autocast's matmul dtype, then leave it
        dtype = torch.get_autocast_dtype(x.device.type)
        x, weight = x.to(dtype), weight.to(dtype)
    with torch.autocast(x.device.type, enabled=False):
        if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
            return _ChunkedLinearCE.apply(x, weight, targets, chunk_tokens)
        return _chunked_ce(x, weight, targets, chunk_tokens)[0] / x.shape[0]
