"""The artifact surfaces trust nothing they read (load, generate, bench --generate, export,
halting.json): every tampered, corrupted, mixed or hostile input is one line (exit code 2 from
the CLI), never a result, a traceback or a big allocation."""
import hashlib
import json
import math
import pathlib
import shutil
import struct
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

import loopscale
from loopscale.cli import main
from loopscale.config import preset
from loopscale.io import CheckpointError
from loopscale.model import LoopedLM
from loopscale.train import train

WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def base(smoke_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("attack") / "run"
    cfg = preset("smoke", {"model": {"vocab_size": 512}, "data": {"vocab_size": 512},
                           "train": {"max_steps": 4, "device": "cpu"}})
    train(cfg, smoke_data, out, progress=False)
    return out


@pytest.fixture
def run(base, tmp_path):
    shutil.copytree(base, tmp_path / "run")
    return tmp_path / "run"


def record_path(run):
    """The run record: loopscale.json (config.json in the older layout)."""
    return run / "loopscale.json" if (run / "loopscale.json").exists() else run / "config.json"


def edit_record(run, fn):
    p = record_path(run)
    rec = json.loads(p.read_text())
    fn(rec)
    p.write_text(json.dumps(rec))


def rewrite_weights(run, fn, metadata=None):
    """model.safetensors rewritten from fn(state) with plain metadata (no recorded hashes)."""
    state = load_file(str(run / WEIGHTS))
    state = fn(state) or state
    save_file({k: v.contiguous() for k, v in state.items()}, str(run / WEIGHTS), metadata=metadata or {"format": "pt"})


def one_line_error(capsys, argv, *needles):
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    for n in needles:
        assert n in err, err
    return err


def gen(run, *extra):
    return ["generate", "--run", str(run), "--prompt", "The Congress", "--max-new-tokens", "4", *extra]


# ---------------------------------------------------------------------------
# high 1: model.safetensors and the configs are verified
# ---------------------------------------------------------------------------
def test_flipped_bytes_in_the_weights_are_refused(run, capsys):
    blob = bytearray((run / WEIGHTS).read_bytes())
    blob[-100] ^= 0x40  # a bit of the last tensor's data, header untouched
    (run / WEIGHTS).write_bytes(bytes(blob))
    with pytest.raises(CheckpointError, match="weights hash"):
        loopscale.load(run)
    one_line_error(capsys, gen(run), "weights hash")
    one_line_error(capsys, ["bench", "--generate", str(run), "--new-tokens", "2"], "weights hash")


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_non_finite_weights_are_refused(run, value, capsys):
    def poison(state):
        state["blocks.0.mlp.down.weight"][0, 0] = value
    rewrite_weights(run, poison)
    with pytest.raises(CheckpointError, match=r"blocks\.0\.mlp\.down\.weight holds non-finite"):
        loopscale.load(run)
    one_line_error(capsys, gen(run), "non-finite")


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.int64])
def test_non_float_tensors_are_refused(run, dtype):
    def cast(state):
        state["pos_emb.weight"] = state["pos_emb.weight"].to(dtype)
    rewrite_weights(run, cast)
    with pytest.raises(CheckpointError, match=r"pos_emb\.weight is .*not a float tensor"):
        loopscale.load(run)


@pytest.mark.parametrize("key,value", [("n_loops", 7), ("readout", "layernorm"), ("norm_eps", 1e30),
                                       ("recurrence", "inter_loop_norm")])
def test_an_edited_run_config_is_refused(run, key, value, capsys):
    """The model.pt beside it holds the true config; the artifact records a config fingerprint."""
    edit_record(run, lambda r: r["config"]["model"].__setitem__(key, value))
    with pytest.raises(CheckpointError):
        loopscale.load(run)
    one_line_error(capsys, gen(run))


@pytest.mark.parametrize("key,value", [("n_loops", 7), ("readout", "raw"), ("norm_eps", 1e30)])
def test_an_edited_hugging_face_config_is_refused(run, key, value):
    conf = json.loads((run / "config.json").read_text())
    if "config" in conf:
        conf["config"]["model"][key] = value  # an older layout: config.json is the record
    else:
        conf[key] = value
    (run / "config.json").write_text(json.dumps(conf))
    with pytest.raises(CheckpointError, match=key if "config" not in conf else ""):
        loopscale.load(run)


