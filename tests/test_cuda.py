"""The GPU paths: bf16 autocast, the fused attention kernels, torch.compile, KV-cached
generation, a checkpoint moved from GPU to CPU, and the memory of a paper-44m step.

Every test here is marked `cuda` and skipped where `torch.cuda.is_available()` is false, so
the suite passes on a CPU machine; on a GPU run them with

    PYTHONPATH=src python -m pytest -m cuda tests/test_cuda.py

(`benchmarks/gpu_check.py` runs them as its part b). The CPU counterparts that already exist
are not repeated here: the CPU bf16 path and the FLOP count (tests/test_equivalence.py),
KV-cached generation on CPU (tests/test_generate.py), the artifact round trip on CPU
(tests/test_artifacts.py).

References run in fp32 with TF32 off (`exact_fp32`), so a tolerance states the error of the
path under test alone.
"""
import math

import pytest
import torch

from loopscale.config import preset
from loopscale.model import LoopedLM, count_params

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def exact_fp32():
    """TF32 off while a test runs (fp32 references are then true fp32), restored after."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old
    torch.cuda.empty_cache()


def small_cfg(**over):
    """The paper's block at a quick size: d 256, 4 layers, 4 heads of 64 (a head size every
    fused kernel takes), SwiGLU 1024, vocabulary 4096, seq 128, K 4, per-loop CE."""
    model = dict(vocab_size=4096, d_model=256, n_layers=4, n_heads=4, d_ff=1024, seq_len=128, n_loops=4,
                 dropout=0.0)
    model.update(over.pop("model", {}))
    return preset("paper-44m", {"model": model, "data": {"vocab_size": model["vocab_size"]},
                                "objective": {"loss": "per_loop"}, "train": {"batch_size": 8}, **over})


def batch(cfg, B=None, seed=1):
    g = torch.Generator().manual_seed(seed)
    B = B or cfg.train.batch_size
    x = torch.randint(0, cfg.model.vocab_size, (B, cfg.model.seq_len), generator=g)
    y = torch.randint(0, cfg.model.vocab_size, (B, cfg.model.seq_len), generator=g)
    return x.to(CUDA), y.to(CUDA)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ in float64."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# ---------------------------------------------------------------------------
# bf16 autocast
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("readout", ["rmsnorm", "raw"])
def test_bf16_autocast_training_step_agrees_with_fp32(readout):
    """One training step (train.train_step: autocast forward, objective, backward, clipping,
    AdamW) with precision bf16 against the same step in fp32, from the same weights and batch.

    Tolerances: bf16 keeps 8 significant bits (relative rounding 2^-9 ≈ 2e-3 per operation);
    over 4 loops x 4 layers the errors add up to about 1e-2 relative, so the loss and every
    exit's CE must agree to 2e-2 relative and each parameter's gradient (the clipped one the
    optimiser used) to 5e-2 relative in norm; the fp32 master weights get fp32 gradients."""
    from loopscale.train import build, train_step
    out = {}
    for precision in ("fp32", "bf16"):
        cfg = small_cfg(model={"readout": readout}, train={"batch_size": 8, "precision": precision})
        torch.manual_seed(0)
        model, opt, fwd = build(cfg, CUDA)
        x, y = batch(cfg)
        step = train_step(model, fwd, opt, x, y, cfg, CUDA)
        assert step.finite
        out[precision] = (step.loss, {n: p.grad.detach().clone() for n, p in model.named_parameters()})
    (ref, ref_g), (got, got_g) = out["fp32"], out["bf16"]
    assert math.isfinite(ref.total.item()) and ref.total.item() > 0
    assert abs(got.total.item() - ref.total.item()) <= 2e-2 * abs(ref.total.item())
    torch.testing.assert_close(got.ce, ref.ce, rtol=2e-2, atol=0.0)
    assert ref_g.keys() == got_g.keys()
    for name, g in got_g.items():
        assert g.dtype == torch.float32, f"{name}: gradient in {g.dtype}, want fp32 master gradients"
        err = rel_err(g, ref_g[name])
        assert err < 5e-2, f"{name}: relative gradient error {err:.3g} under bf16 autocast"


# ---------------------------------------------------------------------------
# fused attention kernels
# ---------------------------------------------------------------------------
def _sdpa_cases():
    from torch.nn.attention import SDPBackend
    return [("flash", [SDPBackend.FLASH_ATTENTION], torch.bfloat16),
            ("efficient", [SDPBackend.EFFICIENT_ATTENTION], torch.bfloat16),
            ("efficient-fp32", [SDPBackend.EFFICIENT_ATTENTION], torch.float32),
            ("cudnn", [SDPBackend.CUDNN_ATTENTION], torch.bfloat16)]


@pytest.mark.parametrize("case", range(4), ids=["flash", "efficient", "efficient-fp32", "cudnn"])
def test_fused_attention_gives_the_logits_of_the_math_path(case):
    """The model's forward (every exit's logits) through one fused SDPA kernel, forced with
    torch.nn.attention.sdpa_kernel (a kernel that cannot run raises: the fused path really
    ran), against the math kernel in the same dtype. Tolerances: fp32 kernels differ in
    summation order only, 1e-4 relative (the math reference in fp32 without TF32); bf16
    kernels round the attention inputs and outputs to bf16 where the math path keeps part of
    the softmax in fp32, 2e-2 relative over 16 block applications."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    name, backends, dtype = _sdpa_cases()[case]
    if name == "flash" and torch.cuda.get_device_capability()[0] < 8:
        pytest.skip("flash attention needs sm80+")
    cfg = small_cfg()
    torch.manual_seed(0)
    model = LoopedLM(cfg.model).to(CUDA).eval()
    x, _ = batch(cfg, B=4)

    def logits(which):
        with torch.no_grad(), sdpa_kernel(which), torch.autocast("cuda", dtype=torch.bfloat16,
                                                                  enabled=dtype == torch.bfloat16):
            states = model(x)
            return torch.stack([model.logits(h, final=k == len(states) - 1, k=k + 1).float()
                                for k, h in enumerate(states)])

    ref = logits([SDPBackend.MATH])
    try:
        got = logits(backends)
    except RuntimeError as e:  # "No available kernel": this GPU/build lacks the kernel
        if name == "cudnn":
            pytest.skip(f"cuDNN attention not available here: {str(e).splitlines()[0][:120]}")
        raise
    err = rel_err(got, ref)
    assert err < (1e-4 if dtype == torch.float32 else 2e-2), f"{name}: relative logit error {err:.3g}"
    # the next-token choice agrees almost everywhere (near-ties may flip under bf16 rounding)
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > (0.999 if dtype == torch.float32 else 0.97)


