"""Token counts of the paper's tokenizer and the optimiser steps they imply (the drift law's x axis).

    PYTHONPATH=src python benchmarks/token_counts.py [--out benchmarks/token-counts.json] [--wikitext]

For each corpus, in both data modes (``data.tokenization=paper``, the official stream, and
``joined``): `loopscale prepare-data` into a temporary folder, then `loopscale data-stats`:
words (whitespace-split, WikiText's convention), tokens, tokens per word, the ``<unk>`` share,
the row-boundary ``<unk>`` count, and the steps the paper's two setups (official
``configs/44m`` / ``configs/129m``: seq 256, stride 128, batch 64 / 32, 4 epochs) take on that
train split. Corpora: the official fixture corpus (WikiText-103-raw format, vocabulary 512 as
the fixture's own config) and the builtin State of the Union corpus (the cpu preset's
vocabulary, 2048); with ``--wikitext`` also WikiText-103 at the paper's settings (vocabulary
20,000, min frequency 2), which needs the Hugging Face hub or its cache.

WikiText-103 is not reachable where this file was written, so its row is a projection: the
published size of its train split (103,227,021 words, Merity et al. 2016) times a stated
tokens-per-word ratio, labelled as such; `--wikitext` replaces it with the measured count.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FIXTURE_HF = "tests/fixtures/official/corpus/hf"
WIKITEXT103_WORDS = 103_227_021  # train split size as published with the corpus (Merity et al. 2016)

CORPORA = {
    "official-fixture": ["--preset", "smoke", "--set", "data.source=wikitext-103",
                         "--set", f"data.hf_dataset={FIXTURE_HF}", "--set", "data.vocab_size=512",
                         "--set", "data.min_frequency=2"],
    "builtin": ["--preset", "cpu"],
}
WIKITEXT = {"wikitext-103": ["--preset", "paper-44m", "--set", "data.source=wikitext-103"]}


def loopscale(*args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    cmd = [sys.executable, "-m", "loopscale.cli", *args]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(args[:1])} failed: {done.stderr.strip().splitlines()[-1]}")
    return done.stdout


def measure(name: str, settings: list[str], tmp: Path) -> dict:
    out = {}
    for mode in ("paper", "joined"):
        data = tmp / f"{name}-{mode}"
        args = [*settings, "--set", f"data.tokenization={mode}"]
        loopscale("prepare-data", *args, "--out", str(data))
        stats = json.loads(loopscale("data-stats", "--data", str(data)))
        stats.pop("data_dir")
        stats["command"] = " ".join(["loopscale prepare-data", *args, "--out", "DIR", "&&",
                                     "loopscale data-stats --data DIR"])
        out[mode] = stats
    return out


def projection(tokens_per_word: float, source: str) -> dict:
    from loopscale.data import PAPER_TRAINING, train_steps
    tokens = round(WIKITEXT103_WORDS * tokens_per_word)
    return {"projection": True, "words": WIKITEXT103_WORDS, "tokens_per_word": tokens_per_word,
            "tokens_per_word_from": source, "tokens": tokens,
            "paper_steps": {n: train_steps(tokens, **t) for n, t in PAPER_TRAINING.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "token-counts.json"))
    ap.add_argument("--wikitext", action="store_true", help="also measure WikiText-103 (hub or cache needed)")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO / "src"))
    corpora = {**CORPORA, **(WIKITEXT if args.wikitext else {})}
    with tempfile.TemporaryDirectory(prefix="token-counts-") as tmp:
        result = {name: measure(name, s, Path(tmp)) for name, s in corpora.items()}
    if not args.wikitext:
        tpw = result["official-fixture"]["paper"]["splits"]["train"]["tokens_per_word"]
        result["wikitext-103-projection"] = projection(
            tpw, "the official fixture corpus (WikiText-103-raw format), paper mode, train split")
    result["command"] = "PYTHONPATH=src python benchmarks/token_counts.py" + (" --wikitext" if args.wikitext else "")
    Path(args.out).write_text(json.dumps(result, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    print(args.out)


if __name__ == "__main__":
    main()