def test_an_edited_config_without_model_pt_is_refused_by_the_fingerprint(run):
    """Only the record and the weights left: the safetensors metadata holds the config's fingerprint."""
    (run / "model.pt").unlink()
    if (run / "loopscale.json").exists():
        (run / "config.json").unlink()
    edit_record(run, lambda r: r["config"]["model"].__setitem__("n_loops", 7))
    with pytest.raises(CheckpointError, match="config_fingerprint|fingerprint"):
        loopscale.load(run)


def test_another_runs_weights_of_the_same_shape_are_refused(run, tmp_path):
    torch.manual_seed(3)
    cfg = loopscale.load(run)[2]
    other = LoopedLM(cfg.model)
    save_file({k: v.contiguous() for k, v in other.state_dict().items()}, str(run / WEIGHTS), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="weights hash"):
        loopscale.load(run)


def test_a_shape_mismatch_names_the_key(run):
    (run / "model.pt").unlink()

    def narrow(state):
        state["blocks.0.attn.proj.weight"] = state["blocks.0.attn.proj.weight"][:, :-1]
    rewrite_weights(run, narrow)
    with pytest.raises(CheckpointError, match=r"blocks\.0\.attn\.proj\.weight"):
        loopscale.load(run)


def test_a_missing_and_an_extra_tensor_are_named(run):
    (run / "model.pt").unlink()
    rewrite_weights(run, lambda s: {**s, "exit_gate.weight": torch.zeros(3)})
    with pytest.raises(CheckpointError, match="exit_gate.weight"):
        loopscale.load(run)
    rewrite_weights(run, lambda s: {k: v for k, v in s.items() if k != "blocks.0.norm2.weight"})
    with pytest.raises(CheckpointError, match=r"blocks\.0\.norm2\.weight"):
        loopscale.load(run)


# ---------------------------------------------------------------------------
# hostile sizes: refused from the config and the safetensors header, fast, no allocation
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("key,value", [("d_model", 2**22), ("d_ff", 2**22), ("vocab_size", 2**40),
                                       ("n_layers", 10**7), ("n_loops", 10**8), ("seq_len", 2**40),
                                       ("n_layers", 100), ("d_model", 64)])
def test_hostile_sizes_are_one_fast_line(run, key, value, capsys):
    (run / "model.pt").unlink()
    edit_record(run, lambda r: r["config"]["model"].__setitem__(key, value))
    t0 = time.perf_counter()
    with pytest.raises(CheckpointError, match=key):
        loopscale.load(run)
    assert time.perf_counter() - t0 < 5
    one_line_error(capsys, gen(run), key)


