"""lm-evaluation-harness: the `loopscale` model type, on local YAML tasks with local data files
(no network), checked against a hand computation with `loopscale.load`."""
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("lm_eval")

import loopscale
from loopscale.config import ConfigError, preset
from loopscale.halting import confidences
from loopscale.train import train
from hf_support import QUESTIONS, write_mc_task

TEXTS = [
    "The Congress of the United States shall have power to lay and collect taxes, duties, imposts "
    "and excises, to pay the debts and provide for the common defence and general welfare of the "
    "United States; but all duties, imposts and excises shall be uniform throughout the United States.",
    "We the people of the United States, in order to form a more perfect union, establish justice.",
]


@pytest.fixture
def run(smoke_run):
    """The session's smoke run (conftest.py), read only: tests that need their own copy make it."""
    return smoke_run




@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    d = tmp_path_factory.mktemp("tasks")
    (d / "text.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    (d / "ls_ppl.yaml").write_text(f"""task: ls_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {d / 'text.jsonl'}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
should_decontaminate: false
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
""")
    write_mc_task(d)
    return d


def _evaluate(tasks, model_args, names=("ls_ppl", "ls_mc")):
    import lm_eval
    from lm_eval.tasks import TaskManager

    import loopscale.harness  # noqa: F401  (registers the model type)
    out = lm_eval.simple_evaluate(model="loopscale", model_args=model_args, tasks=list(names),
                                  task_manager=TaskManager(include_path=str(tasks)), log_samples=False)
    return out["results"]


# --- the hand computation ----------------------------------------------------------------
def _logprobs(model, ids, n_loops, halt=None):
    """log p(ids[i+1] | ids[..i]) for one window, independently of the harness's batching."""
    x = torch.tensor([ids[:-1]])
    states = model(x, n_loops=n_loops)
    lp = F.log_softmax(model.logits(states[-1], final=True).float(), -1)[0]
    if halt is not None:
        policy, tau = halt
        picked = torch.zeros(len(ids) - 1, dtype=torch.bool)
        for h in states[:-1]:
            z = model.logits(h, final=False).float()[0]
            ok = (confidences(z)[policy] >= tau) & ~picked
            lp[ok] = F.log_softmax(z, -1)[ok]
            picked |= ok
    return lp.gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)


def _separator(tok):
    return tok.encode("\n\n", add_special_tokens=False).ids[0]


@torch.no_grad()
def _rolling(model, tok, text, n_loops, halt=None):
    seq = model.cfg.seq_len
    ids = [_separator(tok)] + tok.encode(text, add_special_tokens=False).ids
    n, total = len(ids) - 1, 0.0
    for s in range(0, n, seq):  # tokens s..e-1 predicted once, from a window of seq tokens ending at e
        e = min(s + seq, n)
        lo = max(0, e - seq)
        total += float(_logprobs(model, ids[lo:e + 1], n_loops, halt)[s - lo:].double().sum())
    return total


@torch.no_grad()
def _choice_ll(model, tok, question, choice, n_loops):
    whole = tok.encode(question + " " + choice, add_special_tokens=False).ids
    ctx = tok.encode(question, add_special_tokens=False).ids
    return float(_logprobs(model, whole, n_loops)[len(ctx) - 1:].double().sum())


def _hand(run, n_loops=None, halt=None):
    model, tok, cfg = loopscale.load(run)
    n = n_loops or cfg.model.n_loops
    lls = [_rolling(model, tok, t, n, halt) for t in TEXTS]
    words = sum(len(re.split(r"\s+", t)) for t in TEXTS)
    nbytes = sum(len(t.encode("utf-8")) for t in TEXTS)
    acc, acc_norm = [], []
    for q in QUESTIONS:
        ll = [_choice_ll(model, tok, q["question"], c, n) for c in q["choices"]]
        norm = [x / len(c) for x, c in zip(ll, q["choices"])]  # lm-eval: characters of the choice
        acc.append(float(max(range(len(ll)), key=ll.__getitem__) == q["label"]))
        acc_norm.append(float(max(range(len(norm)), key=norm.__getitem__) == q["label"]))
    return {"word_perplexity": math.exp(-sum(lls) / words), "byte_perplexity": math.exp(-sum(lls) / nbytes),
            "bits_per_byte": -sum(lls) / nbytes / math.log(2),
            "acc": sum(acc) / len(acc), "acc_norm": sum(acc_norm) / len(acc_norm)}


# --- tests ----------------------------------------------------------------------------------
def test_texts_span_several_windows(run):
    model, tok, _ = loopscale.load(run)
    assert len(tok.encode(TEXTS[0], add_special_tokens=False).ids) > 2 * model.cfg.seq_len