# ---------------------------------------------------------------------------
# torch.compile (train.compile)
# ---------------------------------------------------------------------------
def test_train_compile_gives_the_steps_of_eager():
    """`train.compile: true` (train.build wraps the model in torch.compile) against eager:
    three training steps from the same weights on the same batches, fp32 without TF32. The
    compiled graph fuses and reorders fp32 arithmetic only, so the losses agree to 1e-4
    relative at every step and the first step's gradients to 1e-3 relative per parameter."""
    from torch._dynamo.utils import counters
    from loopscale.train import build, train_step
    torch._dynamo.reset()
    counters.clear()
    runs = {}
    for compiled in (False, True):
        cfg = small_cfg(model={"dropout": 0.0}, train={"batch_size": 4, "precision": "fp32", "compile": compiled})
        torch.manual_seed(0)
        model, opt, fwd = build(cfg, CUDA)
        assert (fwd is not model) == compiled  # the compiled wrapper is what the step calls
        losses, grads = [], None
        for s in range(3):
            x, y = batch(cfg, seed=10 + s)
            step = train_step(model, fwd, opt, x, y, cfg, CUDA)
            assert step.finite
            losses.append(step.loss.ce.clone())
            if s == 0:
                grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        runs[compiled] = (torch.stack(losses), grads)
    (eager_l, eager_g), (comp_l, comp_g) = runs[False], runs[True]
    assert counters["stats"]["unique_graphs"] >= 1  # dynamo did compile the forward
    torch.testing.assert_close(comp_l, eager_l, rtol=1e-4, atol=0.0)
    for name, g in comp_g.items():
        err = rel_err(g, eager_g[name])
        assert err < 1e-3, f"{name}: compiled gradient differs from eager by {err:.3g} relative"


