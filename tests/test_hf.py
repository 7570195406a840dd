"""A run directory is a Hugging Face model: AutoModelForCausalLM (remote code or registered
classes), model.generate and pipeline("text-generation") agree with loopscale's own code."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

import loopscale  # noqa: E402  (registers the classes with the Auto classes)
from loopscale.artifacts import WEIGHTS  # noqa: E402
from loopscale.generate import generate  # noqa: E402
from loopscale.hf import LoopscaleConfig, LoopscaleForCausalLM  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, pipeline  # noqa: E402
from transformers.modeling_outputs import CausalLMOutputWithPast  # noqa: E402
from hf_support import make_run  # noqa: E402

PROMPT = "The Congress of the United States"




@pytest.fixture(scope="module")
def run(smoke_data, tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("hf") / "run", smoke_data, readout="final_norm")


def _until_eos(ids, eos=2):
    return ids[:ids.index(eos) + 1] if eos in ids else ids


def test_config_json_is_a_hugging_face_config(run):
    conf = json.loads((run / "config.json").read_text())
    assert conf["model_type"] == "loopscale" and conf["architectures"] == ["LoopscaleForCausalLM"]
    assert conf["auto_map"]["AutoModelForCausalLM"] == "modeling_loopscale.LoopscaleForCausalLM"
    assert conf["n_loops"] == 3 and conf["seq_len"] == 32
    hf = AutoConfig.from_pretrained(run)
    assert isinstance(hf, LoopscaleConfig)
    assert (hf.max_position_embeddings, hf.hidden_size, hf.num_hidden_layers, hf.vocab_size) == (32, 32, 1, 512)
    assert json.loads((run / "loopscale.json").read_text())["config"]["model"]["n_loops"] == 3


@pytest.mark.parametrize("n_loops", [None, 1, 5])
def test_logits_equal_loopscale_load(run, n_loops):
    lm, tok, _ = loopscale.load(run)
    model = AutoModelForCausalLM.from_pretrained(run)
    assert isinstance(model, LoopscaleForCausalLM) and not model.training
    ids = torch.tensor([tok.encode(PROMPT).ids])
    out = model(ids, n_loops=n_loops)
    assert isinstance(out, CausalLMOutputWithPast)
    with torch.no_grad():
        ref = lm.logits(lm(ids, n_loops=n_loops)[-1], final=True)
    torch.testing.assert_close(out.logits, ref, rtol=0, atol=0)
    # the loop count as a config field
    deep = AutoModelForCausalLM.from_pretrained(run, n_loops=5)
    assert deep.config.n_loops == 5
    with torch.no_grad():
        torch.testing.assert_close(deep(ids).logits, lm.logits(lm(ids, n_loops=5)[-1]), rtol=0, atol=0)


@pytest.mark.parametrize("n_loops", [3, 5])
def test_greedy_generate_equals_loopscale_generate(run, n_loops):
    """KV cache, any depth, and 70 new tokens after a 6-token prompt: the 32-position window slides."""
    lm, tok, _ = loopscale.load(run)
    model = AutoModelForCausalLM.from_pretrained(run)
    prompt = tok.encode(PROMPT).ids
    ref = generate(lm, prompt, 70, n_loops=n_loops)
    assert ref.slides >= 2
    out = model.generate(torch.tensor([prompt]), max_new_tokens=70, do_sample=False, n_loops=n_loops)
    got = out[0, len(prompt):].tolist()
    assert got == _until_eos(ref.tokens)
    assert len(set(got)) > 3  # a varied continuation, not one repeated id


def test_pipeline_text_generation(run):
    lm, tok, _ = loopscale.load(run)
    pipe = pipeline("text-generation", model=str(run))
    text = pipe(PROMPT, max_new_tokens=12, do_sample=False)[0]["generated_text"]
    ref = generate(lm, tok.encode(PROMPT).ids, 12)
    assert text == PROMPT + tok.decode(_until_eos(ref.tokens), skip_special_tokens=True)
    assert isinstance(AutoTokenizer.from_pretrained(run), transformers.PreTrainedTokenizerBase)


def test_forward_refuses_overlong_inputs_and_bad_depths(run):
    model = AutoModelForCausalLM.from_pretrained(run)
    ids = torch.randint(4, 512, (2, 8))
    with pytest.raises(ValueError, match="learned positions"):
        model(torch.randint(4, 512, (1, 33)))
    for bad in (0, -1, 10**8, 2.5):
        with pytest.raises(ValueError, match="n_loops"):
            model(ids, n_loops=bad)
    assert model(ids, attention_mask=torch.ones(2, 8, dtype=torch.long)).logits.shape == (2, 8, 512)


PROMPTS = ["The Congress of the United States", "We the people",
           "to pay the debts and provide for the common defence and general welfare of the"]


def _padded(run, side):
    tok = AutoTokenizer.from_pretrained(run)
    tok.padding_side = side
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    lengths = enc["attention_mask"].sum(1)
    assert len(set(lengths.tolist())) == len(PROMPTS)  # every row padded differently (one not at all)
    return enc


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_forward_equals_each_row_alone(run, side):
    """Row i of a padded batch: its attended positions' logits, hidden states and exit logits
    are those of the row given alone; a masked position carries the last attended one's."""
    model = AutoModelForCausalLM.from_pretrained(run)
    enc = _padded(run, side)
    out = model(**enc, output_hidden_states=True)
    for i in range(len(PROMPTS)):
        keep = enc["attention_mask"][i].bool()
        alone = model(enc["input_ids"][i:i + 1, keep], output_hidden_states=True)
        torch.testing.assert_close(out.logits[i, keep], alone.logits[0], rtol=0, atol=0)
        for a, b in zip(out.hidden_states + out.exit_logits, alone.hidden_states + alone.exit_logits):
            torch.testing.assert_close(a[i, keep], b[0], rtol=0, atol=0)
        torch.testing.assert_close(out.logits[i, -1], alone.logits[0, -1], rtol=0, atol=0)  # the next-token logits


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batched_generate_equals_unbatched_at_every_depth(run, side):
    """A padded batch through model.generate: every row's greedy tokens are `loopscale generate`'s
    for that prompt alone, at every depth k = 1..K+1 (40 new tokens: the window slides)."""
    lm, tok, cfg = loopscale.load(run)
    model = AutoModelForCausalLM.from_pretrained(run)
    enc = _padded(run, side)
    for k in range(1, cfg.model.n_loops + 2):
        out = model.generate(**enc, max_new_tokens=40, do_sample=False, n_loops=k)
        for i, prompt in enumerate(PROMPTS):
            ref = _until_eos(generate(lm, tok.encode(prompt).ids, 40, n_loops=k).tokens)
            assert out[i, enc["input_ids"].shape[1]:].tolist()[:len(ref)] == ref, (k, i)