def test_a_hostile_safetensors_header_is_one_line(run):
    blob = (run / WEIGHTS).read_bytes()
    for bad in (struct.pack("<Q", 2**60) + blob[8:],  # a header length beyond the file
                blob[:8] + b"\xff" * (len(blob) - 8),  # a header that is not JSON
                blob[:len(blob) // 2]):  # truncated data
        (run / WEIGHTS).write_bytes(bad)
        with pytest.raises(CheckpointError, match=WEIGHTS):
            loopscale.load(run)


def test_load_reads_the_weights_file_once_memory_mapped(run, monkeypatch):
    """No `read_bytes()` of the whole safetensors file (a second copy of every weight in memory)."""
    real = pathlib.Path.read_bytes

    def guarded(self):
        assert self.name != WEIGHTS, "model.safetensors read into memory whole"
        return real(self)
    monkeypatch.setattr(pathlib.Path, "read_bytes", guarded)
    model, _, _ = loopscale.load(run)
    assert model.num_params() > 0


# ---------------------------------------------------------------------------
# high 2: the tokenizer's identity
# ---------------------------------------------------------------------------
def _other_tokenizer(run):
    text = (run / "tokenizer.json").read_text()
    return text.replace('"the"', '"teh"', 1)


def test_another_tokenizer_is_refused_on_load(run, capsys):
    (run / "tokenizer.json").write_text(_other_tokenizer(run))
    with pytest.raises(CheckpointError, match="not the tokenizer"):
        loopscale.load(run)
    one_line_error(capsys, gen(run), "not the tokenizer")


@pytest.mark.parametrize("garbage", [b"\x00\xff\xfe garbage \x80", b'{"model": 3}', b"not json at all", b""])
def test_a_corrupted_tokenizer_is_one_line(run, garbage, capsys):
    (run / "tokenizer.json").write_bytes(garbage)
    with pytest.raises(CheckpointError, match="tokenizer"):
        loopscale.load(run)
    one_line_error(capsys, gen(run), "tokenizer")


@pytest.mark.parametrize("garbage", [b"\x00\xff\xfe\x80" * 64, b"[1, 2, 3]", b"{garbage", b'{"config": [1]}'])
@pytest.mark.parametrize("which", ["record", "config.json"])
def test_a_corrupted_config_is_one_line(run, garbage, which, capsys):
    path = record_path(run) if which == "record" else run / "config.json"
    path.write_bytes(garbage)
    with pytest.raises(CheckpointError):
        loopscale.load(run)
    one_line_error(capsys, gen(run))


def test_export_without_a_record_uses_model_pt_and_installs_no_foreign_tokenizer(run, tmp_path, capsys):
    for name in ("config.json", "loopscale.json", WEIGHTS, "tokenizer.json"):
        (run / name).unlink(missing_ok=True)
    other = tmp_path / "other"
    other.mkdir()
    (other / "tokenizer.json").write_text(_foreign_tokenizer())
    before = sorted(p.name for p in run.iterdir())
    one_line_error(capsys, ["export", str(run), "--data", str(other)], "not the tokenizer")
    assert sorted(p.name for p in run.iterdir()) == before  # nothing written before refusing


def _foreign_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({"<pad>": 0, "<bos>": 1, "<eos>": 2, "<unk>": 3, "the": 4}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok.to_str()


def test_export_refusing_a_wrong_data_dir_changes_no_file(run, tmp_path, capsys):
    other = tmp_path / "other"
    other.mkdir()
    (other / "tokenizer.json").write_text(_other_tokenizer(run))
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    one_line_error(capsys, ["export", str(run), "--data", str(other)], "not the tokenizer")
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before


def test_the_hugging_face_class_verifies_too(run):
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM
    blob = bytearray((run / WEIGHTS).read_bytes())
    blob[-100] ^= 0x40
    (run / WEIGHTS).write_bytes(bytes(blob))
    import loopscale.hf  # noqa: F401
    with pytest.raises(CheckpointError, match="weights hash"):
        AutoModelForCausalLM.from_pretrained(run)


# ---------------------------------------------------------------------------
# generate / bench --generate arguments
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("extra,needle", [
    (["--temperature", "nan"], "--temperature"), (["--temperature", "1e-45"], "--temperature"),
    (["--temperature", "-1"], "--temperature"), (["--top-k", "-1", "--temperature", "1"], "--top-k"),
    (["--top-k", "0", "--temperature", "1"], "--top-k"), (["--max-new-tokens", "-5"], "--max-new-tokens"),
    (["--loops", "0"], "--loops"), (["--loops", "100000000"], "--loops"),
    (["--halt", "margin", "--threshold", "nan"], "--threshold"),
])
def test_bad_generate_arguments_are_one_line(run, extra, needle, capsys):
    one_line_error(capsys, gen(run, *extra), needle)


def test_a_non_utf8_prompt_is_one_line(run, capsys):
    prompt = b"The \xff Congress".decode("utf-8", "surrogateescape")  # what argv holds for such bytes
    one_line_error(capsys, ["generate", "--run", str(run), "--prompt", prompt], "UTF-8")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_is_one_line(run, capsys):
    one_line_error(capsys, gen(run, "--device", "cuda"), "CUDA")
    one_line_error(capsys, ["bench", "--generate", str(run), "--device", "cuda"], "CUDA")


@pytest.mark.parametrize("n", ["0", "-5"])
def test_bench_generate_needs_new_tokens(run, n, capsys):
    one_line_error(capsys, ["bench", "--generate", str(run), "--new-tokens", n], "--new-tokens")


def test_a_seq_len_1_model_generates_and_benches(smoke_data, tmp_path):
    from loopscale.artifacts import write_run_files
    from loopscale.generate import bench_generation, generate
    cfg = preset("smoke", {"model": {"vocab_size": 512, "seq_len": 1}, "data": {"vocab_size": 512}})
    model = LoopedLM(cfg.model).eval()
    g = generate(model, [5, 6, 7], 6)
    assert len(g.tokens) == 6 and g.slides == 5
    r = bench_generation(model, None, new_tokens=8)
    assert all(row["tokens"] >= 1 and row["tok_per_s"] > 0 for row in r["rows"])
    assert r["new_tokens"] >= 1 and r["prompt_tokens"] >= 1
    write_run_files(tmp_path / "r", model, {"config": cfg.to_dict(), "data": {}},
                    (smoke_data / "tokenizer.json").read_bytes())
    assert main(["generate", "--run", str(tmp_path / "r"), "--prompt", "The Congress", "--max-new-tokens", "5"]) == 0


def test_sampled_ids_are_ids_the_tokenizer_has(smoke_data, tmp_path, capsys):
    """An embedding larger than the tokenizer (model.vocab_size > data.vocab_size) never
    produces an id the tokenizer cannot decode."""
    from loopscale.artifacts import write_run_files
    from loopscale.generate import generate
    cfg = preset("smoke", {"model": {"vocab_size": 4096}, "data": {"vocab_size": 512}})
    torch.manual_seed(0)
    model = LoopedLM(cfg.model).eval()
    with torch.no_grad():
        model.tok_emb.weight[512:] *= 10  # the unknown ids are the likeliest
    g = generate(model, [5, 6, 7], 20, temperature=1.0, seed=1, vocab=512)
    assert max(g.tokens) < 512
    write_run_files(tmp_path / "r", model, {"config": cfg.to_dict(), "data": {}},
                    (smoke_data / "tokenizer.json").read_bytes())
    assert main(["generate", "--run", str(tmp_path / "r"), "--prompt", "The", "--max-new-tokens", "20",
                 "--temperature", "1"]) == 0
    err = capsys.readouterr().err
    assert "[20 tokens" in err


# ---------------------------------------------------------------------------
# halting.json contents
# ---------------------------------------------------------------------------
def _halting(run, threshold, policies=None, **top):
    cfg = loopscale.load(run)[2]
    m, o = cfg.model, cfg.objective
    body = {"k_train": m.n_loops, "seed": cfg.train.seed,
            "condition": {"readout": m.readout, "loss": o.loss, "regularizer": o.regularizer,
                          "recurrence": m.recurrence, "n_loops": m.n_loops, "d_model": m.d_model,
                          "n_layers": m.n_layers},
            "policies": policies if policies is not None else {"margin/token": {"threshold": threshold}}}
    body.update(top)
    (run / "eval").mkdir(exist_ok=True)
    return body


def _write(run, body):
    (run / "eval" / "halting.json").write_text(json.dumps(body))


def test_a_valid_halting_json_is_used(run, capsys):
    _write(run, _halting(run, 0.0))
    assert main(gen(run, "--halt", "margin")) == 0
    assert "margin τ=0" in capsys.readouterr().err


@pytest.mark.parametrize("threshold", ["0.5", [0.5], True, {"v": 1}])
def test_a_mistyped_threshold_is_one_line(run, threshold, capsys):
    _write(run, _halting(run, threshold))
    one_line_error(capsys, gen(run, "--halt", "margin"), "halting.json", "threshold")
    one_line_error(capsys, ["bench", "--generate", str(run), "--new-tokens", "2"], "halting.json")


def test_a_nan_threshold_is_one_line(run, capsys):
    body = _halting(run, 0.0)
    (run / "eval" / "halting.json").write_text(json.dumps(body).replace('"threshold": 0.0', '"threshold": NaN'))
    one_line_error(capsys, gen(run, "--halt", "margin"), "threshold")


@pytest.mark.parametrize("policies", [[{"threshold": 0.5}], "margin", {"margin/token": [0.5]}])
def test_a_malformed_policy_table_is_one_line(run, policies, capsys):
    _write(run, _halting(run, None, policies=policies))
    one_line_error(capsys, gen(run, "--halt", "margin"), "halting.json")


def test_a_non_utf8_halting_json_is_one_line(run, capsys):
    (run / "eval").mkdir(exist_ok=True)
    (run / "eval" / "halting.json").write_bytes(b'{"policies": "\xff\xfe"}')
    one_line_error(capsys, gen(run, "--halt", "margin"), "halting.json")


@pytest.mark.parametrize("change", [{"k_train": 7}, {"seed": 12345}])
def test_another_runs_halting_json_is_refused(run, change, capsys):
    body = _halting(run, 0.0)
    body.update(change)
    if "k_train" in change:
        body["condition"]["n_loops"] = change["k_train"]
    _write(run, body)
    one_line_error(capsys, gen(run, "--halt", "margin"), "another run")


def test_tokenizer_hash_is_recorded_in_the_artifact(run):
    want = hashlib.sha256((run / "tokenizer.json").read_bytes()).hexdigest()
    assert json.loads(record_path(run).read_text())["data"]["tokenizer_sha256"] == want
    conf = json.loads((run / "config.json").read_text())
    assert conf["loopscale"]["tokenizer_sha256"] == want
