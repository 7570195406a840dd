"""Shared by the Ouro tests (test_ouro, test_ouro_train, test_ouro_fineweb, test_ouro_pipeline,
test_ouro_checkpoints, test_rundir, test_data): a tiny published-layout Ouro checkpoint, FineWeb-like
rows, a word-level tokenizer and data prepared with it. A helper module, not a test file."""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from loopscale import data as D
from loopscale.config import DataConfig

HF_TINY = {"architectures": ["OuroForCausalLM"], "model_type": "ouro", "hidden_size": 32, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 48,
           "vocab_size": 97, "max_position_embeddings": 512, "rope_theta": 10000.0, "rope_scaling": None,
           "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": False, "total_ut_steps": 4}


def published_tensors(hf: dict, seed: int = 0) -> dict:
    """Random tensors under the published parameter names and shapes (norm gains away from 1,
    a non-zero gate bias, so every tensor matters)."""
    g = torch.Generator().manual_seed(seed)
    d, f, V = hf["hidden_size"], hf["intermediate_size"], hf["vocab_size"]
    hd = hf["head_dim"]
    q, kv = hf["num_attention_heads"] * hd, hf["num_key_value_heads"] * hd

    def r(*shape, scale=0.2):
        return torch.randn(*shape, generator=g) * scale
    t = {"model.embed_tokens.weight": r(V, d, scale=1.0), "model.norm.weight": 1 + r(d),
         "model.early_exit_gate.weight": r(1, d), "model.early_exit_gate.bias": r(1),
         "lm_head.weight": r(V, d)}
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t.update({p + "self_attn.q_proj.weight": r(q, d), p + "self_attn.k_proj.weight": r(kv, d),
                  p + "self_attn.v_proj.weight": r(kv, d), p + "self_attn.o_proj.weight": r(d, q),
                  p + "mlp.gate_proj.weight": r(f, d), p + "mlp.up_proj.weight": r(f, d),
                  p + "mlp.down_proj.weight": r(d, f)})
        for n in ("input_layernorm", "input_layernorm_2", "post_attention_layernorm", "post_attention_layernorm_2"):
            t[p + n + ".weight"] = 1 + r(d)
    return t


def write_hf(path, hf: dict, tensors: dict, shards: int = 0):
    from safetensors.torch import save_file
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf))
    if not shards:
        save_file(tensors, str(path / "model.safetensors"))
        return path
    names = sorted(tensors)
    per = math.ceil(len(names) / shards)
    weight_map = {}
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = names[i * per:(i + 1) * per]
        save_file({k: tensors[k] for k in part}, str(path / fname))
        weight_map.update({k: fname for k in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


WORDS = [f"w{i}" for i in range(60)]


def fineweb_rows(n=40, seed=0):
    """Documents in FineWeb's schema; every fifth one too short (fewer than 50 non-blank chars)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        if i % 5 == 3:
            text = "   w1 w2 w3   \n\n   "  # 8 characters once stripped: skipped
        else:
            k = int(torch.randint(15, 40, (1,), generator=g))
            text = " ".join(WORDS[int(j)] for j in torch.randint(0, len(WORDS), (k,), generator=g))
        rows.append({"text": text, "id": f"<urn:uuid:{i:08d}>", "dump": "CC-MAIN-2024-10",
                     "url": f"https://example.org/{i}", "date": "2024-02-21T00:00:00Z",
                     "file_path": "s3://commoncrawl/x.warc.gz", "language": "en",
                     "language_score": 0.95, "token_count": len(text.split())})
    return rows


def word_tokenizer(vocab_size: int, prefix: str = "w"):
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<unk>": 3, **{f"{prefix}{i}": i + 4 for i in range(vocab_size - 4)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok


def prepared(tmp_path, name: str, tok, vocab_size: int, prefix: str = "w") -> Path:
    """A data directory tokenised with `tok` (text of its own words)."""
    g = torch.Generator().manual_seed(0)
    root = tmp_path / f"{name}-text"
    root.mkdir()
    for split in ("train", "valid"):
        ids = torch.randint(0, vocab_size - 4, (3000,), generator=g).tolist()
        (root / f"{split}.txt").write_text(" ".join(f"{prefix}{i}" for i in ids))
    dc = DataConfig(source="text-files", train_file=str(root / "train.txt"), validation_file=str(root / "valid.txt"),
                    tokenizer="word", vocab_size=vocab_size)
    D.prepare_data(dc, tmp_path / name, show_progress=False, tokenizer=tok)
    return tmp_path / name
