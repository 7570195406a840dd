"""Regenerate the golden files of tests/test_golden.py from the current code.

    HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 .venv/bin/python tests/golden/make_golden.py [PART ...]

PART: smoke, ouro_smoke, official, hf_run, run_v1 (default: all of them; run_v1 also rewrites the
run directory fixture tests/fixtures/run_v1/).

WHEN TO RERUN: only when a change of behaviour is intended (a new loss, a fixed bug that moves the
numbers, a new column in a results table). A refactoring must leave these files untouched: that is
what they are for (issue 31, "One design": a redesign with its behaviour unchanged). A commit that
rewrites any golden file must say so in its message, name the behaviour that changed and why.

What is recorded (each file records its own settings under "settings"):
  smoke.json       the `smoke` experiment of params.yaml (preset smoke, 20 steps, the blind_spot
                   conditions, diagnostics depth/norms/radial) run whole through Snakemake
                   (`snakemake --cores 2 --config experiment=smoke` in a copy of the working tree,
                   the run tests/test_pipeline.py makes): every run's summary.json and eval/*.json
                   and every CSV under results/smoke, timings and host facts left out
  ouro_smoke.json  the `ouro-smoke` preset trained a few steps by `loopscale train` (log every
                   step) on a small builtin corpus: its per-step losses and per-exit logits on fixed ids
  official.json    every checkpoint of the bundled official fixture set (tests/fixtures/official)
                   converted by `loopscale convert-paper` and loaded by `loopscale.load`: per-exit
                   logits on the first windows of the official validation ids
  hf_run.json      a tiny run trained by `loopscale train`, loaded by transformers'
                   AutoModelForCausalLM (trust_remote_code=True): logits at n_loops = 1..K+1, the
                   exit logits and the greedy generation of a fixed prompt
  run_v1.json      tests/fixtures/run_v1/, a tiny run directory as the current code writes it
                   (the settings of hf_run): its per-exit logits, the same through every reader

A logits tensor is pinned by a summary (`summary`): per exit its sum, sum of |z| and sum of
squares, the argmax id at every position, the first entries of its first and last rows and
entries at fixed random indices: small files that still catch any change beyond float rounding.
"""
from __future__ import annotations

import csv
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

GOLDEN = Path(__file__).resolve().parent
TESTS = GOLDEN.parent
REPO = TESTS.parent
FIXTURE_RUN = TESTS / "fixtures" / "run_v1"
OFFICIAL = TESTS / "fixtures" / "official"  # the bundled set, always (never LOOPSCALE_OFFICIAL_FIXTURES)
PARTS = ("smoke", "ouro_smoke", "official", "hf_run", "run_v1")

# keys whose values change from one run or host to another (left out of the records): timings,
# host and package facts, paths, hashes of files that record them
VOLATILE = re.compile(r"(^|_)(tokens_per_s|tok_per_s|wall|speedup|throughput|time|elapsed|date|host|hostname|pid|"
                      r"git|commit|version|python|torch|platform|env|created|started|finished|seconds|s|"
                      r"memory|mem|path|sha256|hash|fingerprint)($|_)", re.I)
ROW_VALUES = 16  # vocabulary entries kept of the first and last row of each exit's logits
SAMPLES = 32  # logits kept at fixed random (b, t, v) indices per exit

# the tiny corpus and runs of ouro_smoke, hf_run and run_v1 (`loopscale prepare-data` / `train` flags)
CORPUS = ["--preset", "smoke", "--set", "data.source=builtin", "--set", "data.max_documents=6",
          "--set", "data.vocab_size=256"]
TINY_RUN = ["--preset", "smoke", "--set", "model.vocab_size=256", "--set", "data.vocab_size=256",
            "--set", "data.source=builtin", "--set", "data.max_documents=6",
            "--set", "model.d_model=16", "--set", "model.d_ff=32", "--set", "model.readout=final_norm",
            "--set", "train.max_steps=30", "--set", "train.log_every=1", "--set", "train.ckpt_every=1000",
            "--set", "train.device=cpu", "--set", "train.threads=1"]
OURO_RUN = ["--preset", "ouro-smoke", "--set", "model.vocab_size=256", "--set", "data.vocab_size=256",
            "--set", "data.source=builtin", "--set", "data.max_documents=6",
            "--set", "train.max_steps=6", "--set", "train.log_every=1", "--set", "train.ckpt_every=1000",
            "--set", "train.device=cpu", "--set", "train.threads=1"]
PROMPT = "The Congress of the United States"
NEW_TOKENS = 40  # greedy generation: more than seq_len - prompt, so the window slides


# ---------------------------------------------------------------------------
# determinism and small helpers
# ---------------------------------------------------------------------------
def deterministic() -> None:
    """CPU, one thread, deterministic kernels, a fixed seed: the same numbers on every run."""
    import torch
    torch.manual_seed(0)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)


def loopscale_cli(*argv: str) -> None:
    """`loopscale ARGV` in this process (the command line is the interface that stays)."""
    from loopscale.cli import main
    rc = main(list(argv))
    if rc not in (0, None):
        raise RuntimeError(f"loopscale {' '.join(argv)} exited {rc}")


