"""Ouro-layout checkpoints (ouro-import, loopscale.load): shards, weights and config.json values a
damaged or hostile file can give are refused in one line; ouro-depth / ouro-scale arguments too."""
import json
import shutil
import time

import pytest
import torch
from safetensors.torch import save_file

import loopscale
from loopscale import ouro
from loopscale.cli import main
from loopscale.config import LIMITS
from loopscale.io import CheckpointError

from cli_support import refused_in_one_line as one_line_error
from ouro_support import HF_TINY, prepared, published_tensors, word_tokenizer, write_hf


# ---------------------------------------------------------------------------
# Ouro-layout checkpoints: loopscale.load, ouro-import (ouro.hf_headers, ouro.load_state)
# ---------------------------------------------------------------------------
class TestOuroCheckpoints:
    def sharded(self, tmp_path, tensors=None):
        return write_hf(tmp_path / "ckpt", HF_TINY, tensors or published_tensors(HF_TINY), shards=2)

    def index(self, path):
        return json.loads((path / ouro.HF_INDEX).read_text())

    @pytest.mark.parametrize("where", ["relative", "absolute"])
    def test_a_shard_outside_the_directory_is_refused(self, tmp_path, capsys, where):
        path = self.sharded(tmp_path)
        idx = self.index(path)
        shard = sorted(set(idx["weight_map"].values()))[-1]
        outside = tmp_path / "outside_shard"
        shutil.move(path / shard, outside)
        name = "../outside_shard" if where == "relative" else str(outside)
        idx["weight_map"] = {k: (name if v == shard else v) for k, v in idx["weight_map"].items()}
        (path / ouro.HF_INDEX).write_text(json.dumps(idx))
        with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
            loopscale.load(path)
        one_line_error(capsys, ["ouro-import", path, "--out", tmp_path / "run"], "outside the checkpoint directory")
        assert not (tmp_path / "run" / "model.pt").exists()

    def test_a_tensor_in_two_shards_is_refused(self, tmp_path, capsys):
        path = self.sharded(tmp_path)
        idx = self.index(path)
        first, second = sorted(set(idx["weight_map"].values()))
        from safetensors.torch import load_file
        a, b = load_file(str(path / first)), load_file(str(path / second))
        dup = sorted(a)[0]
        save_file({**b, dup: torch.zeros_like(a[dup])}, str(path / second))  # the later shard's copy would win
        with pytest.raises(CheckpointError, match=f"{dup} is held twice"):
            ouro.from_pretrained(path)
        one_line_error(capsys, ["ouro-import", path, "--out", tmp_path / "run"], "held twice")

    @pytest.mark.parametrize("dtype", [torch.bool, torch.int64, torch.int32])
    def test_a_non_float_weight_is_refused_not_cast(self, tmp_path, capsys, dtype):
        t = published_tensors(HF_TINY)
        t["model.norm.weight"] = torch.ones_like(t["model.norm.weight"]).to(dtype)
        path = write_hf(tmp_path / "ckpt", HF_TINY, t)
        with pytest.raises(CheckpointError, match="model.norm.weight .*not a float tensor"):
            loopscale.load(path)
        one_line_error(capsys, ["ouro-import", path, "--out", tmp_path / "run"], "not a float tensor")

    @pytest.mark.parametrize("bad", [float("nan"), float("inf")])
    def test_non_finite_weights_are_refused_naming_the_tensor(self, tmp_path, capsys, bad):
        t = published_tensors(HF_TINY)
        name = sorted(k for k in t if "mlp.up_proj" in k)[0]
        t[name][0, 0] = bad
        path = write_hf(tmp_path / "ckpt", HF_TINY, t)
        word_tokenizer(HF_TINY["vocab_size"]).save(str(path / "tokenizer.json"))
        with pytest.raises(CheckpointError, match=f"{name} holds non-finite"):
            loopscale.load(path)
        one_line_error(capsys, ["ouro-import", path, "--out", tmp_path / "run"], name)
        assert not (tmp_path / "run" / "model.pt").exists()
        one_line_error(capsys, ["generate", "--run", path, "--prompt", "w1 w2", "--max-new-tokens", "2"], name)

    def test_an_imported_run_reads_back_the_same_model(self, hf_dir, tmp_path):
        run = ouro.from_pretrained(hf_dir)[0]
        assert main(["ouro-import", str(hf_dir), "--out", str(tmp_path / "run"), "--seq-len", "32"]) == 0
        model, tok, cfg = loopscale.load(tmp_path / "run")
        assert cfg.model.arch == "ouro" and tok.get_vocab_size() == HF_TINY["vocab_size"]
        ids = torch.arange(4, 12).view(1, -1)
        with torch.no_grad():
            assert torch.allclose(model.logits(model(ids)[-1]), run.logits(run(ids)[-1]), atol=1e-5)


