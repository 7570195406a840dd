"""Every optimised path equals the plain one: loss and all parameter gradients.

The chunked linear cross-entropy (gradients computed in its forward pass, one reused
[chunk, V] block, softmax exponents floored above the subnormal range) against
`F.cross_entropy` on K full logit tensors, for every readout x loss x regularizer x
recurrence, in float64, with chunk sizes that do not divide the token count; the
no-grad evaluation path; the bf16-autocast path against fp32; the FLOP count.
"""
import itertools

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from loopscale.config import ObjectiveConfig, preset
from loopscale.registry import LOSSES, RECURRENCES, REGULARIZERS, readouts_of
from loopscale.model import LoopedLM, flops_per_token
from loopscale.linear_ce import linear_cross_entropy
from loopscale.objective import compute_loss

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


B = 3  # sequences; smoke seq_len 32 -> 96 tokens, not a multiple of the chunk sizes below


def tiny(readout="rmsnorm", recurrence="residual", dtype=torch.float64, init="pytorch", loss="per_loop"):
    cfg = preset("smoke", {"model": {"readout": readout, "recurrence": recurrence, "dropout": 0.0,
                                     "init": init}, "objective": {"loss": loss}})  # adaptive: with the exit gate
    torch.manual_seed(0)
    model = LoopedLM(cfg.model).to(dtype)
    model.schedule(1, 2)  # TaperNorm mid-taper (gate 0.5): both of its branches reach the loss
    model.eval()  # no readout EMA updates (alpha readout, TaperNorm): every pass sees one model; dropout is 0
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, cfg.model.vocab_size, (B, cfg.model.seq_len), generator=g)
    tgt = torch.randint(0, cfg.model.vocab_size, (B, cfg.model.seq_len), generator=g)
    return model, idx, tgt


def loss_and_grads(model, idx, tgt, obj, all_exits=True):
    model.zero_grad(set_to_none=True)
    out = compute_loss(model, model(idx), tgt, obj, all_exits=all_exits)
    out.total.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


def assert_same(a, b, **tol):
    (oa, ga), (ob, gb) = a, b
    torch.testing.assert_close(oa.total, ob.total, **tol)
    torch.testing.assert_close(oa.ce, ob.ce, **tol)
    assert ga.keys() == gb.keys()
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], **tol, msg=lambda m: f"{name}: {m}")


CONDITIONS = list(itertools.product(readouts_of("looped"), LOSSES, REGULARIZERS, RECURRENCES))


@pytest.mark.parametrize("readout,loss,reg,rec", CONDITIONS)
def test_chunked_equals_plain_every_condition(readout, loss, reg, rec):
    model, idx, tgt = tiny(readout, rec, loss=loss)
    plain = loss_and_grads(model, idx, tgt, ObjectiveConfig(loss=loss, regularizer=reg, ce_impl="plain"))
    chunked = loss_and_grads(model, idx, tgt, ObjectiveConfig(loss=loss, regularizer=reg, ce_impl="chunked",
                                                              ce_chunk_tokens=7))
    assert_same(chunked, plain)
    # every parameter that the loss reaches gets a gradient (the tied head included)
    assert "tok_emb.weight" in chunked[1] and all(g.abs().sum() > 0 for g in chunked[1].values())


@pytest.mark.parametrize("chunk", [1, 5, 32, 95, 96, 97, 4096])
def test_chunk_sizes_including_non_divisors(chunk):
    model, idx, tgt = tiny("raw")
    plain = loss_and_grads(model, idx, tgt, ObjectiveConfig(ce_impl="plain"))
    chunked = loss_and_grads(model, idx, tgt, ObjectiveConfig(ce_chunk_tokens=chunk))
    assert_same(chunked, plain)


def test_terminal_without_all_exits_and_no_grad_exits():
    """Terminal CE: exits outside the loss are measured without grad (forward-only path)."""
    model, idx, tgt = tiny()
    obj = ObjectiveConfig(loss="terminal", ce_chunk_tokens=10)
    (o1, g1), (o2, g2) = (loss_and_grads(model, idx, tgt, obj, all_exits=a) for a in (True, False))
    torch.testing.assert_close(o1.total, o2.total)
    assert torch.isnan(o2.ce[:-1]).all() and torch.isfinite(o1.ce).all()
    for n in g1:
        torch.testing.assert_close(g1[n], g2[n])
    plain = loss_and_grads(model, idx, tgt, ObjectiveConfig(loss="terminal", ce_impl="plain"))
    torch.testing.assert_close(o1.ce, plain[0].ce)


