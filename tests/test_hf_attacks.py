"""Hostile or mistaken input to the Hugging Face and lm-eval surfaces (issue 34): each is one
clear line, refused before anything is computed or written, and never a hang, a traceback
from deep inside a library, or a silently ignored setting."""
import json
import os
import re
import shutil
import threading

import pytest
import torch

transformers = pytest.importorskip("transformers")

import loopscale  # noqa: E402
from loopscale.artifacts import LIMITS  # noqa: E402
from loopscale.config import ConfigError  # noqa: E402
from loopscale.hf import LoopscaleConfig, LoopscaleForCausalLM  # noqa: E402
from loopscale.io import CheckpointError  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402


@pytest.fixture
def run(smoke_run):
    """The session's smoke run (conftest.py), read only: `copy` is the one to change."""
    return smoke_run


@pytest.fixture
def copy(run, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(run, out)
    return out


def one_line(e: BaseException) -> str:
    text = str(e.value if hasattr(e, "value") else e)
    assert text and len(text.strip().splitlines()) == 1, text
    return text


def finishes(fn, seconds=120):
    """fn() in a thread: what it raised, or a failure when it is still running after `seconds`."""
    box = {}

    def target():
        try:
            box["result"] = fn()
        except BaseException as e:  # noqa: BLE001  (handed back to the test)
            box["error"] = e
    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still running after {seconds} s (a hang)"
    return box.get("error")


# --- lm-eval model args -------------------------------------------------------------------
lm_eval = pytest.importorskip("lm_eval")


def _lm(**kw):
    from loopscale.harness import LoopscaleLM
    return LoopscaleLM(**kw)


@pytest.mark.parametrize("args, message", [
    ({"loops": str(10**9)}, f"loops: must be in \\[1, {LIMITS['n_loops']}\\]"),
    ({"loops": "0"}, "loops: must be in"),
    ({"loops": "2.5"}, "loops: expected an integer"),
    ({"halting": "margin", "threshold": "abc"}, "threshold: expected a number, got 'abc'"),
    ({"halting": "margin", "threshold": "nan"}, "threshold: must be a finite number"),
    ({"halting": "margin", "threshold": "inf"}, "threshold: must be a finite number"),
    ({"loop": "2"}, "loop: unknown model arg .*did you mean loops"),
    ({"trheshold": "2", "halting": "margin"}, "did you mean threshold"),
    ({"batch_size": "0"}, "batch_size: must be"),
])
def test_bad_model_args_are_refused_in_one_line_before_loading(run, args, message):
    e = finishes(lambda: _lm(run=str(run), **args))
    assert isinstance(e, ConfigError), repr(e)
    assert re.search(message, one_line(e)), str(e)


def test_documented_device_and_batch_size_model_args_do_not_collide_with_lm_evals_own(run):
    """lm-eval's command line passes batch_size/device itself (its defaults included): a model
    arg of the same name is no `got multiple values for keyword argument`; the model arg wins."""
    from loopscale.harness import LoopscaleLM
    extra = {"batch_size": 1, "max_batch_size": None, "device": "cuda"}
    lm = LoopscaleLM.create_from_arg_string(f"run={run},device=cpu,batch_size=4", extra)
    assert lm.batch_size == 4 and lm.device.type == "cpu"
    lm = LoopscaleLM.create_from_arg_obj({"run": str(run), "device": "cpu", "batch_size": "3"}, extra)
    assert lm.batch_size == 3 and lm.device.type == "cpu"
    lm = LoopscaleLM.create_from_arg_string(f"run={run}", {"batch_size": 5, "device": "cpu"})
    assert lm.batch_size == 5  # lm-eval's own option still applies when the model args leave it out


def test_lm_eval_simple_evaluate_with_model_args_device_and_batch_size(run, tmp_path):
    import lm_eval
    from lm_eval.tasks import TaskManager

    import loopscale.harness  # noqa: F401
    from hf_support import write_mc_task
    write_mc_task(tmp_path)
    out = lm_eval.simple_evaluate(model="loopscale", model_args=f"run={run},device=cpu,batch_size=4",
                                  tasks=["ls_mc"], task_manager=TaskManager(include_path=str(tmp_path)),
                                  batch_size=1, device="cpu")
    assert 0.0 <= out["results"]["ls_mc"]["acc,none"] <= 1.0


def test_loops_list_is_checked(run):
    from loopscale.harness import parse_depths
    assert parse_depths("1,2,3,4") == [1, 2, 3, 4]
    for bad in ("", "1,,2", "1,x", "0,1", "1,1", f"1,{LIMITS['n_loops'] + 1}"):
        with pytest.raises(ConfigError, match="loops"):
            parse_depths(bad)


# --- a hand-edited config.json ---------------------------------------------------------------
EDITS = [
    ("architectures", ["LlamaForCausalLM"]),
    ("pad_token_id", 99999),
    ("bos_token_id", "x"),
    ("eos_token_id", 7),
    ("bos_token_id", 3),
    ("max_position_embeddings", 4),
    ("hidden_size", 64),
    ("torch_dtype", "bfloat16"),
    ("dtype", "float16"),
    ("tie_word_embeddings", False),
    ("seq_len", 4),
    ("readout", "raw"),
]


@pytest.mark.parametrize("key, value", EDITS, ids=[f"{k}={v}" for k, v in EDITS])
def test_an_edited_config_json_is_refused_naming_the_field(copy, key, value):
    conf = json.loads((copy / "config.json").read_text())
    assert conf.get(key) != value
    conf[key] = value
    (copy / "config.json").write_text(json.dumps(conf))
    for load in (lambda: LoopscaleForCausalLM.from_pretrained(copy), lambda: AutoModelForCausalLM.from_pretrained(copy)):
        e = finishes(load)
        assert isinstance(e, (ValueError, CheckpointError, OSError)), repr(e)
        assert key in one_line(e)


def test_the_unedited_config_json_still_loads(copy):
    model = LoopscaleForCausalLM.from_pretrained(copy)
    assert model.config.n_loops == json.loads((copy / "loopscale.json").read_text())["config"]["model"]["n_loops"]


# --- generate with bad ids -----------------------------------------------------------------------
def test_generate_with_empty_or_out_of_vocabulary_ids_is_one_line(run):
    model = LoopscaleForCausalLM.from_pretrained(run)
    V = model.lm.cfg.vocab_size
    for ids, message in ((torch.zeros((1, 0), dtype=torch.long), "empty"),
                         (torch.tensor([[5, V]]), f"id {V}, outside"),
                         (torch.tensor([[5, -1]]), "id -1, outside"),
                         (torch.tensor([[0.5, 1.0]]), "integer token ids")):
        for call in (lambda: model.generate(ids, max_new_tokens=2, do_sample=False), lambda: model(ids)):
            with pytest.raises(ValueError, match=message) as e:
                call()
            one_line(e)


# --- loading-time overrides and saving -----------------------------------------------------------
@pytest.mark.parametrize("override", [{"readout": "raw"}, {"seq_len": 8}, {"max_position_embeddings": 8},
                                      {"d_model": 64}, {"recurrence": "inter_loop_norm"}])
def test_overrides_the_weights_cannot_honour_are_refused(run, override):
    key = next(iter(override))
    for load in (lambda: LoopscaleForCausalLM.from_pretrained(run, **override),
                 lambda: AutoModelForCausalLM.from_pretrained(run, **override)):
        with pytest.raises(ValueError, match="cannot change") as e:
            load()
        assert LoopscaleConfig.attribute_map.get(key, key) in one_line(e)


def test_the_depth_may_be_overridden(run):
    model = AutoModelForCausalLM.from_pretrained(run, n_loops=5)
    assert model.config.n_loops == 5
    with pytest.raises(ValueError, match="n_loops"):
        AutoModelForCausalLM.from_pretrained(run, n_loops=LIMITS["n_loops"] + 1)


def test_save_pretrained_refuses_to_write_over_a_run(run, copy, tmp_path):
    model = LoopscaleForCausalLM.from_pretrained(run)
    before = {p.name: p.read_bytes() for p in copy.iterdir() if p.is_file()}
    with pytest.raises(FileExistsError, match="already holds a run") as e:
        model.save_pretrained(copy)
    one_line(e)
    assert {p.name: p.read_bytes() for p in copy.iterdir() if p.is_file()} == before
    model.save_pretrained(copy, overwrite=True)  # explicitly
    loopscale.load(copy)
    model.save_pretrained(tmp_path / "new")  # a new directory needs nothing
    assert (tmp_path / "new" / "model.safetensors").is_file()


# --- files that are not what they claim -----------------------------------------------------------
@pytest.mark.parametrize("name", ["loopscale.json", "config.json", "tokenizer.json"])
def test_a_file_linked_to_dev_zero_is_refused(copy, name):
    (copy / name).unlink()
    os.symlink("/dev/zero", copy / name)
    loads = [lambda: LoopscaleForCausalLM.from_pretrained(copy), lambda: _lm(run=str(copy))]
    for load in loads:
        e = finishes(load)
        assert isinstance(e, CheckpointError), repr(e)
        assert "not a regular file" in one_line(e) and name in str(e)


@pytest.mark.parametrize("name", ["config.json", "loopscale.json"])
def test_a_fifo_is_refused_without_blocking(copy, name):
    (copy / name).unlink()
    os.mkfifo(copy / name)
    loads = [lambda: LoopscaleForCausalLM.from_pretrained(copy), lambda: _lm(run=str(copy))]
    if name == "config.json":  # (the config alone reads no loopscale.json)
        loads.append(lambda: LoopscaleConfig.from_pretrained(copy))
    for load in loads:
        e = finishes(load, 60)
        assert isinstance(e, (CheckpointError, OSError)), repr(e)
        assert "FIFO" in one_line(e)


def test_an_oversized_json_file_is_refused(copy):
    from loopscale.runfiles import MAX_JSON_BYTES
    with open(copy / "config.json", "ab") as f:
        f.truncate(MAX_JSON_BYTES + 1)  # sparse: no disk used
    e = finishes(lambda: LoopscaleForCausalLM.from_pretrained(copy))
    assert isinstance(e, CheckpointError) and "too large" in one_line(e)


def test_json_nested_100000_deep_is_one_line(copy):
    deep = "[" * 100_000 + "]" * 100_000
    conf = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps(conf)[:-1] + f', "nested": {deep}}}')
    for load in (lambda: LoopscaleForCausalLM.from_pretrained(copy), lambda: LoopscaleConfig.from_pretrained(copy)):
        e = finishes(load)
        assert isinstance(e, (CheckpointError, OSError)), repr(e)
        assert "nested too deeply" in one_line(e)
