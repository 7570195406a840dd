"""Regenerate benchmarks/generate-cpu.json: the demo run of docs/usage.md, its generate
transcript (the console block of docs/usage.md, tested equal to it) and `loopscale bench --generate`.

    .venv/bin/python benchmarks/generate_cpu.py [--workdir DIR]

Runs the commands in the JSON's `run_made_with` in DIR (a scratch folder; default a temporary
one), then the transcript's commands, then the benchmark, with `loopscale` from PATH."""
from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import tempfile
from pathlib import Path

OUT = Path(__file__).with_name("generate-cpu.json")
PROMPT = "The Congress of the United States"
GENERATE = (f"loopscale generate --run runs/demo/rmsnorm --prompt {shlex.quote(PROMPT)} --max-new-tokens 40 "
            "--temperature 0.8 --top-k 40 --seed 0")
RUN_MADE_WITH = [
    "loopscale prepare-data --preset cpu --out data/cpu",
    "loopscale train --preset cpu --set model.readout=rmsnorm --set objective.loss=per_loop --data data/cpu "
    "--out runs/demo/rmsnorm",
    "loopscale eval halting --model runs/demo/rmsnorm/model.pt --data data/cpu "
    "--out runs/demo/rmsnorm/eval/halting.json --preset cpu",
]
TRANSCRIPT = [GENERATE, GENERATE + " --loops 12", GENERATE + " --halt margin"]
BENCH = "loopscale bench --generate runs/demo/rmsnorm --threads 1"


def run(cmd: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, shell=True, cwd=cwd, capture_output=True, text=True, check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="loopscale-generate-"))
    work.mkdir(parents=True, exist_ok=True)
    for cmd in RUN_MADE_WITH:
        run(cmd, work)
    transcript = []
    for cmd in TRANSCRIPT:
        p = run(cmd, work)
        transcript.append({"command": cmd, "stdout": p.stdout, "stderr": p.stderr.strip().splitlines()[-1] + "\n"})
    run(BENCH + " --out bench.json", work)
    record = json.loads((work / "bench.json").read_text())
    record = {"command": BENCH, "run_made_with": RUN_MADE_WITH,
              "machine": "the project's shared 2-core CPU machine (other jobs running)", **record,
              "generate_transcript": transcript}
    OUT.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {OUT} (workdir {work})")


if __name__ == "__main__":
    main()