# ---------------------------------------------------------------------------
# KV-cached generation
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("readout", ["rmsnorm", "raw"])
def test_kv_cached_decoding_equals_full_recompute_at_every_depth(readout):
    """On the GPU, for every depth k = 1..2K: the logits of KV-cached decoding (prompt in one
    call, then one token per call: generate.Decoder) equal re-running the whole context at
    depth k, at every position; greedy generation with and without the cache gives the same
    tokens. fp32 without TF32: the two differ in matmul shapes only, 1e-4 relative."""
    from loopscale.generate import Decoder, generate
    cfg = small_cfg(model={"readout": readout, "seq_len": 48, "vocab_size": 2048})
    torch.manual_seed(0)
    model = LoopedLM(cfg.model).to(CUDA).eval()
    T, P = 40, 8
    ids = torch.randint(4, cfg.model.vocab_size, (1, T), generator=torch.Generator().manual_seed(3)).to(CUDA)
    for k in range(1, 2 * cfg.model.n_loops + 1):
        with torch.no_grad():
            full = model.logits(model(ids, n_loops=k)[-1], final=True)[0].float()  # [T, V]
            dec = Decoder(model, k)
            got = [dec(ids[:, :P])[0]] + [dec(ids[:, t:t + 1])[0] for t in range(P, T)]
        assert all(len(c) == T for loop in dec.caches for c in loop)
        err = rel_err(torch.stack(got), full[P - 1:])
        assert err < 1e-4, f"depth {k}: cached logits differ from the full forward by {err:.3g}"
        prompt = ids[0, :P].tolist()
        cached = generate(model, prompt, 16, n_loops=k)
        assert cached.tokens == generate(model, prompt, 16, n_loops=k, use_cache=False).tokens, f"depth {k}"


