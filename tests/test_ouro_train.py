"""Ouro runs through loopscale's own machinery: training (every readout of the Ouro track,
the exit-gate objective), the run artifacts and `loopscale.load`, every diagnostic, and
`loopscale.load` on a Hugging Face Ouro checkpoint directory."""
import json
import math

import pytest
import torch

import loopscale
from loopscale import ouro, ouro_tools
from loopscale.config import eval_preset, preset
from loopscale.diagnostics import run_all
from loopscale.model import LoopedLM
from loopscale.objective import compute_loss
from loopscale.train import train

from ouro_support import HF_TINY, published_tensors, write_hf


def cfg(readout="rmsnorm", **objective):
    return preset("ouro-smoke", {"model": {"readout": readout},
                                 "objective": objective,
                                 "train": {"max_steps": 6, "log_every": 3, "ckpt_every": 6, "eval_tokens": 512}})


@pytest.mark.parametrize("readout", ["rmsnorm", "final_raw", "final_alpha", "per_loop_alpha"])
def test_every_ouro_readout_trains_and_loads(smoke_data, tmp_path, readout):
    s = train(cfg(readout), smoke_data, tmp_path / "run", progress=False)
    assert s["status"] == "completed", s
    model, tok, c = loopscale.load(tmp_path / "run")
    assert isinstance(model, LoopedLM) and c.model.readout == readout
    lines = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in lines if "loss" in r]
    assert losses and all(math.isfinite(x) for x in losses)
    ids = torch.tensor([tok.encode("the people of the united states").ids])
    with torch.no_grad():
        assert torch.isfinite(model.logits(model(ids)[-1])).all()


def test_adaptive_loss_trains_the_exit_gate(smoke_data, tmp_path):
    """loss=adaptive (Σ_k mean(p_k·CE_k) − w·H(p)) reads Ouro's early_exit_gate through exit_pdf."""
    c = preset("ouro-smoke", {"objective": {"loss": "adaptive", "entropy_weight": 0.05},
                              "train": {"max_steps": 6, "log_every": 3, "ckpt_every": 6, "eval_tokens": 512}})
    torch.manual_seed(0)
    from loopscale.model import build_model
    model = build_model(c.model)
    x = torch.randint(0, 512, (2, 16))
    y = torch.randint(0, 512, (2, 16))
    r = compute_loss(model, model(x), y, c.objective)
    r.total.backward()
    assert model.model.early_exit_gate.weight.grad.abs().sum() > 0  # the gate is in the loss
    pdf = model.exit_distribution(model(x))
    ce = torch.stack([torch.nn.functional.cross_entropy(model.logits(h, k == 3).flatten(0, 1), y.flatten(),
                                                        reduction="none").view(2, 16) for k, h in enumerate(model(x))], -1)
    entropy = -(pdf * pdf.log()).sum(-1)
    torch.testing.assert_close(r.total, ((pdf * ce).sum(-1) - 0.05 * entropy).mean(), rtol=1e-5, atol=1e-5)
    s = train(c, smoke_data, tmp_path / "run", progress=False)
    assert s["status"] == "completed"


def test_every_diagnostic_runs_on_an_ouro_run(smoke_data, tmp_path):
    train(cfg("per_loop_alpha"), smoke_data, tmp_path / "alpha", progress=False)  # per-step readouts need k
    res = run_all(tmp_path / "alpha" / "model.pt", smoke_data, None, progress=False,
                  eval_config=eval_preset("ouro-smoke"))
    assert {n: r["status"] for n, r in res.items()} == {n: "ok" for n in res}
    train(cfg("final_raw"), smoke_data, tmp_path / "run", progress=False)
    res = run_all(tmp_path / "run" / "model.pt", smoke_data, tmp_path / "run" / "eval", progress=False,
                  eval_config=eval_preset("ouro-smoke"))
    assert {n: r["status"] for n, r in res.items()} == {n: "ok" for n in res}
    radial = res["radial"]["loops"]
    assert [r["readout"] for r in radial] == ["rmsnorm", "rmsnorm", "rmsnorm", "raw"]
    assert radial[0]["radial_fraction"] < 1e-6  # through RMSNorm the gradient has no radial part
    assert radial[-1]["radial_fraction"] > 1e-4  # the raw step sees the scale


