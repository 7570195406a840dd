#!/usr/bin/env bash
# CPU benchmark suite: writes benchmarks/results/<name>.json and the merged benchmarks/results-cpu.json.
#   benchmarks/run_cpu.sh                       # every run (~15 min on 2 idle cores)
#   benchmarks/run_cpu.sh cpu paper-cpu         # only these runs (the others' JSON files are kept)
# Each run prints a summary; a WARNING line marks timings taken while other processes held the cores.
set -euo pipefail
cd "$(dirname "$0")/.."
LS=${LOOPSCALE:-loopscale}
mkdir -p benchmarks/results
declare -A RUNS=(
  [cpu]="--preset cpu --steps 20 --warmup 5 --eval-batches 10 --profile"
  [cpu-1thread]="--preset cpu --steps 20 --warmup 5 --eval-batches 10 --threads 1 --no-memory"
  [paper-cpu]="--preset paper-cpu --steps 3 --warmup 1 --eval-batches 5 --profile"
  [paper-cpu-1thread]="--preset paper-cpu --steps 3 --warmup 1 --threads 1 --no-eval --no-memory"
  [paper-cpu-chunk1024]="--preset paper-cpu --set objective.ce_chunk_tokens=1024 --steps 3 --warmup 1 --no-eval"
  [paper-cpu-checkpoint]="--preset paper-cpu --set objective.ce_chunk_tokens=1024 --checkpoint --steps 3 --warmup 1 --no-eval"
  [paper-cpu-checkpoint-1thread]="--preset paper-cpu --set objective.ce_chunk_tokens=1024 --checkpoint --steps 3 --warmup 1 --threads 1 --no-eval --no-memory"
)
ORDER=(cpu cpu-1thread paper-cpu paper-cpu-1thread paper-cpu-chunk1024 paper-cpu-checkpoint paper-cpu-checkpoint-1thread)
for name in "${@:-${ORDER[@]}}"; do
  args=${RUNS[$name]:?unknown run $name}
  echo "== $name: loopscale bench $args" >&2
  # shellcheck disable=SC2086
  $LS bench $args --out "benchmarks/results/$name.json"
done
python - <<'PY'
import json, pathlib
res = {p.stem: json.loads(p.read_text()) for p in sorted(pathlib.Path("benchmarks/results").glob("*.json"))}
pathlib.Path("benchmarks/results-cpu.json").write_text(json.dumps(res, indent=1) + "\n")
print("wrote benchmarks/results-cpu.json:", ", ".join(res))
PY
