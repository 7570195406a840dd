"""Reliability 4: the Ouro-layout checkpoints, the writers of a run directory, the tokenizer a
model's data must share, the Ouro evaluations' arguments, train-stream's inputs, convert-paper's
sizes, the one table of limits (config.LIMITS) and the trainer's parent watch.

Every test feeds what a user or a damaged file can give and expects one line naming what is
wrong, with nothing already written changed."""
from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import save_file

import loopscale
from loopscale import data as D
from loopscale import ouro
from loopscale.cli import main
from loopscale.config import LIMITS, ConfigError, DataConfig, load_eval_config, preset
from loopscale.io import CheckpointError, run_lock

from ouro_support import HF_TINY, published_tensors, write_hf


def one_line_error(capsys, argv, needle: str) -> str:
    capsys.readouterr()
    assert main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
    return err[0]


def word_tokenizer(vocab_size: int, prefix: str = "w"):
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<unk>": 3, **{f"{prefix}{i}": i + 4 for i in range(vocab_size - 4)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok


@pytest.fixture
def hf_dir(tmp_path):
    """A tiny published-layout Ouro checkpoint with its tokenizer."""
    path = write_hf(tmp_path / "Ouro-tiny", HF_TINY, published_tensors(HF_TINY))
    word_tokenizer(HF_TINY["vocab_size"]).save(str(path / "tokenizer.json"))
    return path


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


def tree(path: Path) -> dict:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file() and p.name != ".lock"}


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
# the writers of a run directory: the run lock, --force, an atomic swap (io.write_run)
# ---------------------------------------------------------------------------
class TestRunWriters:
    def test_ouro_import_refuses_a_finished_run_without_force(self, hf_dir, tmp_path, capsys):
        run = tmp_path / "run"
        assert main(["ouro-import", str(hf_dir), "--out", str(run)]) == 0
        (run / "eval").mkdir()
        (run / "eval" / "depth.json").write_text("{}")
        before = tree(run)
        other = write_hf(tmp_path / "other", HF_TINY, published_tensors(HF_TINY, seed=1))
        word_tokenizer(HF_TINY["vocab_size"], prefix="x").save(str(other / "tokenizer.json"))
        one_line_error(capsys, ["ouro-import", other, "--out", run], "--force")
        assert tree(run) == before
        assert main(["ouro-import", str(other), "--out", str(run), "--force"]) == 0
        assert not (run / "eval").exists()  # nothing of the old run stays
        assert json.loads((run / "summary.json").read_text())["imported_from"] == str(other.resolve())
        assert "x1" in loopscale.load(run)[1].get_vocab()  # the swapped-in run is whole: its files agree
        assert not list(tmp_path.glob(".run.new-*"))

    def test_ouro_import_is_refused_while_a_trainer_holds_the_run(self, hf_dir, tmp_path, capsys):
        run = tmp_path / "run"
        run.mkdir()
        with run_lock(run, "loopscale train"):
            one_line_error(capsys, ["ouro-import", hf_dir, "--out", run], "in use by loopscale train")
        assert sorted(p.name for p in run.iterdir()) in ([], [".lock"])

    def test_export_is_refused_while_a_trainer_holds_the_run(self, hf_dir, tmp_path, capsys):
        run = tmp_path / "run"
        assert main(["ouro-import", str(hf_dir), "--out", str(run)]) == 0
        before = tree(run)
        with run_lock(run, "loopscale train"):
            one_line_error(capsys, ["export", run], "in use by loopscale train")
        assert tree(run) == before

    def test_a_failed_forced_import_leaves_the_old_run(self, hf_dir, tmp_path, capsys, monkeypatch):
        run = tmp_path / "run"
        assert main(["ouro-import", str(hf_dir), "--out", str(run)]) == 0
        before = tree(run)
        from loopscale import artifacts

        def disk_full(*a, **k):
            raise OSError(28, "No space left on device")
        monkeypatch.setattr(artifacts, "save_weights", disk_full)
        other = write_hf(tmp_path / "other", HF_TINY, published_tensors(HF_TINY, seed=1))
        one_line_error(capsys, ["ouro-import", other, "--out", run, "--force"], "No space left")
        assert tree(run) == before
        assert not list(tmp_path.glob(".run.new-*"))

    def test_convert_paper_force_on_a_full_disk_keeps_the_old_run(self, tmp_path, capsys, monkeypatch):
        from official import CHECKPOINTS

        from loopscale import convert
        run = tmp_path / "run"
        assert main(["convert-paper", str(CHECKPOINTS[0]), "--out", str(run)]) == 0
        before = tree(run)
        assert before

        def disk_full(path, obj):
            raise OSError(28, "No space left on device", str(path))
        monkeypatch.setattr(convert, "atomic_torch_save", disk_full)
        one_line_error(capsys, ["convert-paper", CHECKPOINTS[-1], "--out", run, "--force"], "No space left")
        assert tree(run) == before
        assert loopscale.load(run)[2].model.readout  # still a whole, verified run


