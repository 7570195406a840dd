"""convert-paper on the official release's own checkpoints (tests/fixtures/official/*/last.pt):
no flags, per-exit logits equal to the official forward's (exits.pt), and every malformed or
unrepresentable checkpoint refused in one line."""
import json
import time
import zipfile
from pathlib import Path

import pytest
import torch
from convert_support import _base, _refused, _set, _with
from official import CHECKPOINTS, eval_windows, trained_conditions
from official import OFFICIAL as FIX

import loopscale
from loopscale.cli import main
from loopscale.convert import convert_paper
from loopscale.io import run_lock

EPS32 = torch.finfo(torch.float32).eps


def _bound(ref: torch.Tensor) -> float:
    """1e-5, plus 4 fp32 ulps of the largest value: the official code itself, rerun on another
    CPU, differs from its exits.pt by a few ulps of the largest logit (~57 for a raw readout)."""
    return 1e-5 + 4 * EPS32 * float(ref.abs().max())


def _expected(config: dict) -> tuple:
    """(readout, recurrence, loss) as the official config keys define them (official defaults)."""
    m, sup = config["model"], config.get("supervision", {})
    if not m.get("use_decode_norm", True):
        readout = "raw"
    elif m.get("decode_norm_final_only", False):
        readout = "final_norm"
    else:
        readout = m.get("decode_norm_type", "rmsnorm")
    recurrence = "inter_loop_norm" if m.get("inter_loop_norm", True) else \
        "spectral_damping" if m.get("use_spectral_damping", False) else "residual"
    loss = {"per-step": "per_loop", "terminal": "terminal", "adaptive": "adaptive"}[sup.get("mode", "per-step")]
    return readout, recurrence, loss


def _exits(model, idx):
    states = model(idx)
    K = len(states)
    return states, torch.stack([model.logits(h, k == K - 1, k + 1) for k, h in enumerate(states)])


def test_the_fixtures_hold_checkpoints():
    # one checkpoint per condition the official trainer ran (the set's scripts/commands.sh)
    assert trained_conditions() and sorted(p.parent.name for p in CHECKPOINTS) == sorted(trained_conditions())


@pytest.mark.parametrize("ckpt", CHECKPOINTS, ids=lambda p: p.parent.name)
def test_every_official_checkpoint_converts_with_no_flags_and_matches_the_official_forward(ckpt, tmp_path):
    rec = convert_paper(ckpt, tmp_path / "run")
    official = torch.load(ckpt, weights_only=True)
    ref = torch.load(ckpt.parent / "exits.pt", weights_only=True)
    model, _, cfg = loopscale.load(tmp_path / "run" / "model.pt")  # what `loopscale eval` reads
    m = official["config"]["model"]
    assert (cfg.model.readout, cfg.model.recurrence, cfg.objective.loss) == _expected(official["config"])
    assert (cfg.model.d_model, cfg.model.n_heads, cfg.model.n_layers, cfg.model.n_loops, cfg.model.seq_len) == (
        m["d_model"], m["num_heads"], m["num_layers"], m["num_loops"], official["config"]["data"]["seq_len"])
    assert cfg.model.d_ff == m["d_model"] * m["ff_multiplier"]
    pen = official["config"].get("supervision", {}).get("norm_penalty_weight", 0.0)
    assert cfg.objective.regularizer == ("norm_penalty" if pen > 0 else "none")
    if pen > 0:
        assert cfg.objective.penalty_weight == pen
    assert rec["sha256"] == __import__("hashlib").sha256(ckpt.read_bytes()).hexdigest()
    model.eval()
    with torch.no_grad():
        states, logits = _exits(model, ref["input_ids"])
        torch.testing.assert_close(logits, ref["logits"], rtol=0, atol=_bound(ref["logits"]))
        torch.testing.assert_close(torch.stack(states), ref["hidden"], rtol=0, atol=_bound(ref["hidden"]))
        norms = torch.tensor([h.norm(dim=-1).mean().item() for h in states], dtype=torch.float64)
        torch.testing.assert_close(norms, ref["all_norms"], rtol=1e-6, atol=1e-6)
        ce = torch.stack([torch.nn.functional.cross_entropy(z.reshape(-1, z.shape[-1]), ref["labels"].reshape(-1))
                          for z in logits])
        torch.testing.assert_close(ce, ref["ce_per_exit"], rtol=1e-5, atol=1e-5)
        if cfg.objective.loss == "adaptive":  # the exit gate is kept where the loss reads it
            gates = torch.stack([model.gate_logits(h) for h in states])
            torch.testing.assert_close(gates, ref["gate_logits"], rtol=0, atol=1e-5)
            torch.testing.assert_close(model.exit_pdf(states), ref["exit_pdf"], rtol=0, atol=1e-6)
        else:
            assert model.exit_gate is None and {"exit_gate.weight", "exit_gate.bias"} <= set(rec["dropped"])
        # the artifacts (safetensors + tokenizer) load into the same model
        art, tok, _ = loopscale.load(tmp_path / "run")
        assert torch.equal(_exits(art.eval(), ref["input_ids"])[1], logits)
    # the tokenizer: the official ids, one per itos entry
    itos = official["tokenizer"]["itos"]
    assert all(tok.token_to_id(w) == i for i, w in enumerate(itos))
    assert tok.get_vocab_size(with_added_tokens=True) == len(itos)


