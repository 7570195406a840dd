"""train.train_step: the one training step, shared by `loopscale train` and `loopscale bench`."""
import torch

from loopscale import bench
from loopscale.config import preset
from loopscale.train import build, train_step


def setup(**train):
    cfg = preset("smoke", {"train": train})
    torch.manual_seed(0)
    model, opt, fwd = build(cfg, torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_len), generator=g)
    y = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_len), generator=g)
    return cfg, model, opt, fwd, x, y


def params(model):
    return [p.detach().clone() for p in model.parameters()]


def test_a_step_updates_the_weights_with_clipped_gradients():
    cfg, model, opt, fwd, x, y = setup(grad_clip=1e-3)
    before = params(model)
    out = train_step(model, fwd, opt, x, y, cfg, torch.device("cpu"), all_exits=True)
    assert out.finite and out.grad_norm > 1e-3  # the norm before clipping is returned
    total = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).norm()
    assert total <= 1e-3 * (1 + 1e-5)  # gradients clipped to grad_clip before the update
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert torch.isfinite(out.loss.ce).all()  # all_exits: every exit measured


def test_a_non_finite_step_applies_no_update():
    cfg, model, opt, fwd, x, y = setup()
    with torch.no_grad():
        model.tok_emb.weight[x[0, 0]] = float("nan")
    before = params(model)
    out = train_step(model, fwd, opt, x, y, cfg, torch.device("cpu"))
    assert not out.finite
    assert all(torch.equal(a.nan_to_num(), b.nan_to_num()) for a, b in zip(before, model.parameters()))
    assert not opt.state  # AdamW never stepped


def test_the_benchmark_times_the_training_step(monkeypatch):
    calls = []

    def counting(*args, **kw):
        calls.append(1)
        return train_step(*args, **kw)
    monkeypatch.setattr(bench, "train_step", counting)
    cfg = bench.bench_config("smoke")
    r, _ = bench.bench_train(cfg, torch.device("cpu"), steps=2, warmup=1)
    assert len(calls) == 3 and len(r["step_times_s"]) == 2