@pytest.mark.parametrize("loops", [None, 7])
def test_perplexity_and_multiple_choice_equal_a_hand_computation(run, tasks, loops):
    args = f"run={run},batch_size=2" + (f",loops={loops}" if loops else "")
    res = _evaluate(tasks, args)
    hand = _hand(run, loops)
    for m in ("word_perplexity", "byte_perplexity", "bits_per_byte"):
        assert res["ls_ppl"][f"{m},none"] == pytest.approx(hand[m], rel=1e-5)
    for m in ("acc", "acc_norm"):
        assert res["ls_mc"][f"{m},none"] == pytest.approx(hand[m])


def test_loops_change_the_numbers(run, tasks):
    assert _hand(run, 1)["word_perplexity"] != pytest.approx(_hand(run)["word_perplexity"], rel=1e-4)
    res = _evaluate(tasks, f"run={run},loops=1", names=("ls_ppl",))
    assert res["ls_ppl"]["word_perplexity,none"] == pytest.approx(_hand(run, 1)["word_perplexity"], rel=1e-5)


def test_halting_scores_each_token_at_its_first_confident_exit(run, tasks):
    model, tok, _ = loopscale.load(run)
    ids = tok.encode(TEXTS[0], add_special_tokens=False).ids[:20]
    with torch.no_grad():
        z = model.logits(model(torch.tensor([ids]))[0], final=False).float()[0]
    tau = float(confidences(z)["margin"].median())  # about half the tokens exit at loop 1
    res = _evaluate(tasks, f"run={run},halting=margin,threshold={tau}", names=("ls_ppl",))
    hand = _hand(run, halt=("margin", tau))
    assert res["ls_ppl"]["word_perplexity,none"] == pytest.approx(hand["word_perplexity"], rel=1e-5)
    assert hand["word_perplexity"] != pytest.approx(_hand(run)["word_perplexity"], rel=1e-4)


def test_a_continuation_longer_than_the_window_is_one_error(run):
    from loopscale.harness import LoopscaleLM
    lm = LoopscaleLM(run=str(run))
    with pytest.raises(ConfigError, match="more than the context window"):
        lm.score([([1, 2], list(range(5, 5 + lm.max_length + 1)))])


def test_generate_until_is_loopscale_generate_cut_at_the_stop_string(run):
    from lm_eval.api.instance import Instance

    from loopscale.generate import generate
    from loopscale.harness import LoopscaleLM
    lm = LoopscaleLM(run=str(run), loops="5")
    model, tok, _ = loopscale.load(run)
    prompt = "The Congress of the United States"
    ids = generate(model, tok.encode(prompt, add_special_tokens=False).ids, 12, n_loops=5).tokens
    full = tok.decode(ids, skip_special_tokens=False)
    req = lambda kw: Instance("generate_until", {}, (prompt, kw), 0)  # noqa: E731
    assert lm.generate_until([req({"until": [], "max_gen_toks": 12})]) == [full]
    stop = full.strip().split()[1] if len(full.split()) > 1 else full.strip()
    cut = lm.generate_until([req({"until": [stop], "max_gen_toks": 12})])[0]
    assert cut == full[:full.index(stop)]


@pytest.mark.parametrize("args, message", [
    ("", "run=RUN is required"),
    ("loops=0", "loops: must be in \\[1, "),
    ("loops=two", "loops: expected an integer"),
    ("halting=sometimes", "unknown policy 'sometimes'"),
    ("threshold=0.5", "threshold needs halting"),
    ("max_length=99999", "exceeds the model's seq_len"),
])
def test_bad_model_args_are_one_line_errors(run, args, message):
    from loopscale.harness import LoopscaleLM
    kw = dict(a.split("=", 1) for a in args.split(",") if a)
    if args != "":
        kw.setdefault("run", str(run))
    with pytest.raises(ConfigError, match=message):
        LoopscaleLM(**kw)