def flatten(obj, prefix: str = "") -> dict:
    """A JSON value as {dotted key: leaf}, volatile keys (timings, host facts, paths) left out."""
    out = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            if VOLATILE.search(str(k)):
                continue
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out.update(flatten(v, f"{prefix}[{i}]"))
    else:
        out[prefix] = obj
    return out


def read_csv(path: Path) -> dict:
    """A results table: its columns (all of them) and its rows without the volatile columns."""
    with open(path, newline="") as f:
        reader = csv.reader(f)
        columns = next(reader, [])
        rows = list(reader)
    keep = [i for i, c in enumerate(columns) if not VOLATILE.search(c)]
    return {"columns": columns, "rows": [[r[i] for i in keep] for r in rows]}


def fixed_ids(vocab: int, shape: tuple, seed: int) -> list:
    import torch
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, shape, generator=g).tolist()


def exit_logits(model, ids):
    """[z_1, ..., z_K]: loop k's exit read out as the model was trained to read it (the final
    readout at the last loop), as loopscale.hf documents its `exit_logits`."""
    import torch
    with torch.no_grad():
        states = model(ids)
        n = len(states)
        return [model.logits(h, final=k == n, k=k).float() for k, h in enumerate(states, 1)]


def summary(z) -> dict:
    """A logits tensor [B, T, V] pinned in a few hundred numbers (float64 sums)."""
    import torch
    z = z.detach().double()
    B, T, V = z.shape
    g = torch.Generator().manual_seed(1234)
    idx = [torch.randint(0, n, (SAMPLES,), generator=g) for n in (B, T, V)]
    return {"shape": [B, T, V], "sum": float(z.sum()), "sum_abs": float(z.abs().sum()),
            "sum_sq": float((z * z).sum()), "argmax": z.argmax(-1).tolist(),
            "first_row": z[0, 0, :ROW_VALUES].tolist(), "last_row": z[-1, -1, :ROW_VALUES].tolist(),
            "samples": {"index": [list(t) for t in zip(*(i.tolist() for i in idx))],
                        "value": z[idx[0], idx[1], idx[2]].tolist()}}


def exit_summaries(model, ids) -> list:
    return [summary(z) for z in exit_logits(model, ids)]


