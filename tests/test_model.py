"""The looped LM: readout scale invariance, shared weights, loop mechanics."""
import pytest
import torch

from loopscale.config import preset
from loopscale.model import LoopedLM, count_params


def tiny(**model):
    cfg = preset("smoke", {"model": {"dropout": 0.0, **model}})
    torch.manual_seed(0)
    return LoopedLM(cfg.model).eval(), cfg


def test_paper_parameter_counts():
    # the paper reports ~43.9M and ~128.8M parameters
    assert round(count_params(preset("paper-44m").model) / 1e6, 1) == 43.9
    assert round(count_params(preset("paper-129m").model) / 1e6, 1) == 128.8


@pytest.mark.parametrize("readout", ["rmsnorm", "layernorm"])
@pytest.mark.parametrize("alpha", [1e-2, 0.5, 10.0, 1e3])
def test_scale_invariant_readouts(readout, alpha):
    model, _ = tiny(readout=readout)
    # states of looped models have per-channel RMS >= 1 (N(0,1) embeddings); invariance holds
    # up to the norm's eps (1e-6 against the mean square), so test from RMS 10 down to 0.1
    h = torch.randn(2, 5, model.cfg.d_model) * 10
    torch.testing.assert_close(model.logits(h * alpha), model.logits(h), rtol=1e-4, atol=1e-4)


def test_raw_readout_sees_scale():
    model, _ = tiny(readout="raw")
    h = torch.randn(2, 5, model.cfg.d_model)
    torch.testing.assert_close(model.logits(h * 10.0), model.logits(h) * 10.0, rtol=1e-5, atol=1e-4)
    assert not torch.allclose(model.logits(h * 10.0), model.logits(h))


def test_final_norm_is_raw_before_the_last_loop():
    model, _ = tiny(readout="final_norm")
    h = torch.randn(2, 5, model.cfg.d_model)
    torch.testing.assert_close(model.readout(h, final=False), h)
    torch.testing.assert_close(model.readout(h, final=True), model.readout_norm(h))
    torch.testing.assert_close(model.logits(7 * h, final=True), model.logits(h, final=True), rtol=1e-4, atol=1e-4)


def test_inter_loop_norm_removes_scale_from_the_recurrence():
    model, _ = tiny(recurrence="inter_loop_norm")
    x = torch.randn(2, 5, model.cfg.d_model)

    def next_loop(h):  # what loop k+1 computes from the read-out state H_k
        h = model.loop_norm(h)
        for block in model.blocks:
            h = block(h)
        return h
    torch.testing.assert_close(next_loop(x * 100.0), next_loop(x), rtol=1e-4, atol=1e-4)
    # the residual recurrence does not forget the scale
    res, _ = tiny()
    h1 = x
    for block in res.blocks:
        h1 = block(h1)
    h100 = x * 100.0
    for block in res.blocks:
        h100 = block(h100)
    assert not torch.allclose(h100, h1, rtol=1e-2, atol=1e-2)


def test_weights_are_shared_across_loops():
    counts = {K: count_params(preset("smoke", {"model": {"n_loops": K}}).model) for K in (1, 4, 12)}
    assert len(set(counts.values())) == 1


def test_forward_returns_every_loop_and_runs_any_depth():
    model, cfg = tiny()
    idx = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_len))
    states = model(idx)
    assert len(states) == cfg.model.n_loops
    assert all(s.shape == (2, cfg.model.seq_len, cfg.model.d_model) for s in states)
    deeper = model(idx, n_loops=3 * cfg.model.n_loops)
    assert len(deeper) == 3 * cfg.model.n_loops
    for a, b in zip(states, deeper):  # the first K loops of a deeper pass are the same
        torch.testing.assert_close(a, b)


def test_states_are_before_any_normalisation():
    model, cfg = tiny(recurrence="inter_loop_norm")
    idx = torch.randint(0, cfg.model.vocab_size, (1, 8))
    x = model.tok_emb(idx) + model.pos_emb(torch.arange(8))
    for block in model.blocks:
        x = block(x)
    torch.testing.assert_close(model(idx, n_loops=1)[0], x)


def test_paper_init_has_unit_embeddings_and_tied_head():
    model, _ = tiny()
    assert 0.9 < model.tok_emb.weight.std().item() < 1.1  # PyTorch default N(0, 1)
    assert model.head_weight is model.tok_emb.weight
    gpt2, _ = tiny(init="gpt2")
    assert gpt2.tok_emb.weight.std().item() < 0.03