@pytest.mark.slow
def test_the_lm_eval_command_finds_the_model_type(run, tasks, tmp_path, cli_env):
    out = tmp_path / "out"
    lm_eval_cli = str(Path(sys.executable).parent / "loopscale-lm-eval")  # lm_eval's legacy form (no `run`)
    r = subprocess.run([lm_eval_cli, "--model", "loopscale",
                        "--model_args", f"run={run}", "--tasks", "ls_mc", "--include_path", str(tasks),
                        "--output_path", str(out)], capture_output=True, text=True, env=cli_env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(next(out.rglob("results_*.json")).read_text())
    assert res["results"]["ls_mc"]["acc,none"] == pytest.approx(_hand(run)["acc"])
    bad = subprocess.run([sys.executable, "-m", "loopscale.harness", "run", "--model", "loopscale",
                          "--model_args", f"run={tmp_path / 'nope'}", "--tasks", "ls_mc", "--include_path",
                          str(tasks)], capture_output=True, text=True, env=cli_env, timeout=300)
    assert bad.returncode == 2 and "not found" in bad.stderr.strip().splitlines()[-1]


def test_lm_eval_hf_model_type_with_remote_code_equals_a_hand_computation(run, tasks, tmp_path):
    """`lm_eval --model hf --model_args pretrained=RUN,trust_remote_code=True` on a run
    directory: the per-choice log-likelihoods equal loopscale.load's, and so acc/acc_norm."""
    import shutil

    import lm_eval
    from lm_eval.tasks import TaskManager
    pytest.importorskip("transformers")
    copy = tmp_path / "run"  # a copy: the HF loader must find everything in the directory itself
    shutil.copytree(run, copy)
    out = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={copy},trust_remote_code=True,dtype=float32",
                                  tasks=["ls_mc"], task_manager=TaskManager(include_path=str(tasks)),
                                  log_samples=True, device="cpu")
    model, tok, cfg = loopscale.load(run)
    samples = sorted(out["samples"]["ls_mc"], key=lambda s: s["doc_id"])
    assert len(samples) == len(QUESTIONS)
    for s, q in zip(samples, QUESTIONS):
        got = [float(r[0][0]) for r in s["resps"]]
        want = [_choice_ll(model, tok, q["question"], c, cfg.model.n_loops) for c in q["choices"]]
        assert got == pytest.approx(want, abs=1e-4)
    hand = _hand(run)
    for m in ("acc", "acc_norm"):
        assert out["results"]["ls_mc"][f"{m},none"] == pytest.approx(hand[m])