class TestOuroConfigs:
    CASES = {
        "string_size": ({"hidden_size": "abc"}, "hidden_size must be a whole number"),
        "fractional_size": ({"hidden_size": 32.7}, "hidden_size must be a whole number"),
        "bool_size": ({"num_hidden_layers": True}, "num_hidden_layers must be a whole number"),
        "rope_factor": ({"rope_scaling": {"rope_type": "linear", "factor": "x"}}, "rope_scaling.factor"),
        "layer_types": ({"layer_types": 5}, "layer_types must be a list"),
        "huge_vocab": ({"vocab_size": 2**31}, f"vocab_size must be a whole number in [1, {LIMITS['vocab_size']}]"),
        "many_layers": ({"num_hidden_layers": 10**6}, f"in [1, {LIMITS['n_layers']}]"),
        "many_loops": ({"total_ut_steps": LIMITS["n_loops"] + 1}, "total_ut_steps"),
        "string_theta": ({"rope_theta": "big"}, "rope_theta must be a positive number"),
    }

    @pytest.mark.parametrize("case", sorted(CASES))
    def test_wrong_typed_and_oversized_values_are_one_line(self, tmp_path, capsys, case):
        change, needle = self.CASES[case]
        path = write_hf(tmp_path / "ckpt", {**HF_TINY, **change}, published_tensors(HF_TINY))
        t0 = time.monotonic()
        with pytest.raises(CheckpointError, match=needle.replace("[", r"\[").replace("]", r"\]")):
            ouro.from_pretrained(path)
        assert time.monotonic() - t0 < 30  # refused before anything is allocated or built
        one_line_error(capsys, ["ouro-import", path, "--out", tmp_path / "run"], needle)

    @pytest.mark.parametrize("index", [
        b'{"weight_map": {"lm_head.weight": 5}}',
        b'{"weight_map": {"lm_head.weight": ["a"]}}',
        b'{"weight_map": "x"}',
        b'\xff\xfe{"weight_map": {}}',
        b"[" * 100_000 + b"]" * 100_000,
    ], ids=["int_value", "list_value", "string_map", "not_utf8", "deep"])
    def test_a_malformed_index_is_one_line(self, tmp_path, capsys, index):
        path = write_hf(tmp_path / "ckpt", HF_TINY, published_tensors(HF_TINY), shards=2)
        (path / ouro.HF_INDEX).write_bytes(index)
        with pytest.raises(CheckpointError):
            ouro.from_pretrained(path)
        one_line_error(capsys, ["ouro-import", path, "--out", tmp_path / "run"], ouro.HF_INDEX)

    def test_a_deeply_nested_config_is_one_line(self, tmp_path, capsys):
        path = write_hf(tmp_path / "ckpt", HF_TINY, published_tensors(HF_TINY))
        (path / "config.json").write_text('{"model_type": "ouro", "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
        with pytest.raises(CheckpointError, match="nested too deeply"):
            ouro.from_pretrained(path)
        one_line_error(capsys, ["ouro-import", path, "--out", tmp_path / "run"], "config.json")


# ---------------------------------------------------------------------------
# ouro-depth / ouro-scale arguments
# ---------------------------------------------------------------------------
class TestOuroEvalArgs:
    @pytest.mark.parametrize("argv,needle", [
        (["ouro-depth", "--batch-size", "0"], "--batch-size"),
        (["ouro-depth", "--batch-size", "-1"], "--batch-size"),
        (["ouro-depth", "--max-k", str(10**6)], "--max-k"),
        (["ouro-depth", "--max-k", "0"], "--max-k"),
        (["ouro-depth", "--windows", "-1"], "--windows"),
        (["ouro-scale", "--scales", "1", "nan"], "--scales"),
        (["ouro-scale", "--scales", "inf"], "--scales"),
    ])
    def test_bad_arguments_are_one_line_and_write_nothing(self, hf_dir, tmp_path, capsys, argv, needle):
        V = HF_TINY["vocab_size"]
        data = prepared(tmp_path, "own", word_tokenizer(V), V)
        out = tmp_path / "result.json"
        one_line_error(capsys, [*argv, "--model", hf_dir, "--data", data, "--seq-len", "16", "--device", "cpu",
                                "--out", out], needle)
        assert not out.exists()


def test_oversized_loops_are_refused_by_import_as_by_load(tmp_path, capsys):
    path = write_hf(tmp_path / "ckpt", {**HF_TINY, "total_ut_steps": LIMITS["n_loops"] + 1},
                    published_tensors(HF_TINY))
    one_line_error(capsys, ["ouro-import", path, "--out", tmp_path / "run"], "total_ut_steps")