# ---------------------------------------------------------------------------
# the data's tokenizer against the model's
# ---------------------------------------------------------------------------
class TestTokenizerChecks:
    def test_ouro_depth_refuses_data_of_another_tokenizer_of_the_same_size(self, hf_dir, tmp_path, capsys):
        V = HF_TINY["vocab_size"]
        own = prepared(tmp_path, "own", word_tokenizer(V), V)
        other = prepared(tmp_path, "other", word_tokenizer(V, prefix="x"), V, prefix="x")
        assert D.load_meta(own)["vocab_size"] == D.load_meta(other)["vocab_size"]
        for model in (hf_dir, tmp_path / "run"):
            if model != hf_dir:
                assert main(["ouro-import", str(hf_dir), "--out", str(model), "--seq-len", "16"]) == 0
            out = tmp_path / "depth.json"
            one_line_error(capsys, ["ouro-depth", "--model", model, "--data", other, "--seq-len", "16",
                                    "--max-k", "2", "--windows", "2", "--device", "cpu", "--out", out],
                           "another tokenizer")
            assert not out.exists()
            assert main(["ouro-depth", "--model", str(model), "--data", str(own), "--seq-len", "16", "--max-k", "2",
                         "--windows", "2", "--device", "cpu"]) == 0

    def test_an_imported_run_records_its_tokenizer_and_eval_checks_it(self, hf_dir, tmp_path):
        from loopscale.evaluate import open_run
        V = HF_TINY["vocab_size"]
        other = prepared(tmp_path, "other", word_tokenizer(V, prefix="x"), V, prefix="x")
        run = tmp_path / "run"
        assert main(["ouro-import", str(hf_dir), "--out", str(run), "--seq-len", "16"]) == 0
        assert json.loads((run / "loopscale.json").read_text())["data"]["tokenizer_sha256"]
        with pytest.raises(CheckpointError, match="another tokenizer"):
            open_run(run / "model.pt", other, progress=False)

    @pytest.mark.parametrize("larger", [False, True])
    def test_train_stream_refuses_val_data_of_another_tokenizer_before_training(self, tmp_path, larger):
        from ouro_support import WORDS, fineweb_rows

        from loopscale import fineweb as FW
        from loopscale import train_stream as TS
        pq.write_table(pa.Table.from_pylist(fineweb_rows()), tmp_path / "fw.parquet")
        from tokenizers import Tokenizer, models, pre_tokenizers
        tok = Tokenizer(models.WordLevel({"<unk>": 0, **{w: i + 1 for i, w in enumerate(WORDS)}}, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        (tmp_path / "tok").mkdir()
        tok.save(str(tmp_path / "tok" / "tokenizer.json"))
        cfg = preset("ouro-smoke", {"model": {"seq_len": 16}, "train": {"batch_size": 2, "grad_accum": 1,
                                                                          "max_steps": 2, "log_every": 1}})
        V = cfg.model.vocab_size * 2 if larger else len(WORDS) + 5
        val = prepared(tmp_path, "val", word_tokenizer(V, prefix="q"), V, prefix="q")
        s = FW.StreamConfig.from_dict({"data_files": [str(tmp_path / "fw.parquet")], "shuffle_buffer": 0,
                                       "tokenizer": str(tmp_path / "tok"), "warmup_steps": 1})
        trained = []
        import loopscale.train as T
        orig = T.train_step
        T.train_step = lambda *a, **k: trained.append(1) or orig(*a, **k)
        try:
            with pytest.raises(ConfigError, match="--val-data"):
                TS.train_stream(cfg, s, tmp_path / "run", val_data=val)
        finally:
            T.train_step = orig
        assert not trained and not (tmp_path / "run" / "model.pt").exists()


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


# ---------------------------------------------------------------------------
# train-stream's inputs (fineweb.check_parquet, fineweb.load_tokenizer)
# ---------------------------------------------------------------------------
class TestStreamInputs:
    def stream(self, tmp_path, files, tok_dir):
        from loopscale import fineweb as FW
        return FW.StreamConfig.from_dict({"data_files": [str(f) for f in files], "shuffle_buffer": 0,
                                          "tokenizer": str(tok_dir), "warmup_steps": 1})

    @pytest.fixture
    def tok_dir(self, tmp_path):
        (tmp_path / "tok").mkdir()
        word_tokenizer(50).save(str(tmp_path / "tok" / "tokenizer.json"))
        return tmp_path / "tok"

    def bad_files(self, tmp_path):
        good = pa.Table.from_pylist([{"text": "w1 w2 w3 " * 30}] * 4)
        pq.write_table(good, tmp_path / "good.parquet")
        blob = (tmp_path / "good.parquet").read_bytes()
        files = {"zero_byte": b"", "truncated": blob[: len(blob) // 2], "csv": b"text\nw1 w2\nw3 w4\n"}
        for name, content in files.items():
            (tmp_path / f"{name}.parquet").write_bytes(content)
        pq.write_table(pa.Table.from_pylist([{"text": 5}] * 3), tmp_path / "ints.parquet")
        pq.write_table(pa.Table.from_pylist([{"text": ["w1", "w2"]}] * 3), tmp_path / "lists.parquet")
        pq.write_table(pa.table({"body": pa.array([], pa.string())}), tmp_path / "empty.parquet")
        return ["zero_byte", "truncated", "csv", "ints", "lists", "empty"]

    def test_bad_parquet_files_are_one_line_naming_the_file(self, tmp_path, tok_dir):
        from loopscale import fineweb as FW
        tok = FW.load_tokenizer(str(tok_dir))
        for name in self.bad_files(tmp_path):
            s = self.stream(tmp_path, [tmp_path / f"{name}.parquet"], tok_dir)
            with pytest.raises(ConfigError, match=f"{name}.parquet") as e:
                FW.ChunkStream(s, tok, 8).batch(1)
            assert len(str(e.value).splitlines()) == 1

    def test_a_non_tokenizer_json_is_one_line_naming_the_file(self, tmp_path):
        from loopscale import fineweb as FW
        bad = tmp_path / "tokenizer.json"
        bad.write_text('{"hello": 1}')
        with pytest.raises(ConfigError, match="tokenizer.json is not a tokenizers JSON file"):
            FW.load_tokenizer(str(bad))
        bad.write_bytes(b"\xff\xfe\x00")
        with pytest.raises(ConfigError, match="not a tokenizers JSON file"):
            FW.load_tokenizer(str(tmp_path))


# ---------------------------------------------------------------------------
# convert-paper's sizes and values
# ---------------------------------------------------------------------------
class TestConvertPaper:
    @pytest.mark.parametrize("key,value", [("seq_len", 10**9), ("ff_multiplier", 10**8)])
    def test_oversized_settings_are_refused_before_allocation(self, tmp_path, capsys, key, value):
        from convert_support import _refused, _set, _with
        t0 = time.monotonic()
        _refused(tmp_path, capsys, _with(_set("model", key, value)), "")
        assert time.monotonic() - t0 < 60

    def test_a_float64_weight_beyond_float32_is_refused(self, tmp_path, capsys):
        from convert_support import _refused, _with

        def huge(ck):
            name = next(k for k, v in ck["model_state"].items() if k.endswith("ffn.w2.weight"))
            t = ck["model_state"][name].double()
            t[0, 0] = 1e300
            ck["model_state"][name] = t
        _refused(tmp_path, capsys, _with(huge), "overflows float32")


# ---------------------------------------------------------------------------
# the one table of limits (config.LIMITS): configs, --set, the pipeline's grid
# ---------------------------------------------------------------------------
class TestLimits:
    @pytest.mark.parametrize("override", [f"eval.depth_factor={10**6}", f"eval.lemma_loops={10**9}",
                                          "eval.batch_size=0"])
    def test_eval_settings_are_bounded(self, override):
        with pytest.raises(ConfigError, match=override.split("=")[0]):
            load_eval_config(overrides=[override])

    @pytest.mark.parametrize("key", ["vocab_size", "n_layers", "seq_len", "d_model", "n_loops"])
    def test_model_sizes_are_bounded_in_every_config(self, key, capsys):
        one_line_error(capsys, ["params", "--preset", "smoke", "--set", f"model.{key}={LIMITS[key] + 1}"],
                       f"model.{key}")

    def test_the_readers_share_the_table(self):
        from loopscale import artifacts
        assert all(artifacts.LIMITS[k] == LIMITS[k] for k in artifacts.LIMITS)

    def test_an_experiment_grid_is_bounded_before_anything_is_written(self, tmp_path):
        from loopscale.pipeline import ParamsError, build_experiment, load_params
        params = load_params(str(Path(__file__).parent.parent / "params.yaml"))
        name = next(iter(params["experiments"]))
        big = copy.deepcopy(params)
        big["experiments"][name]["seeds"] = list(range(LIMITS["grid_runs"] + 1))
        with pytest.raises(ParamsError, match="grid_runs"):
            build_experiment(big, name)


# ---------------------------------------------------------------------------
# the trainer stops with its parent from its first instant
# ---------------------------------------------------------------------------
class TestParentWatch:
    def test_a_trainer_whose_launcher_died_before_it_started_stops(self, smoke_data, tmp_path, cli_env):
        """The launcher (a shell, as Snakemake's job) starts the trainer and dies at once, before
        the trainer has imported anything: the trainer must stop, not train on as an orphan."""
        run, pidfile = tmp_path / "run", tmp_path / "pid"
        cmd = (f"LOOPSCALE_PARENT_PID=$$ {sys.executable} -m loopscale.cli train --preset smoke --data {smoke_data} "
               f"--out {run} --set train.max_steps=100000 --set train.epochs=1000 -q --stop-with-parent "
               f"> {tmp_path / 'log'} 2>&1 & echo $! > {pidfile}; exit 0")
        subprocess.run(["sh", "-c", cmd], env=cli_env, check=True)
        pid = int(pidfile.read_text())

        def alive():
            try:
                os.kill(pid, 0)
                return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
            except (ProcessLookupError, FileNotFoundError):
                return False
        deadline = time.monotonic() + 90
        while alive() and time.monotonic() < deadline:
            time.sleep(0.5)
        stopped = not alive()
        if not stopped:
            os.kill(pid, signal.SIGKILL)
        assert stopped, (tmp_path / "log").read_text()[-2000:]
        with run_lock(run, "test"):  # nobody holds the run's lock any more
            pass


# ---------------------------------------------------------------------------
# the low findings: cross-checked settings, the file an error names
# ---------------------------------------------------------------------------
class TestLowFindings:
    def test_stream_min_lr_above_the_peak_is_refused(self, tmp_path):
        from loopscale import fineweb as FW
        from loopscale import train_stream as TS
        cfg = preset("ouro-smoke", {"train": {"max_steps": 2, "lr": 1e-3}})
        s = FW.StreamConfig.from_dict({"min_lr": 1e-2})
        with pytest.raises(ConfigError, match="stream.min_lr"):
            TS.train_stream(cfg, s, tmp_path / "run")
        assert not (tmp_path / "run").exists()

    def test_an_exp_yaml_error_names_exp_yaml(self, tmp_path):
        from loopscale.pipeline import ParamsError, load_and_validate
        root = Path(__file__).parent.parent
        name = next(iter(json.loads(json.dumps(
            __import__("yaml").safe_load((root / "params.yaml").read_text())))["experiments"]))
        settings = tmp_path / "exp.yaml"
        settings.write_text(f"{name}:\n  train:\n    lr: -1\n")
        with pytest.raises(ParamsError, match="exp.yaml") as e:
            load_and_validate(root / "params.yaml", root / "workflow" / "schemas" / "params.schema.yaml",
                              settings_path=settings)
        assert "train.lr" in str(e.value)

    def test_oversized_loops_are_refused_by_import_as_by_load(self, tmp_path, capsys):
        path = write_hf(tmp_path / "ckpt", {**HF_TINY, "total_ut_steps": LIMITS["n_loops"] + 1},
                        published_tensors(HF_TINY))
        one_line_error(capsys, ["ouro-import", path, "--out", tmp_path / "run"], "total_ut_steps")


# ---------------------------------------------------------------------------
# a corpus or split smaller than one window (data.check_windows): prepare-data with a model,
# train (the pipeline's train job), train-stream's --val-data
# ---------------------------------------------------------------------------
class TestCorpusSmallerThanAWindow:
    """Training and evaluation read whole windows of seq_len+1 tokens: a split shorter than one
    is refused in one line naming the split (and its file) and both sizes, before training."""

    def corpus(self, tmp_path, short: str, short_words: int = 12) -> dict:
        """text-files of random words; the `short` split gets `short_words` words, the others 3,000."""
        g = torch.Generator().manual_seed(1)
        files = {}
        for split in ("train", "validation", "test"):
            n = short_words if split == short else 3000
            ids = torch.randint(0, 40, (n,), generator=g).tolist()
            files[split] = tmp_path / f"{split}.txt"
            files[split].write_text(" ".join(f"w{i}" for i in ids) + "\n")
        return files

    def data_config(self, tmp_path, files, name="data.yaml") -> Path:
        """A data-only config, as the pipeline's data/<exp>/config.yaml."""
        import yaml
        path = tmp_path / name
        path.write_text(yaml.safe_dump({"data": {
            "source": "text-files", "train_file": str(files["train"]), "validation_file": str(files["validation"]),
            "test_file": str(files["test"]), "tokenizer": "word", "vocab_size": 64, "min_frequency": 1}}))
        return path

    @staticmethod
    def refused(capsys, argv, needle: str) -> str:
        """prepare-data's error: one line after its progress (which encoding prints on stderr)."""
        capsys.readouterr()
        assert main([str(a) for a in argv]) == 2
        errors = [ln for ln in capsys.readouterr().err.splitlines() if "error" in ln]
        assert len(errors) == 1 and errors[0].startswith("loopscale: error: ") and needle in errors[0], errors
        return errors[0]

    def counts(self, tmp_path, config) -> dict:
        """The token count of every split (derived by preparing the corpus with no model given)."""
        assert main(["prepare-data", "--config", str(config), "--out", str(tmp_path / "counted")]) == 0
        return D.load_meta(tmp_path / "counted")["tokens"]

    @pytest.mark.parametrize("short", ["train", "validation", "test"])
    def test_prepare_data_refuses_a_split_shorter_than_the_models_window(self, tmp_path, capsys, short):
        files = self.corpus(tmp_path, short)
        config = self.data_config(tmp_path, files)
        n = self.counts(tmp_path, config)[short]
        seq_len = n  # one token short of a window
        out = tmp_path / "prepared"
        assert main(["prepare-data", "--config", str(config), "--out", str(out)]) == 0  # an earlier preparation
        before = tree(out)
        line = self.refused(capsys, ["prepare-data", "--config", config, "--preset", "smoke", "--set",
                                       f"model.seq_len={seq_len}", "--out", out], f"the {short} split")
        assert str(files[short]) in line and f"{n:,} tokens" in line and f"{seq_len + 1:,}" in line
        assert tree(out) == before  # the earlier preparation is whole
        assert not [p.name for p in out.iterdir() if p.name.startswith(".")]
        # one token more than the short split holds is refused, a window that fits is not
        assert main(["prepare-data", "--config", str(config), "--preset", "smoke", "--set",
                     f"model.seq_len={n - 1}", "--out", str(out)]) == 0

    def test_a_model_in_the_config_file_is_checked_too(self, tmp_path, capsys):
        import yaml
        files = self.corpus(tmp_path, "train")
        config = self.data_config(tmp_path, files)
        n = self.counts(tmp_path, config)["train"]
        with_model = tmp_path / "run.yaml"
        with_model.write_text(yaml.safe_dump({**yaml.safe_load(config.read_text()), "preset": "smoke",
                                              "model": {"seq_len": n}}))
        self.refused(capsys, ["prepare-data", "--config", with_model, "--out", tmp_path / "out"], "the train split")
        assert not (tmp_path / "out" / "meta.json").exists()

    @pytest.mark.parametrize("short", ["train", "validation"])
    def test_train_refuses_a_split_shorter_than_a_window_before_training(self, tmp_path, capsys, monkeypatch, short):
        """The pipeline's two jobs: prepare-data on its data-only config (which names no model),
        then train on the run's config: refused before a step, naming the split."""
        import loopscale.train as T
        files = self.corpus(tmp_path, short)
        config = self.data_config(tmp_path, files)
        data = tmp_path / "data"
        assert main(["prepare-data", "--config", str(config), "--out", str(data)]) == 0
        n = D.load_meta(data)["tokens"][short]
        trained = []
        orig = T.train_step
        monkeypatch.setattr(T, "train_step", lambda *a, **k: trained.append(1) or orig(*a, **k))
        run = tmp_path / "run"
        line = one_line_error(capsys, ["train", "--preset", "smoke", "--data", data, "--out", run, "-q", "--set",
                                       f"model.seq_len={n}", "--set", "train.batch_size=1",
                                       "--set", "train.max_steps=2"], f"the {short} split")
        assert str(data) in line and f"{n:,} tokens" in line and f"{n + 1:,}" in line
        assert not trained and not (run / "model.pt").exists()

    def test_train_stream_refuses_val_data_shorter_than_a_window_before_training(self, tmp_path, monkeypatch):
        from ouro_support import WORDS, fineweb_rows

        import loopscale.train as T
        from loopscale import fineweb as FW
        from loopscale import train_stream as TS
        pq.write_table(pa.Table.from_pylist(fineweb_rows()), tmp_path / "fw.parquet")
        from tokenizers import Tokenizer, models, pre_tokenizers
        tok = Tokenizer(models.WordLevel({"<unk>": 0, **{w: i + 1 for i, w in enumerate(WORDS)}}, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        (tmp_path / "tok").mkdir()
        tok.save(str(tmp_path / "tok" / "tokenizer.json"))
        root = tmp_path / "text"
        root.mkdir()
        (root / "train.txt").write_text(" ".join(WORDS * 50))
        (root / "valid.txt").write_text(" ".join(WORDS[:5]))
        dc = DataConfig(source="text-files", train_file=str(root / "train.txt"),
                        validation_file=str(root / "valid.txt"), tokenizer="word", vocab_size=len(WORDS) + 1)
        val = tmp_path / "val"
        D.prepare_data(dc, val, show_progress=False, tokenizer=tok)
        n = D.load_meta(val)["tokens"]["validation"]
        cfg = preset("ouro-smoke", {"model": {"seq_len": n}, "train": {"batch_size": 2, "grad_accum": 1,
                                                                         "max_steps": 2, "log_every": 1}})
        s = FW.StreamConfig.from_dict({"data_files": [str(tmp_path / "fw.parquet")], "shuffle_buffer": 0,
                                       "tokenizer": str(tmp_path / "tok"), "warmup_steps": 1})
        trained = []
        orig = T.train_step
        monkeypatch.setattr(T, "train_step", lambda *a, **k: trained.append(1) or orig(*a, **k))
        with pytest.raises(D.DataError, match=f"--val-data {val}: the validation split is too small: {n:,} tokens") as e:
            TS.train_stream(cfg, s, tmp_path / "run", val_data=val)
        assert len(str(e.value).splitlines()) == 1
        assert not trained and not (tmp_path / "run" / "model.pt").exists()