@pytest.mark.parametrize("scale", [1.0, 30.0])
def test_forward_only_and_input_only_gradient(scale):
    """Evaluation (no grad) and the radial diagnostic (gradient w.r.t. the input only)."""
    torch.manual_seed(2)
    x = (torch.randn(45, 16, dtype=torch.float64) * scale).requires_grad_(True)
    w = torch.randn(300, 16, dtype=torch.float64)
    y = torch.randint(0, 300, (45,))
    ref = F.cross_entropy(x @ w.t(), y)
    with torch.no_grad():
        torch.testing.assert_close(linear_cross_entropy(x, w, y, chunk_tokens=8), ref)
    with torch.inference_mode():
        torch.testing.assert_close(linear_cross_entropy(x, w, y, chunk_tokens=8), ref)
    (gx,) = torch.autograd.grad(linear_cross_entropy(x, w, y, chunk_tokens=8), x)
    (rx,) = torch.autograd.grad(ref, x)
    torch.testing.assert_close(gx, rx)


def test_large_logits_fp32_exact_and_no_subnormals():
    """Logits with std ~60 (rows spanning far below exp's normal range): the floored softmax
    still matches the plain CE in fp32, and the gradient holds no subnormal floats."""
    torch.manual_seed(3)
    x = torch.randn(64, 64, requires_grad=True)
    w = (torch.randn(500, 64) * 7.5).requires_grad_(True)
    y = torch.randint(0, 500, (64,))
    a = linear_cross_entropy(x, w, y, chunk_tokens=24)
    ga = torch.autograd.grad(a, (x, w))
    b = F.cross_entropy(x @ w.t(), y)  # plain fp32
    gb = torch.autograd.grad(b, (x, w))
    c = F.cross_entropy(x.double() @ w.double().t(), y)  # fp64 reference
    gc = torch.autograd.grad(c, (x, w))
    torch.testing.assert_close(a, b)
    for u, v, r in zip(ga, gb, gc):
        torch.testing.assert_close(u, v, rtol=1e-4, atol=1e-5)
        # no further from fp64 than the plain fp32 computation (up to rounding)
        assert (u.double() - r).norm() <= 2 * (v.double() - r).norm() + 1e-6
        assert not ((u != 0) & (u.abs() < torch.finfo(u.dtype).tiny)).any()