def test_batched_pipeline_equals_unbatched_at_every_depth(run):
    lm, tok, cfg = loopscale.load(run)
    for k in range(1, cfg.model.n_loops + 1):
        pipe = pipeline("text-generation", model=str(run))
        pipe.tokenizer.padding_side = "left"
        got = pipe(PROMPTS, batch_size=len(PROMPTS), max_new_tokens=12, do_sample=False, n_loops=k)
        for prompt, g in zip(PROMPTS, got):
            ref = generate(lm, tok.encode(prompt).ids, 12, n_loops=k)
            assert g[0]["generated_text"] == prompt + tok.decode(_until_eos(ref.tokens), skip_special_tokens=True), k


def test_hidden_states_and_exit_logits_per_loop(run):
    """output_hidden_states=True: hidden_states[k] = H_k (hidden_states[0] the embedded input),
    exit_logits[k-1] = loop k's exit read out as trained; also from model.generate."""
    lm, tok, cfg = loopscale.load(run)
    model = AutoModelForCausalLM.from_pretrained(run)
    ids = torch.tensor([tok.encode(PROMPT).ids])
    for n in (1, cfg.model.n_loops, cfg.model.n_loops + 2):
        out = model(ids, output_hidden_states=True, n_loops=n)
        with torch.no_grad():
            states = lm(ids, n_loops=n)
            assert len(out.hidden_states) == n + 1 and len(out.exit_logits) == n
            torch.testing.assert_close(out.hidden_states[0], lm.embed(ids), rtol=0, atol=0)
            for k in range(1, n + 1):
                torch.testing.assert_close(out.hidden_states[k], states[k - 1], rtol=0, atol=0)
                torch.testing.assert_close(out.exit_logits[k - 1], lm.logits(states[k - 1], final=k == n, k=k),
                                           rtol=0, atol=0)
        torch.testing.assert_close(out.exit_logits[-1], out.logits, rtol=0, atol=0)
        assert not torch.equal(out.exit_logits[0], out.logits) or n == 1  # final_norm: exits differ
    assert model(ids).hidden_states is None  # only when asked
    g = model.generate(ids, max_new_tokens=3, do_sample=False, output_hidden_states=True,
                       return_dict_in_generate=True)
    assert len(g.hidden_states) == 3 and all(len(step) == cfg.model.n_loops + 1 for step in g.hidden_states)
    with torch.no_grad():  # the last step's hidden states: those of the new token at its position
        full = lm(g.sequences[:, :-1])
    torch.testing.assert_close(g.hidden_states[-1][-1][:, -1], full[-1][:, -1], rtol=1e-5, atol=1e-5)