def metrics_records(run: Path) -> list:
    """metrics.jsonl's records (the per-step losses and validation records; timings left out)."""
    return [flatten(json.loads(line)) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


# ---------------------------------------------------------------------------
# the parts
# ---------------------------------------------------------------------------
def smoke_record(repo: Path) -> dict:
    """The records of a workspace in which the smoke experiment ran (Snakemake)."""
    import yaml
    params = yaml.safe_load((repo / "params.yaml").read_text())
    runs = {}
    for run in sorted((repo / "runs" / "smoke").glob("*/*/seed*")):
        rec = {"summary.json": flatten(json.loads((run / "summary.json").read_text()))}
        for f in sorted((run / "eval").glob("*.json")):
            rec[f"eval/{f.name}"] = flatten(json.loads(f.read_text()))
        runs[str(run.relative_to(repo / "runs" / "smoke"))] = rec
    tables = {p.name: read_csv(p) for p in sorted((repo / "results" / "smoke").glob("*.csv"))}
    return {"settings": {"command": "snakemake --cores 2 --config experiment=smoke",
                         "experiment": params["experiments"]["smoke"]},
            "runs": runs, "tables": tables}


def smoke_workspace(root: Path) -> Path:
    """The smoke experiment run in a fresh copy of the working tree (as tests/test_pipeline.py does)."""
    sys.path.insert(0, str(TESTS))
    from workflow_support import SMOKE, copy_worktree, smk
    repo = copy_worktree(root / "repo")
    smk(repo, "--cores", "2", *SMOKE)
    return repo


def corpus(root: Path) -> Path:
    data = root / "data"
    if not (data / "meta.json").exists():
        loopscale_cli("prepare-data", *CORPUS, "--out", str(data))
    return data


def train_run(flags: list, data: Path, out: Path) -> Path:
    deterministic()
    loopscale_cli("train", *flags, "--data", str(data), "--out", str(out), "-q")
    return out


def ouro_record(root: Path) -> dict:
    import torch

    import loopscale
    run = train_run(OURO_RUN, corpus(root), root / "ouro")
    model, _, cfg = loopscale.load(run)
    model.eval()
    ids = fixed_ids(cfg.model.vocab_size, (2, cfg.model.seq_len), seed=7)
    return {"settings": {"prepare-data": CORPUS, "train": OURO_RUN},
            "metrics": metrics_records(run), "summary": flatten(json.loads((run / "summary.json").read_text())),
            "ids": ids, "exits": exit_summaries(model, torch.tensor(ids))}


def official_record(root: Path) -> dict:
    import numpy as np
    import torch

    import loopscale
    val = np.asarray(json.loads((OFFICIAL / "token_ids" / "validation_ids.json").read_text()), dtype=np.int64)
    out = {}
    for ckpt in sorted(OFFICIAL.glob("*/last.pt")):
        run = root / "official" / ckpt.parent.name
        loopscale_cli("convert-paper", str(ckpt), "--out", str(run))
        model, _, cfg = loopscale.load(run)
        model.eval()
        T = cfg.model.seq_len
        ids = torch.from_numpy(val[:2 * T].reshape(2, T).copy())
        out[ckpt.parent.name] = {"windows": [2, T], "exits": exit_summaries(model, ids)}
    return {"settings": {"fixtures": "tests/fixtures/official", "command": "loopscale convert-paper CKPT --out RUN",
                         "ids": "validation_ids.json[:2*seq_len] as 2 windows"}, "checkpoints": out}


def hf_outputs(run: Path) -> dict:
    """Logits at n_loops = 1..K+1 and exit logits through transformers, and a greedy generation."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(str(run), trust_remote_code=True)
    model.eval()
    tok = AutoTokenizer.from_pretrained(str(run))
    prompt = tok(PROMPT)["input_ids"]
    K = model.config.n_loops
    ids = torch.tensor([fixed_ids(model.config.vocab_size, (model.config.max_position_embeddings,), seed=11)])
    with torch.no_grad():
        logits = {str(n): summary(model(ids, n_loops=n).logits) for n in range(1, K + 2)}
        exits = [summary(z) for z in model(ids, output_hidden_states=True).exit_logits]
        gen = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)
    return {"ids": ids.tolist(), "prompt": PROMPT, "prompt_ids": prompt, "n_loops": K, "logits": logits,
            "exit_logits": exits, "generated": gen[0, len(prompt):].tolist()}


def hf_record(root: Path) -> dict:
    run = train_run(TINY_RUN, corpus(root), root / "hf_run")
    return {"settings": {"prepare-data": CORPUS, "train": TINY_RUN, "new_tokens": NEW_TOKENS},
            "metrics": metrics_records(run), **hf_outputs(run)}


def readers_record(run: Path) -> dict:
    """The per-exit logits of a run directory as loopscale.load reads it (the other readers,
    loopscale.load of model.pt alone and transformers, must give the same numbers: tests/test_golden.py)."""
    import torch

    import loopscale
    model, _, cfg = loopscale.load(run)
    model.eval()
    ids = fixed_ids(cfg.model.vocab_size, (2, cfg.model.seq_len), seed=5)
    return {"ids": ids, "exits": exit_summaries(model, torch.tensor(ids))}


def write_run_fixture(root: Path) -> dict:
    """Train the tiny run and copy its directory to tests/fixtures/run_v1 (every file the trainer
    leaves in a finished run except hidden ones and lock files)."""
    run = train_run(TINY_RUN, corpus(root), root / "run_v1")
    if FIXTURE_RUN.exists():
        shutil.rmtree(FIXTURE_RUN)
    shutil.copytree(run, FIXTURE_RUN, ignore=shutil.ignore_patterns(".*", "*.lock", "__pycache__"))
    deterministic()
    return {"settings": {"prepare-data": CORPUS, "train": TINY_RUN,
                         "files": sorted(p.name for p in FIXTURE_RUN.iterdir())}, **readers_record(FIXTURE_RUN)}


def dumps(obj, indent: str = "") -> str:
    """JSON with one key per line and every list of numbers (or of such lists) on one line:
    small files whose diffs still show which record moved."""
    if isinstance(obj, dict) and obj:
        inner = indent + " "
        items = [f"{inner}{json.dumps(k)}: {dumps(obj[k], inner)}" for k in sorted(obj)]
        return "{\n" + ",\n".join(items) + "\n" + indent + "}"
    if isinstance(obj, list) and any(isinstance(v, dict) for v in obj):
        inner = indent + " "
        return "[\n" + ",\n".join(inner + dumps(v, inner) for v in obj) + "\n" + indent + "]"
    return json.dumps(obj, separators=(",", ":"))


def write_json(name: str, rec: dict) -> None:
    path = GOLDEN / f"{name}.json"
    text = dumps(rec) + "\n"
    assert json.loads(text) == json.loads(json.dumps(rec)), "dumps() lost something"
    path.write_text(text)
    print(f"wrote {path.relative_to(REPO)} ({path.stat().st_size} bytes)")


def main(argv: list[str]) -> int:
    parts = argv or list(PARTS)
    bad = [p for p in parts if p not in PARTS]
    if bad:
        print(f"make_golden: unknown part {bad[0]!r}; choose from {', '.join(PARTS)}", file=sys.stderr)
        return 2
    deterministic()
    with tempfile.TemporaryDirectory(prefix="golden-") as tmp:
        root = Path(tmp)
        if "smoke" in parts:
            write_json("smoke", smoke_record(smoke_workspace(root)))
        if "ouro_smoke" in parts:
            write_json("ouro_smoke", ouro_record(root))
        if "official" in parts:
            write_json("official", official_record(root))
        if "hf_run" in parts:
            write_json("hf_run", hf_record(root))
        if "run_v1" in parts:
            write_json("run_v1", write_run_fixture(root))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
