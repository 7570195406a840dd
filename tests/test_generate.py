"""Generation: KV cache == full forward, cached == uncached decoding, depth, window, halting."""
import json
import math

import pytest
import torch

from loopscale.config import ConfigError, preset
from loopscale.registry import RECURRENCES, readouts_of
from loopscale.generate import Decoder, Halt, generate, run_threshold
from loopscale.model import LoopedLM


def _model(seed=0, **model):
    cfg = preset("smoke", {"model": {"seq_len": 24, **model}}).model
    torch.manual_seed(seed)
    return LoopedLM(cfg).eval()


def _prompt(n, V=2048, seed=1):
    return torch.randint(4, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("recurrence", RECURRENCES)
@pytest.mark.parametrize("readout", readouts_of("looped"))
@pytest.mark.parametrize("extra", [0, 2])  # k = K and k = K + 2 (beyond training depth)
def test_cached_logits_equal_the_forward(readout, recurrence, extra):
    model = _model(readout=readout, recurrence=recurrence)
    k = model.cfg.n_loops + extra
    ids = torch.tensor([_prompt(20)])
    with torch.no_grad():
        full = model.logits(model(ids, n_loops=k)[-1], final=True)  # [1, T, V]
        dec = Decoder(model, k)
        got = [dec(ids[:, :6])[0]]  # the prompt in one call, then one token per call
        got += [dec(ids[:, t:t + 1])[0] for t in range(6, 20)]
    torch.testing.assert_close(torch.stack(got), full[0, 5:], atol=2e-5, rtol=1e-5)
    assert all(len(c) == 20 for loop in dec.caches for c in loop)


@pytest.mark.parametrize("readout", ["rmsnorm", "raw"])
def test_cached_decoding_gives_the_tokens_of_uncached_decoding(readout):
    model = _model(readout=readout)
    prompt = _prompt(10)
    # 40 new tokens through a 24-position window: the window slides (same rule for both)
    cached = generate(model, prompt, 40)
    plain = generate(model, prompt, 40, use_cache=False)
    assert cached.tokens == plain.tokens
    assert cached.slides == plain.slides >= 2
    assert cached.loops == [model.cfg.n_loops] * 40
    deeper = generate(model, prompt, 12, n_loops=7)
    assert deeper.tokens == generate(model, prompt, 12, n_loops=7, use_cache=False).tokens
    assert deeper.mean_loops == 7


def test_sampling_is_seeded_and_top_k_1_is_greedy():
    model = _model()
    prompt = _prompt(5)
    a = generate(model, prompt, 15, temperature=1.0, top_k=50, seed=3)
    assert a.tokens == generate(model, prompt, 15, temperature=1.0, top_k=50, seed=3).tokens
    assert a.tokens != generate(model, prompt, 15, temperature=1.0, top_k=50, seed=4).tokens
    assert generate(model, prompt, 15, temperature=0.7, top_k=1, seed=5).tokens == generate(model, prompt, 15).tokens


def test_a_prompt_longer_than_the_window_keeps_its_end():
    model = _model()
    prompt = _prompt(30)
    assert generate(model, prompt, 3).tokens == generate(model, prompt[-24:], 3).tokens
    with pytest.raises(ValueError, match="exceeds the model's seq_len"):
        model.embed(torch.tensor([prompt[:2]]), start=23)


def test_halting_permissive_and_impossible_thresholds():
    model = _model()
    K, prompt = model.cfg.n_loops, _prompt(6)
    never = generate(model, prompt, 16, halt=Halt("max_prob", 1.1))  # a probability never exceeds 1
    assert never.loops == [K] * 16 and never.mean_loops == K
    assert never.tokens == generate(model, prompt, 16).tokens
    always = generate(model, prompt, 16, halt=Halt("margin", 0.0))  # every margin is >= 0
    assert always.loops == [K] + [1] * 15  # the prompt's pass runs at full depth
    assert always.mean_loops < K
    for policy in ("max_prob", "entropy"):
        assert generate(model, prompt, 16, halt=Halt(policy, -math.inf)).loops[1:] == [1] * 15


def test_a_halted_token_copies_its_state_forward():
    model = _model()
    K = model.cfg.n_loops
    dec = Decoder(model, K, Halt("margin", 0.0))
    with torch.no_grad():
        dec(torch.tensor([_prompt(5)]))
        _, loops = dec(torch.tensor([[7]]))
    assert loops == 1
    assert {len(c) for loop in dec.caches for c in loop} == {6}  # one entry per position everywhere
    for m in range(1, K):
        for src, dst in zip(dec.caches[0], dec.caches[m]):
            assert torch.equal(dst.k[:, :, -1], src.k[:, :, -1]) and torch.equal(dst.v[:, :, -1], src.v[:, :, -1])
            assert not torch.equal(dst.k[:, :, -2], src.k[:, :, -2])  # the prompt ran every loop


def test_halting_needs_a_valid_policy_and_the_cache():
    model = _model()
    with pytest.raises(ConfigError, match="unknown policy"):
        generate(model, _prompt(3), 2, halt=Halt("bogus", 0.5))
    with pytest.raises(ConfigError, match="KV cache"):
        generate(model, _prompt(3), 2, halt=Halt("margin", 0.5), use_cache=False)
    with pytest.raises(ConfigError, match=r"loops must be an integer in \[1, "):
        generate(model, _prompt(3), 2, n_loops=0)


def test_run_threshold_reads_the_calibrated_per_token_policy(tmp_path):
    with pytest.raises(FileNotFoundError, match="loopscale eval halting"):
        run_threshold(tmp_path, "margin")
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "halting.json").write_text(json.dumps({"policies": {
        "margin/token": {"threshold": 2.5}, "margin/sequence": {"threshold": 9.0},
        "entropy/token": {"threshold": None}}}))
    assert run_threshold(tmp_path, "margin") == 2.5
    assert run_threshold(tmp_path, "entropy") == math.inf  # calibration never exits early
    with pytest.raises(ConfigError, match="max_prob/token"):
        run_threshold(tmp_path, "max_prob")


def test_bench_generation_reports_every_depth_and_the_run_s_halting(tmp_path):
    from loopscale.generate import bench_generation
    model = _model()
    K = model.cfg.n_loops
    r = bench_generation(model, None, new_tokens=6, prompt_len=4)
    assert [row["loops"] for row in r["rows"]] == list(range(1, K + 1))
    assert all(row["tokens"] == 6 and row["tok_per_s"] > 0 and row["mean_loops"] == row["loops"] for row in r["rows"])
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "halting.json").write_text(json.dumps({"policies": {
        "max_prob/token": {"threshold": 1.5}, "margin/token": {"threshold": 0.0}, "entropy/token": {"threshold": None}}}))
    rows = {row["name"]: row for row in bench_generation(model, tmp_path, new_tokens=6, prompt_len=4)["rows"]}
    assert rows["halt max_prob"]["mean_loops"] == K and rows["halt entropy"]["threshold"] is None
    assert rows["halt margin"]["mean_loops"] == (K + 5) / 6
