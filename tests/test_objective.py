"""Losses and the norm penalty follow their formulas; the chunked CE equals the plain one."""
import pytest
import torch
import torch.nn.functional as F

from loopscale.config import ObjectiveConfig, preset
from loopscale.model import LoopedLM
from loopscale.linear_ce import linear_cross_entropy
from loopscale.objective import compute_loss


def setup(readout="rmsnorm", **obj):
    cfg = preset("smoke", {"model": {"readout": readout, "dropout": 0.0}})
    torch.manual_seed(0)
    model = LoopedLM(cfg.model)
    idx = torch.randint(0, cfg.model.vocab_size, (3, cfg.model.seq_len))
    tgt = torch.randint(0, cfg.model.vocab_size, (3, cfg.model.seq_len))
    return model, idx, tgt, ObjectiveConfig(**obj)


def plain_exit_ce(model, states, tgt):
    K = len(states)
    return [F.cross_entropy(model.logits(h, final=k == K - 1).flatten(0, 1), tgt.flatten())
            for k, h in enumerate(states)]


@pytest.mark.parametrize("readout", ["rmsnorm", "raw", "final_norm"])
def test_per_loop_is_the_mean_of_exit_ces(readout):
    model, idx, tgt, obj = setup(readout, loss="per_loop")
    states = model(idx)
    out = compute_loss(model, states, tgt, obj)
    ref = torch.stack(plain_exit_ce(model, states, tgt))
    torch.testing.assert_close(out.ce, ref.detach())
    torch.testing.assert_close(out.total, ref.mean())


def test_terminal_uses_only_the_last_exit():
    model, idx, tgt, obj = setup(loss="terminal")
    states = model(idx)
    out = compute_loss(model, states, tgt, obj)
    torch.testing.assert_close(out.total, plain_exit_ce(model, states, tgt)[-1])
    # gradient reaches earlier exits only through the recurrence, never through their readout
    g = torch.autograd.grad(out.total, states[0], retain_graph=True)[0]
    g_direct = torch.autograd.grad(out.total, states[-1])[0]
    assert g.abs().sum() > 0 and g_direct.abs().sum() > 0


@pytest.mark.parametrize("loss", ["terminal", "per_loop"])
def test_norm_penalty_formula(loss):
    model, idx, tgt, _ = setup()
    states = model(idx)
    base = compute_loss(model, states, tgt, ObjectiveConfig(loss=loss)).total
    lam = 0.37
    pen = compute_loss(model, states, tgt, ObjectiveConfig(loss=loss, regularizer="norm_penalty",
                                                            penalty_weight=lam)).total
    expected = lam * torch.stack([(h ** 2).mean() for h in states]).mean()  # all K loops
    torch.testing.assert_close(pen - base, expected)


def test_reported_norm_is_mean_per_token_l2():
    model, idx, tgt, obj = setup()
    states = model(idx)
    out = compute_loss(model, states, tgt, obj)
    ref = torch.stack([torch.sqrt((h ** 2).sum(-1)).mean() for h in states])
    torch.testing.assert_close(out.norms, ref.detach())


@pytest.mark.parametrize("chunk", [1, 7, 64, 10_000])
def test_chunked_ce_equals_plain_in_value_and_gradient(chunk):
    torch.manual_seed(1)
    x = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(97, 16, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 97, (50,))
    a = linear_cross_entropy(x, w, y, "chunked", chunk)
    gx, gw = torch.autograd.grad(a * 3.0, (x, w))
    b = F.cross_entropy(x @ w.t(), y)
    rx, rw = torch.autograd.grad(b * 3.0, (x, w))
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(gx, rx)
    torch.testing.assert_close(gw, rw)