def _margin_threshold(lm, ids):
    """A margin threshold at which about half the tokens exit at loop 1."""
    with torch.no_grad():
        z = lm.logits(lm(torch.tensor([ids]))[0], final=False, k=1).float()[0]
    from loopscale.halting import confidences
    return float(confidences(z)["margin"].median())


def test_halting_generate_equals_the_cli(run, capsys):
    """model.generate(halt="margin", threshold=τ): `loopscale generate --halt margin --threshold τ`'s
    text, the tokens and their exits of loopscale.generate's per-token halting."""
    from loopscale.cli import main
    from loopscale.generate import Halt
    lm, tok, cfg = loopscale.load(run)
    model = AutoModelForCausalLM.from_pretrained(run)
    ids = tok.encode(PROMPT, add_special_tokens=False).ids
    tau = _margin_threshold(lm, ids)
    ref = generate(lm, ids, 30, halt=Halt("margin", tau))
    assert 1 in ref.loops and cfg.model.n_loops in ref.loops  # some tokens exit early, some do not
    out = model.generate(torch.tensor([ids]), max_new_tokens=30, do_sample=False, halt="margin", threshold=tau,
                         return_dict_in_generate=True)
    got = out.sequences[0, len(ids):].tolist()
    assert got == _until_eos(ref.tokens)
    assert out.past_key_values.loops[0][:len(got)] == ref.loops[:len(got)]
    assert main(["generate", "--run", str(run), "--prompt", PROMPT, "--max-new-tokens", "30",
                 "--halt", "margin", "--threshold", repr(tau)]) == 0
    cli = capsys.readouterr().out
    assert cli.rstrip("\n") == PROMPT + tok.decode(ref.tokens, skip_special_tokens=False)
    assert tok.decode(got, skip_special_tokens=False) == tok.decode(_until_eos(ref.tokens), skip_special_tokens=False)
    # without halting the tokens differ: the policy was applied
    assert model.generate(torch.tensor([ids]), max_new_tokens=30, do_sample=False)[0, len(ids):].tolist() != got


def test_halting_in_a_padded_batch_equals_each_prompt_alone(run):
    from loopscale.generate import Halt
    lm, tok, cfg = loopscale.load(run)
    model = AutoModelForCausalLM.from_pretrained(run)
    enc = _padded(run, "left")
    tau = _margin_threshold(lm, tok.encode(PROMPT).ids)
    out = model.generate(**enc, max_new_tokens=20, do_sample=False, halt="margin", threshold=tau)
    for i, prompt in enumerate(PROMPTS):
        ref = _until_eos(generate(lm, tok.encode(prompt).ids, 20, halt=Halt("margin", tau)).tokens)
        assert out[i, enc["input_ids"].shape[1]:].tolist()[:len(ref)] == ref, i


def test_halting_arguments_are_checked(run):
    model = AutoModelForCausalLM.from_pretrained(run)
    ids = torch.tensor([[5, 6, 7]])
    for kw, message in (({"halt": "sometimes"}, "unknown policy"), ({"threshold": 0.5}, "threshold needs halt"),
                        ({"halt": "margin", "threshold": float("nan")}, "finite"),
                        ({"halt": "margin", "threshold": "abc"}, "finite"),
                        ({"halt": "margin", "threshold": 1.0, "use_cache": False}, "KV cache"),
                        ({"halt": "margin"}, "halting.json not found")):
        with pytest.raises((ValueError, FileNotFoundError), match=message):
            model.generate(ids, max_new_tokens=2, do_sample=False, **kw)


def test_an_older_layout_run_still_loads(run, tmp_path):
    """A run written before loopscale.json: config.json held the run record, the safetensors
    metadata only its format."""
    old = tmp_path / "old"
    shutil.copytree(run, old)
    record = json.loads((old / "loopscale.json").read_text())
    (old / "loopscale.json").unlink()
    (old / "modeling_loopscale.py").unlink()
    (old / "config.json").write_text(json.dumps({"config": record["config"], "data": record["data"]}))
    lm, _, cfg = loopscale.load(run)
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in lm.state_dict().items()}, str(old / WEIGHTS), metadata={"format": "pt"})
    lm_old, tok, cfg_old = loopscale.load(old)
    assert cfg_old == cfg
    ids = torch.tensor([tok.encode(PROMPT).ids])
    model = LoopscaleForCausalLM.from_pretrained(old)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, lm.logits(lm(ids)[-1]), rtol=0, atol=0)