def test_backward_twice_with_retained_graph():
    torch.manual_seed(4)
    x = torch.randn(20, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(50, 8, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 50, (20,))
    loss = linear_cross_entropy(x, w, y, chunk_tokens=6) * 2.5
    g1 = torch.autograd.grad(loss, (x, w), retain_graph=True)
    g2 = torch.autograd.grad(loss, (x, w))
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("loss", LOSSES)
def test_bf16_autocast_agrees_with_fp32(loss):
    """The CPU bf16-autocast training path (chunked CE in bf16 matmuls, fp32 softmax) agrees
    with fp32 within bf16 tolerance, in loss and in every parameter gradient."""
    model, idx, tgt = tiny("rmsnorm", dtype=torch.float32, init="gpt2", loss=loss)
    obj = ObjectiveConfig(loss=loss, regularizer="norm_penalty", ce_chunk_tokens=40)
    ref_out, ref_g = loss_and_grads(model, idx, tgt, ObjectiveConfig(loss=loss, regularizer="norm_penalty",
                                                                      ce_impl="plain"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model.zero_grad(set_to_none=True)
        out = compute_loss(model, model(idx), tgt, obj)
    out.total.backward()
    torch.testing.assert_close(out.total, ref_out.total, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.ce, ref_out.ce, rtol=2e-2, atol=2e-2)
    for name, p in model.named_parameters():
        g, r = p.grad, ref_g[name]
        assert g.dtype == torch.float32  # fp32 master weights get fp32 gradients
        rel = (g - r).norm() / r.norm()
        assert rel < 5e-2, f"{name}: relative gradient error {rel:.3g} under bf16 autocast"


def test_flops_per_token_matches_counted_matmuls():
    """model.flops_per_token = counted projection and head matmul FLOPs + causal attention."""
    cfg = preset("smoke", {"model": {"dropout": 0.0}})
    m, mc = LoopedLM(cfg.model).eval(), cfg.model
    idx = torch.randint(0, mc.vocab_size, (2, mc.seq_len))
    with FlopCounterMode(display=False) as fc, torch.no_grad():
        states = m(idx)
        for k, h in enumerate(states):
            F.linear(m.readout(h, k == len(states) - 1), m.head_weight)
    counted = sum(v for op, v in fc.get_flop_counts()["Global"].items() if "mm" in str(op))
    attention = mc.n_loops * mc.n_layers * 2 * mc.seq_len * mc.d_model * idx.numel()  # causal: half of 4·T·d
    assert flops_per_token(mc) * idx.numel() == counted + attention
    # terminal CE: one readout
    head = 2 * mc.d_model * mc.vocab_size
    assert flops_per_token(mc, n_readouts=1) == flops_per_token(mc) - (mc.n_loops - 1) * head


@pytest.mark.parametrize("recurrence", RECURRENCES)
def test_activation_checkpointing_is_exact_with_dropout(recurrence):
    """checkpoint_blocks recomputes every block in backward, replaying its dropout masks."""
    cfg = preset("smoke", {"model": {"recurrence": recurrence, "dropout": 0.2}})
    torch.manual_seed(0)
    model = LoopedLM(cfg.model).double().train()
    idx, tgt = torch.randint(0, 2048, (2, 32)), torch.randint(0, 2048, (2, 32))
    obj = ObjectiveConfig(regularizer="norm_penalty", ce_chunk_tokens=9)
    runs = []
    for ckpt in (False, True):
        model.checkpoint_blocks = ckpt
        torch.manual_seed(5)
        runs.append(loss_and_grads(model, idx, tgt, obj))
    assert_same(runs[1], runs[0], rtol=0, atol=0)
    model.eval()
    reference = model(idx)[-1].detach()
    model.checkpoint_blocks = True

    def refuse(*args, **kw):
        raise AssertionError("checkpoint() called without grad")
    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:  # no checkpointing without grad:
        mp.setattr("loopscale.model.checkpoint", refuse)       # evaluation is untouched
        torch.testing.assert_close(model(idx)[-1], reference, rtol=0, atol=0)


def _inplace_addmm_flops(c, a, b, **kw):  # FlopCounterMode counts addmm, not the in-place addmm_
    return 2 * a[0] * a[1] * b[1]


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("ce_impl", ["chunked", "plain"])
def test_bench_flop_count_equals_the_training_steps_counted_matmuls(loss, ce_impl):
    """bench.flop_count (train = 3 x forward; the head once per readout in the loss; no
    recomputation by the chunked CE) against torch's FlopCounterMode on one real train_step:
    every matmul of forward and backward; attention (SDPA, not counted by torch on CPU) by
    hand: causal QK^T and AV, forward 2·T·d per token and layer, backward twice that."""
    from loopscale.bench import bench_config, flop_count
    from loopscale.train import build, train_step
    cfg = bench_config("smoke", {"objective": {"loss": loss, "ce_impl": ce_impl, "ce_chunk_tokens": 40},
                                 "model": {"dropout": 0.0}})
    m, cpu = cfg.model, torch.device("cpu")
    torch.manual_seed(0)
    model, opt, fwd = build(cfg, cpu)
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, m.vocab_size, (2, m.seq_len), generator=g) for _ in range(2))
    with FlopCounterMode(display=False, custom_mapping={torch.ops.aten.addmm_: _inplace_addmm_flops}) as fc:
        assert train_step(model, fwd, opt, x, y, cfg, cpu).finite
    counted = sum(fc.get_flop_counts()["Global"].values())
    attention = 3 * m.n_loops * m.n_layers * 2 * m.seq_len * m.d_model * x.numel()
    assert flop_count(cfg)["train_per_token"] * x.numel() == counted + attention


def test_bench_runs_every_part_at_smoke_size():
    """`loopscale bench` end to end (memory subprocesses aside): one eval row per depth, the summary."""
    from loopscale.bench import bench_config, run_bench, summary
    cfg = bench_config("smoke")
    r = run_bench(cfg, steps=2, warmup=1, eval_batches=1, eval_warmup=0, memory=False, device="cpu",
                  threads=1, log=lambda s: None)
    assert len(r["train"]["step_times_s"]) == 2 and 0 < r["train"]["mfu"] < 1
    assert [d["k"] for d in r["eval"]["depth"]] == list(range(1, cfg.model.n_loops + 1))
    assert "MFU" in summary(r)
