"""convert-paper: a checkpoint in the paper script's layout becomes a loopscale run with equal logits."""
import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import loopscale
from loopscale.cli import main
from loopscale.convert import convert_paper
from loopscale.evaluate import load_model

D, LAYERS, HEADS, FF, SEQ, LOOPS = 32, 2, 4, 48, 16, 3
WORDS = ["<pad>", "<bos>", "<eos>", "<unk>", " ", ".", ","] + [f"w{i}" for i in range(57)]  # vocab 64


# ---- the paper's model, written from its checkpoint layout (the reference forward) ----
class PaperAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D, bias=False)  # q, k, v stacked
        self.out_proj = nn.Linear(D, D, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).split(D, dim=-1)
        q, k, v = (t.view(B, T, HEADS, D // HEADS).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-1, -2)) / (D // HEADS) ** 0.5
        att = att.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        return self.out_proj((att @ v).transpose(1, 2).reshape(B, T, D))


class PaperFFN(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(D, FF, bias=False)  # gate
        self.w3 = nn.Linear(D, FF, bias=False)  # up
        self.w2 = nn.Linear(FF, D, bias=False)  # down

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class PaperLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn_norm, self.attn = nn.RMSNorm(D, eps=1e-6), PaperAttention()
        self.ffn_norm, self.ffn = nn.RMSNorm(D, eps=1e-6), PaperFFN()

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.ffn(self.ffn_norm(x))


class PaperLM(nn.Module):
    def __init__(self, readout, loop_norm):
        super().__init__()
        self.readout, self.use_loop_norm = readout, loop_norm
        self.token_embedding = nn.Embedding(len(WORDS), D)
        self.position_embedding = nn.Embedding(SEQ, D)
        self.layers = nn.ModuleList(PaperLayer() for _ in range(LAYERS))
        self.decode_norm = nn.LayerNorm(D, eps=1e-6, bias=False) if readout == "layernorm" else nn.RMSNorm(D, eps=1e-6)
        self.loop_norm = nn.RMSNorm(D, eps=1e-6)
        self.exit_gate = nn.Linear(D, 1)  # in the script's checkpoints, unused by these conditions
        self.raw_alpha = nn.Parameter(torch.tensor(1.0))

    def forward(self, idx):
        """Logits of every exit 1..LOOPS."""
        x = self.token_embedding(idx) + self.position_embedding(torch.arange(idx.shape[1]))
        out = []
        for k in range(LOOPS):
            for layer in self.layers:
                x = layer(x)
            last = k == LOOPS - 1
            raw = self.readout == "raw" or (self.readout == "final_norm" and not last)
            out.append((x if raw else self.decode_norm(x)) @ self.token_embedding.weight.T)
            if self.use_loop_norm:
                x = self.loop_norm(x)
        return out


def _paper_checkpoint(path, readout="rmsnorm", loop_norm=False, config=None, seed=0):
    torch.manual_seed(seed)
    ref = PaperLM(readout, loop_norm)
    with torch.no_grad():  # trained-looking norms, so a mixed-up norm weight would show
        for name, p in ref.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    config = config if config is not None else {
        "model": {"d_model": D, "n_layers": LAYERS, "n_heads": HEADS, "ffn_hidden": FF, "seq_len": SEQ,
                  "vocab_size": len(WORDS), "n_loops": LOOPS, "norm_eps": 1e-6},
        "readout": readout, "loop_norm": loop_norm, "lr": 3e-4}
    torch.save({"model_state": ref.state_dict(), "config": config, "tokenizer": {w: i for i, w in enumerate(WORDS)},
                "step": 1234}, path)
    return ref


@pytest.mark.parametrize("readout,loop_norm", [("rmsnorm", False), ("raw", False), ("final_norm", False),
                                               ("layernorm", False), ("rmsnorm", True)])
def test_converted_logits_equal_the_paper_forward(tmp_path, readout, loop_norm):
    ref = _paper_checkpoint(tmp_path / "last.pt", readout, loop_norm)
    rec = convert_paper(tmp_path / "last.pt", tmp_path / "run")
    assert {"raw_alpha", "exit_gate.weight", "exit_gate.bias"} <= set(rec["dropped"])
    assert ("decode_norm.weight" in rec["dropped"]) == (readout == "raw")
    assert ("loop_norm.weight" in rec["dropped"]) == (not loop_norm)
    model, tok, cfg = loopscale.load(tmp_path / "run")
    assert (cfg.model.readout, cfg.model.recurrence, cfg.model.d_ff, cfg.model.n_heads) == (
        readout, "inter_loop_norm" if loop_norm else "residual", FF, HEADS)
    idx = torch.randint(0, len(WORDS), (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(idx)
        states = model(idx)
        got = [model.logits(h, final=k == LOOPS - 1) for k, h in enumerate(states)]
        pt_model, _, _ = load_model(tmp_path / "run" / "model.pt")  # what `loopscale eval` reads
        pt = pt_model.logits(pt_model(idx)[-1])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(pt, got[-1], atol=0, rtol=0)
    assert tok.encode("w1 w2.").ids == [WORDS.index(w) for w in ("w1", " ", "w2", ".")]
    assert json.loads((tmp_path / "run" / "special_tokens_map.json").read_text())["eos_token"] == "<eos>"


def test_missing_setting_is_one_line_naming_it(tmp_path, capsys):
    _paper_checkpoint(tmp_path / "last.pt", config={"dim": D, "num_heads": HEADS, "readout": "rmsnorm",
                                                    "recurrence": "residual"})
    assert main(["convert-paper", str(tmp_path / "last.pt"), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no n_loops" in err[0] and "--set model.n_loops" in err[0]
    assert not (tmp_path / "run").exists()
    # supplied on the command line it converts, the other settings found under their aliases
    assert main(["convert-paper", str(tmp_path / "last.pt"), "--out", str(tmp_path / "run"),
                 "--set", f"model.n_loops={LOOPS}"]) == 0
    assert "n_loops<---set" in capsys.readouterr().out
    assert loopscale.load(tmp_path / "run")[2].model.n_loops == LOOPS


def test_config_that_disagrees_with_the_weights_or_foreign_tensors_are_refused(tmp_path, capsys):
    _paper_checkpoint(tmp_path / "a.pt", config={"d_model": D + 1, "n_heads": HEADS, "n_loops": LOOPS,
                                                 "readout": "raw", "recurrence": "residual"})
    assert main(["convert-paper", str(tmp_path / "a.pt"), "--out", str(tmp_path / "r")]) == 2
    assert "d_model=33 disagrees with the weights" in capsys.readouterr().err
    ck = torch.load(tmp_path / "a.pt")
    ck["config"]["d_model"] = D
    ck["model_state"]["layers.0.attn.rope"] = torch.ones(3)
    torch.save(ck, tmp_path / "b.pt")
    assert main(["convert-paper", str(tmp_path / "b.pt"), "--out", str(tmp_path / "r")]) == 2
    assert "unexpected tensor layers.0.attn.rope" in capsys.readouterr().err
    torch.save({"state_dict": {}}, tmp_path / "c.pt")
    assert main(["convert-paper", str(tmp_path / "c.pt"), "--out", str(tmp_path / "r")]) == 2
    assert "has no 'model_state'" in capsys.readouterr().err


def test_diagnostics_run_on_a_converted_run(tmp_path, capsys):
    _paper_checkpoint(tmp_path / "last.pt")
    run = tmp_path / "run"
    assert main(["convert-paper", str(tmp_path / "last.pt"), "--out", str(run)]) == 0
    g = torch.Generator().manual_seed(2)
    for name, n in (("train.txt", 400), ("valid.txt", 200)):
        (tmp_path / name).write_text(" ".join(f"w{int(i)}" for i in torch.randint(0, 57, (n,), generator=g)) + ".\n")
    data = tmp_path / "data"
    assert main(["prepare-data", "--set", "data.source=text-files", "--set", f"data.train_file={tmp_path / 'train.txt'}",
                 "--set", f"data.validation_file={tmp_path / 'valid.txt'}", "--tokenizer", str(run / "tokenizer.json"),
                 "--out", str(data)]) == 0
    assert (data / "tokenizer.json").read_bytes() == (run / "tokenizer.json").read_bytes()
    capsys.readouterr()
    assert main(["eval", "depth", "--model", str(run / "model.pt"), "--data", str(data),
                 "--out", str(tmp_path / "depth.json"), "--set", "eval.device=cpu"]) == 0, capsys.readouterr().err
    depth = json.loads((tmp_path / "depth.json").read_text())
    assert len(depth["exits"]) == LOOPS