def test_loopscale_load_reads_a_hugging_face_ouro_directory(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    path = write_hf(tmp_path / "Ouro-tiny", HF_TINY, published_tensors(HF_TINY))
    vocab = {f"w{i}": i for i in range(HF_TINY["vocab_size"] - 1)}
    vocab["<unk>"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    model, t, c = loopscale.load(path)
    assert isinstance(model, LoopedLM) and not model.training
    assert c.model.arch == "ouro" and c.model.n_loops == 4 and c.model.d_ff == 48
    ref, _ = ouro.from_pretrained(path)
    ids = torch.tensor([t.encode("w1 w5 w9 w2").ids])
    with torch.no_grad():
        torch.testing.assert_close(model.logits(model(ids)[-1]), ref.logits(ref(ids)[-1]))


def test_every_diagnostic_runs_on_an_imported_published_checkpoint(tmp_path):
    """ouro-import: a Hugging Face Ouro directory becomes a run that `loopscale eval` reads,
    on a corpus tokenised with the checkpoint's own tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from loopscale import data as D
    from loopscale.config import DataConfig
    path = write_hf(tmp_path / "Ouro-tiny", HF_TINY, published_tensors(HF_TINY))
    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<unk>": 3, **{f"w{i}": i + 4 for i in range(HF_TINY["vocab_size"] - 4)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    g = torch.Generator().manual_seed(0)
    for split in ("train", "valid"):
        ids = torch.randint(4, HF_TINY["vocab_size"], (6000,), generator=g).tolist()
        (tmp_path / f"{split}.txt").write_text(" ".join(f"w{i - 4}" for i in ids))
    dc = DataConfig(source="text-files", train_file=str(tmp_path / "train.txt"),
                    validation_file=str(tmp_path / "valid.txt"), tokenizer="word", vocab_size=HF_TINY["vocab_size"])
    D.prepare_data(dc, tmp_path / "data", show_progress=False, tokenizer=tok)
    run = ouro_tools.import_hf(path, tmp_path / "run", seq_len=32)
    res = run_all(run / "model.pt", tmp_path / "data", None, progress=False, eval_config=eval_preset("ouro-smoke"))
    assert {n: r["status"] for n, r in res.items()} == {n: "ok" for n in res}
    ref, _ = ouro.from_pretrained(path, seq_len=32)  # the depth evaluation's exit K, recomputed by hand
    tokens = D.load_split(tmp_path / "data", "validation")
    x, y = D.get_batch(tokens, D.eval_window_starts(len(tokens), 32, eval_preset("ouro-smoke").max_tokens), 32)
    with torch.no_grad():
        ce = torch.nn.functional.cross_entropy(ref.logits(ref(x)[-1]).flatten(0, 1), y.flatten()).item()
    assert abs(res["depth"]["exits"][-1]["ce"] - ce) < 1e-4
    assert loopscale.load(run)[2].model.arch == "ouro"


@pytest.mark.parametrize("loss", ["terminal", "adaptive"])
def test_the_exit_gate_learns_only_under_its_objective(loss):
    """Without a loss that reads the gate it is frozen (DDP refuses parameters without
    gradients); loss=adaptive trains it."""
    from loopscale.train import build
    c = preset("ouro-smoke", {"objective": {"loss": loss}})
    model, _, _ = build(c, torch.device("cpu"))
    assert model.model.early_exit_gate.weight.requires_grad is (loss == "adaptive")
    assert all(p.requires_grad for n, p in model.named_parameters() if "early_exit_gate" not in n)
