"""The FineWeb recipe of Appendix B on a local parquet in FineWeb's schema and a tiny
tokenizer: the official filtering and chunking, rank sharding, exact resume of the stream,
the cosine schedule with warm-up, and a streamed Ouro run that resumes bit for bit."""
import json
import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from loopscale import fineweb as FW
from loopscale import train as T
from loopscale import train_stream as TS
from loopscale import io as IO
from loopscale.config import ConfigError, preset
from loopscale.io import CheckpointError
from loopscale.rundir import Preempted
from ouro_support import WORDS, fineweb_rows, word_tokenizer





@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("fineweb")
    rows = fineweb_rows()
    pq.write_table(pa.Table.from_pylist(rows), root / "000_00000.parquet")
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {"<unk>": 0, **{w: i + 1 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    (root / "tok").mkdir()
    tok.save(str(root / "tok" / "tokenizer.json"))
    return root, rows, tok


def settings(root, **kw):
    return FW.StreamConfig.from_dict({"data_files": [str(root / "000_00000.parquet")], "shuffle_buffer": 0,
                                      "tokenizer": str(root / "tok"), "warmup_steps": 2, **kw})


def test_official_filter_and_chunking(corpus):
    root, rows, tok = corpus
    kept = [r["text"] for r in rows if len(r["text"].strip()) >= 50]
    assert len(kept) == len(rows) - len(rows) // 5
    stream = [t for text in kept for t in tok.encode(text, add_special_tokens=False).ids]
    seq = 16
    got = list(FW.chunks(rows, lambda t: tok.encode(t, add_special_tokens=False).ids, seq))
    assert all(len(c) == seq + 1 for c in got)
    assert got == [stream[i * seq:i * seq + seq + 1] for i in range((len(stream) - 1) // seq)]
    # two ranks of an unshardable stream: every other chunk each, together all of them
    r0 = list(FW.chunks(rows, lambda t: tok.encode(t).ids, seq, rank=0, world=2))
    r1 = list(FW.chunks(rows, lambda t: tok.encode(t).ids, seq, rank=1, world=2))
    assert r0 == got[0::2] and r1 == got[1::2]


def test_stream_from_parquet_and_exact_resume(corpus):
    root, rows, tok = corpus
    s = settings(root)
    direct = list(FW.chunks(rows, lambda t: tok.encode(t, add_special_tokens=False).ids, 16))
    st = FW.ChunkStream(s, tok, 16)
    first = st.batch(5)
    assert first.tolist() == direct[:5] and st.consumed == 5
    again = FW.ChunkStream(s, tok, 16, consumed=5)
    assert again.batch(3).tolist() == st.batch(3).tolist() == direct[5:8]
    many = FW.ChunkStream(s, tok, 16).batch(len(direct) + 2)  # past the end: the stream restarts
    assert many[len(direct):].tolist() == direct[:2]
    shuffled = FW.ChunkStream(settings(root, shuffle_buffer=8, shuffle_seed=1), tok, 16).batch(len(direct))
    assert shuffled.tolist() != direct  # the shuffle buffer reorders the documents
    assert FW.ChunkStream(settings(root, shuffle_buffer=8, shuffle_seed=1), tok, 16).batch(4).tolist() == \
        shuffled[:4].tolist()  # reproducibly (what exact resume needs)


def test_cosine_schedule_with_warmup():
    assert TS.cosine_lr(1, 10, 100, 3e-4, 3e-5) == pytest.approx(3e-5)
    assert TS.cosine_lr(10, 10, 100, 3e-4, 3e-5) == pytest.approx(3e-4)
    assert TS.cosine_lr(55, 10, 100, 3e-4, 3e-5) == pytest.approx(3e-5 + 0.5 * 2.7e-4)
    assert TS.cosine_lr(100, 10, 100, 3e-4, 3e-5) == pytest.approx(3e-5)


def test_bad_settings_are_one_line_errors(corpus, tmp_path):
    root, _, _ = corpus
    with pytest.raises(ConfigError, match="stream.min_chars"):
        FW.StreamConfig.from_dict({"min_chars": -1})
    with pytest.raises(ConfigError, match="unknown key 'stream.shuffle'"):
        FW.StreamConfig.from_dict({"shuffle": 3})
    with pytest.raises(FileNotFoundError, match="not found"):
        FW.ChunkStream(FW.StreamConfig.from_dict({"data_files": [str(tmp_path / "none.parquet")]}), None, 8)
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        FW.load_tokenizer(str(tmp_path))


def run_cfg(**train):
    return preset("ouro-smoke", {"model": {"seq_len": 16},
                                 "train": {"batch_size": 4, "grad_accum": 2, "max_steps": 4, "ckpt_every": 2,
                                           "log_every": 1, "lr": 3e-3, **train}})


def test_streamed_run_resumes_bit_for_bit(corpus, tmp_path, monkeypatch):
    root, _, _ = corpus
    s = settings(root)
    full = TS.train_stream(run_cfg(), s, tmp_path / "full")
    assert full["status"] == "completed" and full["chunks_consumed_per_rank"] == 16
    lrs = [json.loads(l)["lr"] for l in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    assert lrs == pytest.approx([TS.cosine_lr(k, 2, 4, 3e-3, 3e-5) for k in range(1, 5)])

    orig = T.atomic_torch_save

    def stop_after_state(path, obj):
        orig(path, obj)
        if path.name == "state.pt":
            raise KeyboardInterrupt
    monkeypatch.setattr(T, "atomic_torch_save", stop_after_state)
    with pytest.raises(KeyboardInterrupt):
        TS.train_stream(run_cfg(), s, tmp_path / "cut")
    monkeypatch.setattr(T, "atomic_torch_save", orig)
    assert IO.load_checkpoint(tmp_path / "cut" / "state.pt")["consumed"] == [8]
    resumed = TS.train_stream(run_cfg(), s, tmp_path / "cut")
    assert resumed["steps"] == 4
    a = IO.load_checkpoint(tmp_path / "full" / "model.pt")["model"]
    b = IO.load_checkpoint(tmp_path / "cut" / "model.pt")["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    # a state.pt of other settings is refused; one of a longer max_steps resumes
    monkeypatch.setattr(T, "atomic_torch_save", stop_after_state)
    with pytest.raises(KeyboardInterrupt):
        TS.train_stream(run_cfg(), s, tmp_path / "other")
    monkeypatch.setattr(T, "atomic_torch_save", orig)
    with pytest.raises(CheckpointError, match="other settings"):
        TS.train_stream(run_cfg(lr=1e-3), s, tmp_path / "other")
    assert TS.train_stream(run_cfg(max_steps=5), s, tmp_path / "other")["steps"] == 5


def test_pure_bf16_and_evaluation_of_a_streamed_run(corpus, tmp_path):
    root, _, _ = corpus
    s = settings(root, pure_bf16=True)
    r = TS.train_stream(run_cfg(max_steps=2, activation_checkpointing=True), s, tmp_path / "run")
    assert r["status"] == "completed"
    ck = IO.load_checkpoint(tmp_path / "run" / "model.pt")
    assert ck["model"]["model.layers.0.mlp.up_proj.weight"].dtype == torch.bfloat16
    from loopscale import load
    model, _, cfg = load(tmp_path / "run" / "model.pt")
    with torch.no_grad():
        assert cfg.model.arch == "ouro" and math.isfinite(float(model.logits(model(torch.ones(1, 4).long())[-1]).sum()))


@pytest.mark.slow
def test_two_ranks_stream_the_same_global_batches_as_one(corpus, tmp_path):
    """torchrun, 2 CPU ranks (gloo): each rank reads every other chunk of the unsharded local
    stream, so the global batches, and the weights after training, are one process's."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    root, _, _ = corpus
    sets = ["--preset", "ouro-smoke", "--set", "model.seq_len=16", "--set", "train.batch_size=4",
            "--set", "train.max_steps=3", "--set", "train.log_every=1", "--set", "train.device=cpu",
            "--set", f"stream.data_files=[{root / '000_00000.parquet'}]", "--set", "stream.shuffle_buffer=0",
            "--set", f"stream.tokenizer={root / 'tok'}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    torchrun = Path(sys.executable).parent / "torchrun"
    subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "loopscale.cli", "train-stream",
                    *sets, "--out", str(tmp_path / "two")], check=True, env=env, capture_output=True, timeout=300)
    subprocess.run([sys.executable, "-m", "loopscale.cli", "train-stream", *sets, "--out", str(tmp_path / "one")],
                   check=True, env=env, capture_output=True, timeout=300)
    a = IO.load_checkpoint(tmp_path / "one" / "model.pt")
    b = IO.load_checkpoint(tmp_path / "two" / "model.pt")
    assert b["consumed"] == [6, 6] and a["consumed"] == [12]
    for k in a["model"]:
        torch.testing.assert_close(a["model"][k], b["model"][k], rtol=1e-4, atol=1e-5)


def metrics(run):
    return [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]


def same_training(a, b):
    """The same weights bit for bit, and the same logged losses and learning rates."""
    wa, wb = IO.load_checkpoint(a / "model.pt")["model"], IO.load_checkpoint(b / "model.pt")["model"]
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    key = lambda r: (r["step"], r.get("lr"), r.get("loss"), r.get("ce"))  # noqa: E731
    assert [key(r) for r in metrics(a)] == [key(r) for r in metrics(b)]


def test_sigterm_checkpoints_a_streamed_run_that_then_resumes_exactly(corpus, tmp_path, monkeypatch):
    """SIGTERM during step 3 (as SLURM sends it before a time limit): the step finishes, state.pt
    holds step 3 and the 12 chunks consumed, train.Preempted is raised, no model.pt; the rerun
    continues from there to the uninterrupted run's weights and log, dropout included (its RNG
    state is in state.pt)."""
    import os
    import signal

    root, _, _ = corpus
    s = settings(root)
    cfg = lambda: preset("ouro-smoke", {"model": {"seq_len": 16, "dropout": 0.2},  # noqa: E731
                                        "train": {"batch_size": 4, "max_steps": 6, "ckpt_every": 100,
                                                  "log_every": 1, "lr": 3e-3}})
    TS.train_stream(cfg(), s, tmp_path / "full")
    real, calls = T.train_step, [0]

    def terminated_in_step_3(*a, **kw):
        calls[0] += 1
        if calls[0] == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*a, **kw)
    monkeypatch.setattr(T, "train_step", terminated_in_step_3)
    with pytest.raises(Preempted, match=r"SIGTERM at step 3/6: state saved to .*state\.pt"):
        TS.train_stream(cfg(), s, tmp_path / "cut")
    monkeypatch.setattr(T, "train_step", real)
    assert signal.getsignal(signal.SIGTERM) is not None and calls[0] == 3  # handler restored, stopped at once
    state = IO.load_checkpoint(tmp_path / "cut" / "state.pt")
    assert state["step"] == 3 and state["consumed"] == [12] and "optimizer" in state and state["rng_ranks"]
    assert not (tmp_path / "cut" / "model.pt").exists() and [r["step"] for r in metrics(tmp_path / "cut")] == [1, 2, 3]
    resumed = TS.train_stream(cfg(), s, tmp_path / "cut")
    assert resumed["status"] == "completed" and resumed["steps"] == 6 and resumed["chunks_consumed_per_rank"] == 24
    same_training(tmp_path / "full", tmp_path / "cut")
    assert not (tmp_path / "cut" / "state.pt").exists()


def test_a_crash_between_checkpoints_resumes_without_duplicate_log_records(corpus, tmp_path, monkeypatch):
    """A run killed after step 3 of a ckpt_every=2 run resumes from step 2: the records of step
    3 written before the kill are dropped and written again, once."""
    root, _, _ = corpus
    s = settings(root)
    cfg = lambda: run_cfg(max_steps=5, ckpt_every=2)  # noqa: E731
    TS.train_stream(cfg(), s, tmp_path / "full")
    real, calls = T.train_step, [0]

    def killed_after_step_3(*a, **kw):
        calls[0] += 1
        if calls[0] == 4:
            raise KeyboardInterrupt
        return real(*a, **kw)
    monkeypatch.setattr(T, "train_step", killed_after_step_3)
    with pytest.raises(KeyboardInterrupt):
        TS.train_stream(cfg(), s, tmp_path / "cut")
    monkeypatch.setattr(T, "train_step", real)
    assert IO.load_checkpoint(tmp_path / "cut" / "state.pt")["step"] == 2
    assert [r["step"] for r in metrics(tmp_path / "cut")] == [1, 2, 3]
    TS.train_stream(cfg(), s, tmp_path / "cut")
    same_training(tmp_path / "full", tmp_path / "cut")


@pytest.mark.slow
def test_train_stream_sent_sigterm_exits_143_and_resumes_to_the_same_run(corpus, tmp_path, cli_env):
    """`loopscale train-stream` in a subprocess, sent SIGTERM from outside mid-run: exit status
    143 with a one-line notice, state.pt at a step boundary; the same command again finishes the
    run with the weights and log of an uninterrupted one."""
    import signal
    import subprocess
    import sys
    import time
    root, _, _ = corpus
    big = tmp_path / "corpus.parquet"  # a longer stream: fewer restarts of the parquet reader
    pq.write_table(pa.Table.from_pylist(fineweb_rows(400, seed=1)), big)
    steps = 300

    def cmd(out):
        return [sys.executable, "-m", "loopscale.cli", "train-stream", "--preset", "ouro-smoke",
                "--set", "model.seq_len=16", "--set", "train.batch_size=4", "--set", f"train.max_steps={steps}",
                "--set", "train.log_every=1", "--set", "train.ckpt_every=1000", "--set", "train.threads=1",
                "--set", "train.device=cpu", "--set", f"stream.data_files=[{big}]",
                "--set", "stream.shuffle_buffer=0", "--set", f"stream.tokenizer={root / 'tok'}", "--out", str(out)]
    ref = subprocess.run(cmd(tmp_path / "full"), env=cli_env, capture_output=True, text=True, timeout=600)
    assert ref.returncode == 0, ref.stderr
    run = tmp_path / "cut"
    proc = subprocess.Popen(cmd(run), env=cli_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t0 = time.time()
    while not ((run / "metrics.jsonl").is_file() and len((run / "metrics.jsonl").read_text().splitlines()) >= 5):
        assert proc.poll() is None and time.time() - t0 < 300, "the run ended before it could be signalled"
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert "loopscale: SIGTERM at step" in err and "rerun the same command to resume" in err
    step = IO.load_checkpoint(run / "state.pt")["step"]
    assert 5 <= step < steps and not (run / "summary.json").exists()
    assert [r["step"] for r in metrics(run)] == list(range(1, step + 1))
    done = subprocess.run(cmd(run), env=cli_env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1])["steps"] == steps
    same_training(tmp_path / "full", run)


def ouro_like_tokenizer(path):
    """A byte-level BPE with the Ouro tokenizer's first special tokens at its ids 0..3
    (<|endoftext|>, <|im_start|>, <|im_end|>, <repo_name>) and no unknown token."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator([" ".join(WORDS)] * 4, trainer=trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path.mkdir(parents=True)
    tok.save(str(path / "tokenizer.json"))
    return tok


def test_meta_json_records_the_pretrained_tokenizers_own_special_tokens(corpus, tmp_path):
    """prepare-data with data.pretrained_tokenizer: meta.json's special_tokens are that
    tokenizer's (not loopscale's <pad> <bos> <eos> <unk> at 0..3), and the <unk> statistics
    count its own unknown token: none for a byte-level BPE, even where id 3 (here <repo_name>)
    occurs; the word-level test tokenizer's <unk> at id 0."""
    from loopscale import data as D
    from loopscale.config import DataConfig
    root, rows, _ = corpus
    ouro_like_tokenizer(tmp_path / "ouro")
    docs = [{**r, "text": r["text"] + " <repo_name> zz9"} if i % 2 == 0 else r for i, r in enumerate(rows)]
    pq.write_table(pa.Table.from_pylist(docs), tmp_path / "fw.parquet")
    for tok_dir, specials, unk in ((tmp_path / "ouro", {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2,
                                                        "<repo_name>": 3}, None),
                                   (root / "tok", {"<unk>": 0}, 0)):
        cfg = DataConfig(source="fineweb", pretrained_tokenizer=str(tok_dir), data_files=[str(tmp_path / "fw.parquet")],
                         heldout_documents=10)
        out = tmp_path / "data" / tok_dir.name
        meta = D.prepare_data(cfg, out, show_progress=False)
        assert meta["special_tokens"] == specials
        assert json.loads((out / "meta.json").read_text())["special_tokens"] == specials
        for split in ("validation", "test"):
            ids = D.load_split(out, split)
            assert meta["stats"][split]["unk"] == (0 if unk is None else int((ids == unk).sum()))
            if unk is None:
                assert (ids == 3).sum() > 0  # <repo_name> is there, and is no unknown token
            else:
                assert meta["stats"][split]["unk"] > 0  # zz9 is outside the word-level vocabulary


def test_a_streamed_runs_hugging_face_config_names_its_tokenizers_own_token_ids(corpus, tmp_path, smoke_data):
    """config.json of a run trained with the Ouro-like tokenizer gives eos_token_id 0 (its
    <|endoftext|>) and no bos/pad id (it has no such token), not loopscale's 1, 2, 0 (there
    <|im_start|>, <|im_end|>, <|endoftext|>); a run of loopscale's own tokenizer keeps 1, 2, 0."""
    from tokenizers import Tokenizer

    from loopscale.artifacts import role_token_ids
    root, _, _ = corpus
    ouro_like_tokenizer(tmp_path / "ouro")
    TS.train_stream(run_cfg(max_steps=1), settings(root, tokenizer=str(tmp_path / "ouro")), tmp_path / "run")
    hf = json.loads((tmp_path / "run" / "config.json").read_text())
    assert (hf["bos_token_id"], hf["eos_token_id"], hf["pad_token_id"]) == (None, 0, None)
    assert json.loads((tmp_path / "run" / "tokenizer_config.json").read_text())["eos_token"] == "<|endoftext|>"
    own = Tokenizer.from_file(str(smoke_data / "tokenizer.json"))
    assert role_token_ids(own) == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


# ---------------------------------------------------------------------------
# the run directory of train-stream: locked, and a finished run kept (as `loopscale train`)
# ---------------------------------------------------------------------------
def stream_cli(root, run, *sets, no_resume=False):
    """`loopscale train-stream` of a 2-step run on the test corpus, in process."""
    from loopscale import cli
    args = ["train-stream", "--preset", "ouro-smoke", "--set", "model.seq_len=16", "--set", "train.batch_size=4",
            "--set", "train.max_steps=2", "--set", "train.log_every=1", "--set", "train.device=cpu",
            "--set", f"stream.data_files=[{root / '000_00000.parquet'}]", "--set", "stream.shuffle_buffer=0",
            "--set", f"stream.tokenizer={root / 'tok'}", "--set", "stream.warmup_steps=1"]
    for s in sets:
        args += ["--set", s]
    return cli.main([*args, "--out", str(run), *(["--no-resume"] if no_resume else [])])


def tree(run, lock=False):
    """Every file under `run`: its bytes' hash and its mtime (ns); the lock file (which every
    trainer that takes the lock rewrites with its name) only with `lock`."""
    import hashlib
    return {str(p.relative_to(run)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(run.rglob("*")) if p.is_file() and (lock or p.name != ".lock")}


@pytest.fixture
def finished_stream(corpus, tmp_path, capsys):
    root, _, _ = corpus
    run = tmp_path / "run"
    assert stream_cli(root, run) == 0
    capsys.readouterr()
    assert json.loads((run / "summary.json").read_text())["status"] == "completed"
    return root, run


def test_a_finished_streamed_run_is_kept_not_retrained(finished_stream, capsys, caplog, monkeypatch):
    """train-stream rerun on its finished run (also with only train.threads changed): exit 0, the
    finished summary printed, a line saying the run is finished, and not a byte or an mtime of
    the directory changed; nothing is trained."""
    root, run = finished_stream
    before, summary = tree(run), json.loads((run / "summary.json").read_text())
    monkeypatch.setattr(T, "train_step", lambda *a, **kw: pytest.fail("a finished run was trained again"))
    for sets in ((), ("train.threads=1",)):
        with caplog.at_level("INFO", logger="loopscale.train"):
            assert stream_cli(root, run, *sets) == 0
        out = capsys.readouterr().out
        assert json.loads(out.strip().splitlines()[-1]) == {k: summary[k] for k in ("status", "steps", "tokens")}
        assert f"{run} is already finished (completed, 2 steps)" in caplog.text
        assert tree(run) == before  # model.pt byte-identical, its mtime unchanged
        caplog.clear()


def test_a_finished_streamed_run_of_other_settings_is_refused_like_train(finished_stream, capsys):
    """Other run settings or other stream settings on a finished run: refused in one line, exit
    2, the run untouched (as `loopscale train` refuses it); --no-resume trains over it."""
    root, run = finished_stream
    before = tree(run)
    for other in ("train.lr=2e-3", "stream.warmup_steps=2", "stream.min_chars=40"):
        assert stream_cli(root, run, other) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1, err
        assert f"{run} holds a finished run of other settings; train with --no-resume" in err
        assert tree(run) == before
    assert stream_cli(root, run, "train.lr=2e-3", no_resume=True) == 0
    assert IO.load_checkpoint(run / "model.pt")["config"]["train"]["lr"] == 2e-3
    assert stream_cli(root, run, "train.lr=2e-3") == 0  # and that run is now the finished one
    assert stream_cli(root, run) == 2


def test_a_finished_streamed_run_from_before_result_fingerprints_is_recognised(finished_stream, capsys):
    """A summary.json written before train-stream recorded fingerprints: its run's settings are
    read from loopscale.json, so a rerun of the same settings keeps it, one of others is refused."""
    root, run = finished_stream
    summary = json.loads((run / "summary.json").read_text())
    for k in ("config_fingerprint", "result_fingerprint"):
        summary.pop(k, None)
    (run / "summary.json").write_text(json.dumps(summary))
    for kept in (".finished.summary.json", ".finished.model.pt"):
        (run / kept).unlink(missing_ok=True)  # written by the same change as the fingerprints
    before = tree(run)
    assert stream_cli(root, run) == 0 and tree(run) == before
    assert stream_cli(root, run, "train.lr=2e-3") == 2 and tree(run) == before
    assert "finished run of other settings" in capsys.readouterr().err


def test_a_finished_streamed_run_whose_outputs_snakemake_deleted_is_kept(finished_stream, caplog, monkeypatch):
    """snakemake --rerun-incomplete deletes model.pt and summary.json of a job it thinks
    unfinished: the rerun puts the finished run back from its second names, not retraining it."""
    root, run = finished_stream
    weights, summary = (run / "model.pt").read_bytes(), (run / "summary.json").read_bytes()
    (run / "model.pt").unlink()
    (run / "summary.json").unlink()
    monkeypatch.setattr(T, "train_step", lambda *a, **kw: pytest.fail("a finished run was trained again"))
    with caplog.at_level("INFO", logger="loopscale.train"):
        assert stream_cli(root, run) == 0
    assert "kept the finished run" in caplog.text
    assert (run / "model.pt").read_bytes() == weights and (run / "summary.json").read_bytes() == summary


def test_a_held_run_lock_refuses_train_stream_and_train(finished_stream, tmp_path, capsys, smoke_data):
    """While another trainer holds a run directory, train-stream (also with --no-resume, which
    would train over the run) and train fail with one line naming the directory and the holder,
    exit 2, and change nothing in it; an empty directory stays empty but for the lock."""
    import os

    from loopscale import cli
    from loopscale.io import run_lock
    root, run = finished_stream
    empty = tmp_path / "empty"
    empty.mkdir()
    for where in (run, empty):
        with run_lock(where, "loopscale train-stream"):
            before = tree(where, lock=True)
            for attempt in (lambda: stream_cli(root, where), lambda: stream_cli(root, where, no_resume=True),
                            lambda: cli.main(["train", "--preset", "smoke", "--data", str(smoke_data),
                                              "--out", str(where), "-q"])):
                assert attempt() == 2
                err = capsys.readouterr().err.strip()
                assert len(err.splitlines()) == 1, err
                assert f"{where} is in use by loopscale train-stream (pid {os.getpid()})" in err
                assert tree(where, lock=True) == before
    assert sorted(p.name for p in empty.iterdir()) == [".lock"]


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
# the low findings: cross-checked settings, the file an error names
# ---------------------------------------------------------------------------
def test_stream_min_lr_above_the_peak_is_refused(tmp_path):
    from loopscale import fineweb as FW
    from loopscale import train_stream as TS
    cfg = preset("ouro-smoke", {"train": {"max_steps": 2, "lr": 1e-3}})
    s = FW.StreamConfig.from_dict({"min_lr": 1e-2})
    with pytest.raises(ConfigError, match="stream.min_lr"):
        TS.train_stream(cfg, s, tmp_path / "run")
    assert not (tmp_path / "run").exists()