# ---------------------------------------------------------------------------
# a checkpoint written on the GPU, read on the CPU
# ---------------------------------------------------------------------------
def _tokenizer_json(vocab_size: int) -> bytes:
    """A word-level tokenizer with loopscale's special ids 0..3 and fewer ids than the model."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    words = ["<pad>", "<bos>", "<eos>", "<unk>"] + [f"w{i}" for i in range(vocab_size // 2)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok.to_str().encode()


def test_a_checkpoint_written_on_the_gpu_loads_on_the_cpu_with_the_same_logits(tmp_path):
    """Train two steps on the GPU, write the run's artifact there (artifacts.write_run_files:
    model.safetensors + run record + tokenizer), load it with `loopscale.load(run, "cpu")`:
    every weight is bit-identical to the GPU model's and the CPU logits equal the GPU logits
    (fp32 without TF32: the devices' kernels differ in summation order, 1e-4 relative)."""
    from loopscale.artifacts import load, write_run_files
    from loopscale.train import build, train_step
    cfg = small_cfg(train={"batch_size": 4, "precision": "bf16"})
    torch.manual_seed(0)
    model, opt, fwd = build(cfg, CUDA)
    for s in range(2):
        x, y = batch(cfg, seed=20 + s)
        assert train_step(model, fwd, opt, x, y, cfg, CUDA).finite
    model.eval()
    write_run_files(tmp_path, model, {"config": cfg.to_dict(), "env": {}, "data": {}},
                    _tokenizer_json(cfg.model.vocab_size))
    cpu_model, tok, cpu_cfg = load(tmp_path, "cpu")
    assert cpu_cfg.to_dict() == cfg.to_dict()
    assert next(cpu_model.parameters()).device.type == "cpu"
    gpu_state = model.state_dict()
    for name, t in cpu_model.state_dict().items():
        assert torch.equal(t, gpu_state[name].cpu()), f"{name} changed on the way GPU -> CPU"
    x, _ = batch(cfg, B=2, seed=30)
    with torch.no_grad():
        gpu = torch.stack([model.logits(h, final=k == cfg.model.n_loops - 1, k=k + 1)
                           for k, h in enumerate(model(x))]).cpu()
        cpu = torch.stack([cpu_model.logits(h, final=k == cfg.model.n_loops - 1, k=k + 1)
                           for k, h in enumerate(cpu_model(x.cpu()))])
    err = rel_err(cpu, gpu)
    assert err < 1e-4, f"CPU logits of the GPU-written checkpoint differ by {err:.3g}"


# ---------------------------------------------------------------------------
# memory of one paper-44m training step
# ---------------------------------------------------------------------------
def paper44m_step_bound(cfg) -> dict:
    """An upper bound on the GPU memory one paper-44m training step may hold (bytes), from the
    parameter count and the activations a step keeps for its backward pass.

    State: P parameters in fp32 (4 B), their fp32 gradients (4 B), AdamW's two fp32 moments
    (8 B), and the bf16 copies of the weights autocast caches during the step (2 B):
    18 B x P. paper-44m: P = 43,934,208 -> 0.79 GB.

    Activations, per token and per block application, as bf16 autocast with a fused (flash /
    memory-efficient) attention kernel saves them for backward (bytes; d = 512, d_ff = 2048):
      two RMSNorms (fp32 input, normalised output)          2 x (4d + 4d) = 16 d
      their bf16 casts for the two input projections        2 x 2d        =  4 d
      fused qkv output (bf16)                               3d x 2        =  6 d
      q, k, v made contiguous by the kernel (bf16)          3d x 2        =  6 d
      attention output + its [B, T, C] re-layout (bf16)     2 x 2d        =  4 d
      the two residual sums (fp32)                          2 x 4d        =  8 d
      dropout mask on the SwiGLU output (bool)                               1 d
      SwiGLU: gate|up (bf16), silu(gate), silu·up           (2 + 1 + 1) d_ff x 2 = 8 d_ff
    = 45 d + 8 d_ff = 23,040 + 16,384 = 39,424 B per token per block application,
    x K loops x n_layers (4 x 8 = 32) x B·T tokens (64 x 256 = 16,384) = 20.67 GB.
    (An upper count: the saved tensors of the same step on the CPU, bf16 autocast and its
    flash kernel, measured with torch.autograd.graph.saved_tensors_hooks, come to 30,761 B per
    token per block without dropout.)
    The K readouts and the chunked CE: per loop and token the readout norm's input and output
    (8 d) and the CE's fp32 input gradient (4 d); per loop the fp32 [V, d] weight gradient;
    one fp32 [chunk, V] logit block: 4 x (16,384 x 12 x 512 + 20,000 x 512 x 4)
    + 4,096 x 20,000 x 4 = 0.89 GB.
    Backward transients: four [B·T, 2 d_ff] bf16 gradient buffers of the SwiGLU backward,
    4 x 16,384 x 4,096 x 2 = 0.54 GB.
    Bound = 0.79 + 20.67 + 0.89 + 0.54 = 22.89 GB. The same count with the CPU-measured
    per-block figure gives about 17.4 GB: the bound leaves ~30 % for the GPU kernels' own
    layouts and the caching allocator's rounding."""
    m, B = cfg.model, cfg.train.batch_size
    P = count_params(m)
    d, f, V, N = m.d_model, m.d_ff, m.vocab_size, B * m.seq_len
    state = 18 * P
    blocks = N * m.n_loops * m.n_layers * (45 * d + 8 * f)
    readouts = m.n_loops * (N * 12 * d + V * d * 4) + min(cfg.objective.ce_chunk_tokens, N) * V * 4
    transient = 4 * N * 2 * f * 2
    return {"params": P, "state": state, "activations": blocks + readouts,
            "bound": state + blocks + readouts + transient}


def test_paper44m_training_step_peak_memory_is_within_the_derived_bound():
    """One paper-44m training step (batch 64 x 256, K 4, per-loop CE, bf16 autocast, dropout
    0.1: the paper's setting) after a warm-up step (so gradients and AdamW state exist): the
    peak of torch.cuda.max_memory_allocated stays under `paper44m_step_bound` and above the
    state alone (parameters, gradients and AdamW moments must all be resident)."""
    from loopscale.runtime import enable_tf32
    from loopscale.train import build, train_step
    cfg = preset("paper-44m", {"objective": {"loss": "per_loop"}, "train": {"precision": "bf16"}})
    b = paper44m_step_bound(cfg)
    assert 43e6 < b["params"] < 45e6  # the paper's "44M"
    enable_tf32(CUDA)  # as training runs
    torch.manual_seed(0)
    model, opt, fwd = build(cfg, CUDA)
    x, y = batch(cfg)
    assert train_step(model, fwd, opt, x, y, cfg, CUDA).finite  # warm-up: creates grads, AdamW state
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    assert train_step(model, fwd, opt, x, y, cfg, CUDA).finite
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    gb = 1e9
    assert peak > 16 * b["params"], f"peak {peak / gb:.2f} GB is below the model state itself: not measured"
    assert peak < b["bound"], f"paper-44m step peak {peak / gb:.2f} GB exceeds the bound {b['bound'] / gb:.2f} GB"