def test_save_pretrained_writes_a_run_loopscale_loads(run, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(run)
    model.save_pretrained(tmp_path / "saved")
    shutil.copy(run / "tokenizer.json", tmp_path / "saved" / "tokenizer.json")
    lm, tok, _ = loopscale.load(tmp_path / "saved")
    ids = torch.tensor([tok.encode(PROMPT).ids])
    with torch.no_grad():
        torch.testing.assert_close(lm.logits(lm(ids)[-1]), model(ids).logits, rtol=0, atol=0)


@pytest.mark.slow  # two fresh Python processes importing transformers (tens of seconds on 2 cores)
def test_remote_code_and_registration(run, tmp_path):
    """In a fresh process: trust_remote_code=True loads the run's modeling_loopscale.py; after
    `import loopscale` (before or after transformers) no remote code is needed; without either
    transformers asks for trust_remote_code."""
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    code = f"""
import sys
import loopscale
assert 'transformers' not in sys.modules and 'torch' not in sys.modules  # nothing heavy on import
import torch
from transformers import AutoModelForCausalLM
lm, tok, _ = loopscale.load({str(run)!r})
ids = torch.tensor([tok.encode("The Congress").ids])
ref = lm.logits(lm(ids)[-1])
for kw in ({{}}, {{"trust_remote_code": True}}):
    m = AutoModelForCausalLM.from_pretrained({str(run)!r}, **kw)
    assert torch.equal(m(ids).logits, ref), kw
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
    code = f"""
from transformers import AutoModelForCausalLM
m = AutoModelForCausalLM.from_pretrained({str(run)!r}, trust_remote_code=True)
assert type(m).__name__ == "LoopscaleForCausalLM"
try:
    AutoModelForCausalLM.from_pretrained({str(run)!r})
    raise SystemExit("loaded without trust_remote_code")
except ValueError as e:
    assert "trust_remote_code" in str(e)
print("ok")
"""
    # (transformers asks on stdin whether to run the remote code: no answer, so it refuses)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]  # after the question


def _bundled_sources(path):
    """{module: source} carried by a run's modeling_loopscale.py (read without running it)."""
    import ast
    tree = ast.parse(path.read_text())
    node = next(n for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "_SOURCES")
    return {k: "\n".join(v) for k, v in ast.literal_eval(node.value).items()}


def test_modeling_file_is_self_contained_and_generated_from_the_package(run):
    """The run's modeling_loopscale.py imports no loopscale and names no sibling file (transformers'
    own import scan), and carries the package's source files verbatim: hf.py and what it imports."""
    from pathlib import Path

    from transformers.dynamic_module_utils import get_imports, get_relative_imports
    path = run / "modeling_loopscale.py"
    assert "loopscale" not in get_imports(path) and get_relative_imports(path) == []
    sources = _bundled_sources(path)
    pkg = Path(loopscale.__file__).parent
    assert {"hf", "model", "artifacts", "config", "generate"} <= set(sources)
    for name, text in sources.items():
        assert text == (pkg / f"{name}.py").read_text(), name
    # every sibling module a bundled module imports at its top level is bundled too
    from loopscale.remote import _top_level_imports
    for name, text in sources.items():
        assert _top_level_imports(text) <= set(sources), name


@pytest.mark.slow  # a fresh Python process importing transformers (tens of seconds on 2 cores)
def test_remote_code_loads_without_loopscale(run, tmp_path):
    """trust_remote_code=True in a Python where loopscale cannot be imported (no site processing,
    so no editable-install hook, and an import blocker): logits and greedy tokens equal loopscale's."""
    import site
    out = tmp_path / "out.pt"
    code = f"""
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "loopscale" or name.startswith("loopscale."):
            raise ModuleNotFoundError("No module named " + repr(name))
sys.meta_path.insert(0, Block())
sys.path.extend({site.getsitepackages()!r})
try:
    import loopscale
    raise SystemExit("loopscale is importable")
except ModuleNotFoundError:
    pass
import torch
from transformers import AutoModelForCausalLM
m = AutoModelForCausalLM.from_pretrained({str(run)!r}, trust_remote_code=True)
ids = torch.tensor([{list(range(5, 25))!r}])
torch.save({{"logits": m(ids).logits, "deep": m(ids, n_loops=5).logits,
            "gen": m.generate(ids, max_new_tokens=30, do_sample=False)}}, {str(out)!r})
assert not any(k == "loopscale" or k.startswith("loopscale.") for k in sys.modules)
print(type(m).__module__)
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    r = subprocess.run([sys.executable, "-S", "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().startswith("_loopscale_") and r.stdout.strip().endswith(".hf")
    got = torch.load(out)
    lm, _, _ = loopscale.load(run)
    ids = torch.tensor([list(range(5, 25))])
    model = AutoModelForCausalLM.from_pretrained(run)
    with torch.no_grad():
        torch.testing.assert_close(got["logits"], lm.logits(lm(ids)[-1]), rtol=0, atol=0)
        torch.testing.assert_close(got["deep"], lm.logits(lm(ids, n_loops=5)[-1]), rtol=0, atol=0)
    assert got["gen"].tolist() == model.generate(ids, max_new_tokens=30, do_sample=False).tolist()