def test_the_cli_converts_with_no_flags(tmp_path, capsys):
    ckpt = next(p for p in CHECKPOINTS if p.parent.name == "perstep_spectral") if \
        (FIX / "perstep_spectral" / "last.pt").exists() else CHECKPOINTS[0]
    assert main(["convert-paper", str(ckpt), "--out", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"converted {ckpt}") and "readout" in out and "recurrence" in out
    info = json.loads((tmp_path / "run" / "loopscale.json").read_text())
    assert info["converted_from"]["official_config"] == torch.load(ckpt, weights_only=True)["config"]
    assert json.loads((tmp_path / "run" / "config.json").read_text())["model_type"] == "loopscale"  # HF config
    import loopscale
    model, _, _ = loopscale.load(tmp_path / "run")  # the converted run loads, verified
    assert model.cfg.recurrence == info["config"]["model"]["recurrence"]


# ---------------------------------------------------------------------------
# refusals: one line naming what is wrong, nothing written
# ---------------------------------------------------------------------------








def _model(key):
    return lambda ck: ck["config"]["model"][key]


def _rows(ck) -> int:
    return ck["model_state"]["token_embedding.weight"].shape[0]


UNREPRESENTABLE = {
    "block_norm_layernorm": (_set("model", "block_norm_type", "layernorm"), "model.block_norm_type 'layernorm'"),
    "unknown_decode_norm": (_set("model", "decode_norm_type", "scalenorm"), "model.decode_norm_type 'scalenorm'"),
    "final_only_alpha": (lambda ck: ck["config"]["model"].update(decode_norm_final_only=True,
                                                                 decode_norm_type="alpha_readout"),
                         "model.decode_norm_final_only"),
    "ilnorm_and_damping": (lambda ck: ck["config"]["model"].update(inter_loop_norm=True, use_spectral_damping=True),
                           "model.use_spectral_damping"),
    "ilnorm_tapernorm": (lambda ck: ck["config"]["model"].update(inter_loop_norm=True, loop_norm_type="tapernorm"),
                         "model.loop_norm_type"),
    "unknown_supervision": (_set("supervision", "mode", "denoise"), "supervision.mode 'denoise'"),
    "untied_config": (_set("model", "tie_weights", False), "model.tie_weights"),
    "two_regularizers": (lambda ck: ck["config"]["supervision"].update(norm_penalty_weight=0.01,
                                                                      scale_anchor_weight=0.1),
                         "supervision.scale_anchor_weight"),
    "unknown_model_key": (_set("model", "use_rope", True), "model.use_rope is not a key of the official code"),
    "unknown_alpha_key": (_set("alpha_readout", "gain", True), "alpha_readout.gain is not a key"),
    "string_flag": (_set("model", "use_decode_norm", "yes"), "model.use_decode_norm must be true or false"),
}


@pytest.mark.parametrize("case", UNREPRESENTABLE)
def test_what_loopscale_cannot_represent_is_refused_naming_the_official_key(case, tmp_path, capsys):
    mutate, needle = UNREPRESENTABLE[case]
    _refused(tmp_path, capsys, _with(mutate), needle)


def _state(fn):
    return lambda ck: fn(ck["model_state"])


MALFORMED = {
    "d_model_disagrees": (_set("model", "d_model", lambda ck: 2 * _model("d_model")(ck)),
                          lambda ck: f"model.d_model={2 * _model('d_model')(ck)} disagrees with the weights"),
    "d_model_fractional": (_set("model", "d_model", lambda ck: _model("d_model")(ck) + 0.5),
                           "model.d_model must be an integer"),
    "layers_disagree": (_set("model", "num_layers", lambda ck: _model("num_layers")(ck) + 1),
                        lambda ck: f"model.num_layers={_model('num_layers')(ck) + 1} disagrees"),
    "seq_len_disagrees": (_set("data", "seq_len", lambda ck: 2 * ck["config"]["data"]["seq_len"]),
                          "position_embedding.weight has shape"),
    "no_num_loops": (lambda ck: ck["config"]["model"].pop("num_loops"), "no model.num_loops"),
    "dropout_string": (_set("model", "dropout", "0.1"), "model.dropout must be a finite number"),
    "wrong_shape": (_state(lambda s: s.__setitem__("layers.0.attn.qkv.weight", s["layers.0.attn.qkv.weight"][:-1])),
                    "layers.0.attn.qkv.weight has shape"),
    "model_state_list": (lambda ck: ck.__setitem__("model_state", list(ck["model_state"].values())),
                         "model_state is a list"),
    "int_keys": (_state(lambda s: s.__setitem__(7, torch.zeros(1))), "non-string key 7"),
    "non_tensor": (_state(lambda s: s.__setitem__("layers.0.ffn.w2.weight", "weights")),
                   "layers.0.ffn.w2.weight is a str, not a tensor"),
    "int64_weights": (_state(lambda s: s.__setitem__("layers.0.ffn.w2.weight",
                                                     s["layers.0.ffn.w2.weight"].long())),
                      "layers.0.ffn.w2.weight has dtype torch.int64"),
    "sparse_weight": (_state(lambda s: s.__setitem__("layers.0.ffn.w2.weight", s["layers.0.ffn.w2.weight"].to_sparse())),
                      "layers.0.ffn.w2.weight is not a plain dense tensor"),
    "nan_weight": (_state(lambda s: s["layers.0.ffn.w1.weight"].__setitem__((0, 0), float("nan"))),
                   "layers.0.ffn.w1.weight holds NaN"),
    "unexpected_tensor": (_state(lambda s: s.__setitem__("layers.0.attn.rope", torch.ones(3))),
                          "unexpected entry layers.0.attn.rope"),
    "untied_head": (_state(lambda s: s.__setitem__("lm_head.weight", s["lm_head.weight"] + 1)), "untied head"),
    "no_embedding": (_state(lambda s: s.pop("token_embedding.weight")), "no 2-d token_embedding.weight"),
    "tokenizer_garbage": (lambda ck: ck.__setitem__("tokenizer", "%%% not a tokenizer"), "not tokenizer JSON"),
    "tokenizer_json_garbage": (lambda ck: ck.__setitem__("tokenizer", "{not json"), "not a valid tokenizers JSON"),
    "tokenizer_not_utf8": (lambda ck: ck.__setitem__("tokenizer", b"\xff\xfe{"), "not UTF-8"),
    "tokenizer_wrong_kind": (lambda ck: ck["tokenizer"].__setitem__("kind", "bpe"), "tokenizer kind 'bpe'"),
    "tokenizer_itos_not_list": (lambda ck: ck["tokenizer"].__setitem__("itos", 5), "itos must be a list"),
    "tokenizer_empty": (lambda ck: ck["tokenizer"].__setitem__("itos", []), "empty vocabulary"),
    "tokenizer_duplicate": (lambda ck: ck["tokenizer"]["itos"].__setitem__(5, ck["tokenizer"]["itos"][4]),
                            "twice in itos"),
    "tokenizer_bad_pattern": (lambda ck: ck["tokenizer"].__setitem__("pattern", "(["), "not a valid regular"),
    "tokenizer_list": (lambda ck: ck.__setitem__("tokenizer", ["a", "b"]), "is not understood"),
    "ids_beyond_embedding": (lambda ck: ck["tokenizer"]["itos"].extend(["zzz1", "zzz2"]),
                             lambda ck: f"the tokenizer's ids reach {len(ck['tokenizer']['itos']) + 1} "
                                        f"but the embedding has only {_rows(ck)} rows"),
    "no_model_state": (lambda ck: ck.pop("model_state"), "has no 'model_state'"),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_checkpoints_are_refused_in_one_line(case, tmp_path, capsys):
    mutate, needle = MALFORMED[case]
    _refused(tmp_path, capsys, _with(mutate), needle(_base()) if callable(needle) else needle)


def test_a_fixed_alpha_that_disagrees_with_the_weights_is_refused(tmp_path, capsys):
    if not (FIX / "perstep_alpha_readout" / "last.pt").exists():
        pytest.skip("no alpha-readout fixture")

    def fixed(ck):
        ck["config"].setdefault("alpha_readout", {})["fixed_alpha"] = 0.3
        s = ck["model_state"]
        s["decode_norm.alpha_value"] = torch.tensor(0.5)
        s["decode_norm.alpha_logit"] = torch.tensor(0.0)
    _refused(tmp_path, capsys, _with(fixed, "perstep_alpha_readout"), "alpha_readout.fixed_alpha=0.3 disagrees")
    # and a fixed alpha the config does not declare is not dropped silently
    ck = _with(fixed, "perstep_alpha_readout")
    del ck["config"]["alpha_readout"]
    _refused(tmp_path, capsys, ck, "unexpected entry decode_norm.alpha_value")


def test_a_tokenizer_path_in_the_checkpoint_is_never_opened(tmp_path, capsys, monkeypatch):
    run = tmp_path / "other"
    convert_paper(CHECKPOINTS[0], run)
    opened = []
    real_open = Path.open

    def spy(self, *a, **k):
        if self.name == "tokenizer.json":
            opened.append(self)
        return real_open(self, *a, **k)
    monkeypatch.setattr(Path, "open", spy)
    _refused(tmp_path, capsys, _with(lambda ck: ck.__setitem__("tokenizer", str(run / "tokenizer.json"))),
             "a path in a checkpoint is never opened")
    assert not opened


def test_tokenizer_file_problems_are_one_line(tmp_path, capsys):
    ck = _base()
    _refused(tmp_path, capsys, ck, "missing.json: file not found", ["--tokenizer", str(tmp_path / "missing.json")])
    (tmp_path / "bin.json").write_bytes(b"\xff\xfe\x00garbage")
    _refused(tmp_path, capsys, ck, "not UTF-8", ["--tokenizer", str(tmp_path / "bin.json")])
    (tmp_path / "junk.json").write_text("{\"model\": 3}")
    _refused(tmp_path, capsys, ck, "not a valid tokenizers JSON", ["--tokenizer", str(tmp_path / "junk.json")])
    # two ids, but the larger one lies beyond the embedding: max id + 1 counts, not the number of ids
    from tokenizers import Tokenizer, models
    far = _rows(ck)  # the first id past the embedding's last row
    Tokenizer(models.WordLevel({"<unk>": 0, "far": far}, unk_token="<unk>")).save(str(tmp_path / "sparse.json"))
    _refused(tmp_path, capsys, ck, f"ids reach {far} but the embedding has only {far} rows",
             ["--tokenizer", str(tmp_path / "sparse.json")])


def test_a_file_that_is_no_checkpoint_gets_no_trust_pickle_hint(tmp_path, capsys):
    line = _refused(tmp_path, capsys, b"just some text, not a checkpoint\n", "not a readable torch checkpoint")
    assert "--trust-pickle" not in line


def test_a_zip_bomb_is_refused_before_loading(tmp_path, capsys):
    path = tmp_path / "bad.pt"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as z:
        with z.open("archive/data/0", "w") as f:
            block = bytes(1 << 20)
            for _ in range(80):  # 80 MiB of zeros, ~80 kB on disk
                f.write(block)
    assert path.stat().st_size < 1 << 20
    _refused(tmp_path, capsys, None, "inflates to")


def test_the_checkpoint_is_hashed_by_streaming(tmp_path, monkeypatch):
    real = Path.read_bytes

    def read_bytes(self):
        if self.suffix == ".pt":
            raise AssertionError(f"read_bytes on {self}")
        return real(self)
    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    assert len(convert_paper(CHECKPOINTS[0], tmp_path / "run")["sha256"]) == 64


# ---------------------------------------------------------------------------
# the run directory: never overwritten silently, locked while written
# ---------------------------------------------------------------------------
def test_an_existing_run_is_refused_unless_forced(tmp_path, capsys):
    run = tmp_path / "run"
    convert_paper(CHECKPOINTS[0], run)
    (run / "eval").mkdir()
    (run / "eval" / "depth.json").write_text("{}")
    (run / "summary.json").write_text("{}")
    before = (run / "model.pt").read_bytes()
    capsys.readouterr()
    assert main(["convert-paper", str(CHECKPOINTS[-1]), "--out", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "already holds a run" in err[0] and "--force" in err[0]
    assert (run / "model.pt").read_bytes() == before and (run / "eval" / "depth.json").exists()
    assert main(["convert-paper", str(CHECKPOINTS[-1]), "--out", str(run), "--force"]) == 0
    assert not (run / "eval").exists() and not (run / "summary.json").exists()  # nothing of the old run stays
    assert json.loads((run / "loopscale.json").read_text())["converted_from"]["checkpoint"] == \
        str(CHECKPOINTS[-1].resolve())


def test_force_replaces_runs_only(tmp_path, capsys):
    d = tmp_path / "notes"
    d.mkdir()
    (d / "todo.txt").write_text("mine")
    capsys.readouterr()
    assert main(["convert-paper", str(CHECKPOINTS[0]), "--out", str(d), "--force"]) == 2
    assert "not a loopscale run" in capsys.readouterr().err
    assert (d / "todo.txt").read_text() == "mine"


def test_the_run_lock_is_taken(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    with run_lock(run, "loopscale train"):
        capsys.readouterr()
        assert main(["convert-paper", str(CHECKPOINTS[0]), "--out", str(run)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "in use by loopscale train" in err[0]
    assert not (run / "model.pt").exists()


def test_diagnostics_run_on_a_converted_run(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["convert-paper", str(CHECKPOINTS[0]), "--out", str(run)]) == 0
    data = tmp_path / "data"
    corpus = FIX / "corpus"
    assert main(["prepare-data", "--set", "data.source=text-files", "--set", f"data.train_file={corpus / 'train.txt'}",
                 "--set", f"data.validation_file={corpus / 'validation.txt'}", "--tokenizer",
                 str(run / "tokenizer.json"), "--out", str(data)]) == 0, capsys.readouterr().err
    capsys.readouterr()
    official = torch.load(CHECKPOINTS[0], weights_only=True)["config"]
    tokens = eval_windows("radial_clamp_intervention", CHECKPOINTS[0].parent.name) * official["data"]["seq_len"]
    assert main(["eval", "depth", "--model", str(run / "model.pt"), "--data", str(data),
                 "--out", str(tmp_path / "depth.json"), "--set", "eval.device=cpu",
                 "--set", f"eval.max_tokens={tokens}"]) == 0, capsys.readouterr().err
    depth = json.loads((tmp_path / "depth.json").read_text())
    assert len(depth["exits"]) == official["model"]["num_loops"]


def test_load_official_and_the_dict_form_give_the_converted_model(tmp_path):
    from loopscale.convert import convert_state, load_official, model_settings
    ckpt = CHECKPOINTS[-1]
    model, cfg, raw, dropped = load_official(ckpt)
    assert not model.training and raw["config"] == torch.load(ckpt, weights_only=True)["config"]
    settings, source = model_settings(raw["config"], raw["model_state"], {"dropout": 0.0})
    assert settings["readout"] == cfg.model.readout and source["dropout"] == "override"
    state, dropped2 = convert_state(raw["model_state"], settings)
    assert dropped2 == dropped and state.keys() == model.state_dict().keys()
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("ckpt", CHECKPOINTS, ids=lambda p: p.parent.name)
def test_the_exit_gate_kept_on_request_matches_the_official_gate(ckpt):
    """Every official model has an exit gate (trained only by the adaptive loss); with
    --set model.exit_gate=true it is kept, and its logits and exit distribution equal the
    official forward's; the norm-penalty term too."""
    from loopscale.convert import load_official
    model, cfg, _, dropped = load_official(ckpt, ["model.exit_gate=true"])
    assert not any(n.startswith("exit_gate") for n in dropped)
    ref = torch.load(ckpt.parent / "exits.pt", weights_only=True)
    with torch.no_grad():
        states = model(ref["input_ids"])
        gates = torch.stack([model.gate_logits(h) for h in states])
        torch.testing.assert_close(gates, ref["gate_logits"], rtol=0, atol=_bound(ref["gate_logits"]))
        torch.testing.assert_close(model.exit_pdf(states), ref["exit_pdf"], rtol=0, atol=1e-6)
        sq = torch.stack([h.pow(2).mean() for h in states])
        torch.testing.assert_close(sq, ref["all_hidden_norms_sq"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("ckpt", CHECKPOINTS, ids=[p.parent.name for p in CHECKPOINTS])
def test_every_converted_run_loads_verified_with_the_same_logits(ckpt, tmp_path):
    """The run convert-paper writes (the artifact layout, buffers such as the alpha readout's
    EMA count and TaperNorm's flag included) passes loopscale.load's checks unchanged."""
    import loopscale
    from loopscale.convert import convert_paper, load_official
    convert_paper(ckpt, tmp_path / "run")
    model, _, _ = loopscale.load(tmp_path / "run")
    ref, cfg, _, _ = load_official(ckpt)
    x = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_len))
    with torch.no_grad():
        a, b = model(x), ref(x)
        for k in range(cfg.model.n_loops):
            final = k == cfg.model.n_loops - 1
            assert torch.equal(model.logits(a[k], final, k=k + 1), ref.logits(b[k], final, k=k + 1))


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
