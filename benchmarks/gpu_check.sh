#!/usr/bin/env bash
# The GPU check (benchmarks/gpu_check.py, docs/performance.md "On a GPU") with the paths set:
#   benchmarks/gpu_check.sh OUT [gpu_check.py flags ...]
# OUT is relative to the current directory; gpu_check.py runs from the repository root with
# PYTHONPATH=src and unbuffered output, and reads the prepared data from data/gpu-check unless
# --data says otherwise (make it with `gpu_check.py --prepare-data data/gpu-check`).
set -u
if [ $# -lt 1 ]; then
    echo "usage: benchmarks/gpu_check.sh OUT [gpu_check.py flags ...]" >&2
    exit 2
fi
out=$(realpath -m -- "$1")  # before the cd below
shift
cd "$(dirname "$0")/.." || exit 2
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "${PYTHON:-python3}" benchmarks/gpu_check.py --out "$out" "$@"
