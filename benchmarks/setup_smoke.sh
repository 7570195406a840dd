#!/usr/bin/env bash
# Set-up + `make smoke` on fresh clones with a cold pip cache, one after the other
# (benchmarks/make-smoke-setup.json):  benchmarks/setup_smoke.sh REPO OUTDIR NAME:COMMIT...
# A commit without the setup-pipeline target (before requirements-pipeline.lock) gets `make setup`.
set -u
REPO=$1 OUT=$2; shift 2
mkdir -p "$OUT"
for which in "$@"; do
  name=${which%%:*} rev=${which##*:} dir=$OUT/$name
  rm -rf "$dir" && git clone -q "$REPO" "$dir" && git -C "$dir" checkout -q "$rev"
  cache=$(mktemp -d) load0=$(cat /proc/loadavg) t0=$(date +%s.%N)
  (cd "$dir" && { PIP_CACHE_DIR=$cache nice -n 10 make setup-pipeline >/dev/null 2>"$OUT/$name.setup.err" ||
                  PIP_CACHE_DIR=$cache nice -n 10 make setup >/dev/null 2>>"$OUT/$name.setup.err"; })
  t1=$(date +%s.%N) load1=$(cat /proc/loadavg)
  (cd "$dir" && nice -n 10 make smoke CORES=2 >"$OUT/$name.smoke.out" 2>&1); rc=$?
  t2=$(date +%s.%N) load2=$(cat /proc/loadavg)
  du -sm "$dir/.venv" | cut -f1 >"$OUT/$name.venv_mb"
  "$dir/.venv/bin/python" -m pip list 2>/dev/null | tail -n +3 | wc -l >"$OUT/$name.npkgs"
  echo "$name $rev setup_s=$(echo "$t1-$t0" | bc) smoke_s=$(echo "$t2-$t1" | bc) rc=$rc load0=[$load0]" \
       "load1=[$load1] load2=[$load2] start=$(date -u -d "@${t0%.*}" +%FT%TZ)" >>"$OUT/results.txt"
  rm -rf "$cache"
done