def test_registering_loopscale_keeps_lm_evals_own_model_types():
    import subprocess
    code = ("import loopscale.harness\nfrom lm_eval.api.registry import get_model\n"
            "print(get_model('loopscale').__name__, get_model('hf').__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == "LoopscaleLM" and len(out.stdout.split()) == 2


def test_the_loopscale_model_type_runs_an_ouro_run(smoke_data, tasks, tmp_path):
    """Appendix B's downstream protocol on the Ouro architecture: multiple choice through
    lm-eval's `loopscale` model type on an Ouro run, acc/acc_norm and the per-choice
    log-likelihoods equal a hand computation with loopscale.load, at K and at 6 steps."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    import loopscale.harness  # noqa: F401  (registers the model type)
    out = tmp_path / "ouro"
    train(preset("ouro-smoke", {"model": {"readout": "final_raw"}, "train": {"max_steps": 10, "device": "cpu"}}),
          smoke_data, out, progress=False)
    model, tok, cfg = loopscale.load(out)
    assert cfg.model.arch == "ouro"
    for loops in (None, 6):
        args = f"run={out}" + (f",loops={loops}" if loops else "")
        res = lm_eval.simple_evaluate(model="loopscale", model_args=args, tasks=["ls_mc"], log_samples=True,
                                      task_manager=TaskManager(include_path=str(tasks)))
        n = loops or cfg.model.n_loops
        for s, q in zip(sorted(res["samples"]["ls_mc"], key=lambda s: s["doc_id"]), QUESTIONS):
            got = [float(r[0][0]) for r in s["resps"]]
            assert got == pytest.approx([_choice_ll(model, tok, q["question"], c, n) for c in q["choices"]], abs=1e-4)
        hand = _hand(out, loops)
        for m in ("acc", "acc_norm"):
            assert res["results"]["ls_mc"][f"{m},none"] == pytest.approx(hand[m])


@pytest.mark.parametrize("loops", [None, "2,6"])
def test_ouro_downstream_writes_lm_evals_accuracy_and_the_per_token_norm(run, tasks, tmp_path, loops):
    """`loopscale ouro-downstream` (the pipeline's downstream stage) on the local multiple-choice
    task: one row per depth; acc and acc_norm (characters) equal the hand computation, and
    acc_norm_token picks the choice with the highest log-likelihood per continuation token."""
    from loopscale.cli import main
    out = tmp_path / "downstream.json"
    argv = ["ouro-downstream", "--run", str(run), "--tasks", "ls_mc", "--include-path", str(tasks),
            "--per-token-norm", "--out", str(out)] + (["--loops", loops] if loops else [])
    assert main(argv) == 0
    res = json.loads(out.read_text())
    model, tok, cfg = loopscale.load(run)
    depths = [int(k) for k in loops.split(",")] if loops else [cfg.model.n_loops]
    assert res["status"] == "ok" and [r["loops"] for r in res["rows"]] == depths
    for row, k in zip(res["rows"], depths):
        hand = _hand(run, k)
        assert row["task"] == "ls_mc" and row["n"] == len(QUESTIONS)
        assert row["acc"] == pytest.approx(hand["acc"]) and row["acc_norm"] == pytest.approx(hand["acc_norm"])
        hits = []
        for q in QUESTIONS:
            ctx = tok.encode(q["question"], add_special_tokens=False).ids
            per = []
            for c in q["choices"]:
                n = len(tok.encode(q["question"] + " " + c, add_special_tokens=False).ids) - len(ctx)
                per.append(_choice_ll(model, tok, q["question"], c, k) / n)
            hits.append(float(max(range(len(per)), key=per.__getitem__) == q["label"]))
        assert row["acc_norm_token"] == pytest.approx(sum(hits) / len(hits))


def test_ouro_downstream_bad_input_is_one_line(run, tasks, tmp_path, capsys):
    from loopscale.cli import main
    assert main(["ouro-downstream", "--run", str(run), "--tasks", "no_such_task", "--include-path", str(tasks),
                 "--out", str(tmp_path / "d.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no_such_task" in err
    assert not (tmp_path / "d.json").exists()


def _bits_per_byte(tasks, model, model_args):
    import lm_eval
    from lm_eval.tasks import TaskManager

    import loopscale.harness  # noqa: F401
    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["ls_ppl"], device="cpu",
                                  task_manager=TaskManager(include_path=str(tasks)))
    return out["results"]["ls_ppl"]["bits_per_byte,none"]


def test_the_hf_and_loopscale_model_types_differ_only_in_the_documented_first_token(run, tasks, tmp_path):
    """`--model hf` conditions a document's first token on the tokenizer's <bos>; `--model
    loopscale` on the document separator "\\n\\n" that precedes every document in training (the
    module docstring). With the other's prefix_token_id each equals the other, at K and at 1."""
    import shutil
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    model, tok, cfg = loopscale.load(run)
    sep, bos = _separator(tok), tok.token_to_id("<bos>")
    assert sep != bos
    hf = f"pretrained={copy},trust_remote_code=True,dtype=float32"
    for k in (cfg.model.n_loops, 1):
        ours = _bits_per_byte(tasks, "loopscale", f"run={run},loops={k}")
        theirs = _bits_per_byte(tasks, "hf", f"{hf},n_loops={k}")
        assert ours != pytest.approx(theirs, rel=1e-6)  # the documented difference
        assert _bits_per_byte(tasks, "hf", f"{hf},n_loops={k},prefix_token_id={sep}") == pytest.approx(ours, rel=1e-6)
        assert _bits_per_byte(tasks, "loopscale", f"run={run},loops={k},prefix_token_id={bos}") == \
            pytest.approx(theirs, rel=1e-6)


def test_one_invocation_evaluates_a_list_of_depths_into_one_table(run, tasks, tmp_path, capsys):
    """`loopscale-lm-eval --loops 1,3,7`: one table and one results file, task `ls_ppl@k=K` per
    depth, each equal to the hand computation at that depth."""
    from loopscale.harness import main
    out = tmp_path / "out"
    main(["--model", "loopscale", "--model_args", f"run={run}", "--tasks", "ls_ppl", "--include_path", str(tasks),
          "--loops", "1,3,7", "--output_path", str(out)])
    table = capsys.readouterr().out
    files = list(out.rglob("results_*.json"))
    assert len(files) == 1
    res = json.loads(files[0].read_text())
    assert sorted(res["results"]) == ["ls_ppl@k=1", "ls_ppl@k=3", "ls_ppl@k=7"]
    for k in (1, 3, 7):
        assert res["results"][f"ls_ppl@k={k}"]["word_perplexity,none"] == pytest.approx(
            _hand(run, k)["word_perplexity"], rel=1e-5)
        assert f"ls_ppl@k={k}" in table
    import lm_eval
    assert "over_depths" not in lm_eval.simple_evaluate.__qualname__  # restored after the command
    with pytest.raises(SystemExit) as e:
        main(["--model", "loopscale", "--model_args", f"run={run}", "--tasks", "ls_ppl", "--loops", "1,0"])
    assert e.value.code == 2
