# loopscale: two commands do everything.
#   make smoke       set up .venv with what the pipeline needs and run the smoke experiment (a
#                    minute on 2 cores after set-up: two conditions, a tiny model, every stage;
#                    results/smoke/REPORT.md)
#   make reproduce   the same set-up, then the cpu experiment of the pipeline (results/ rebuilt;
#                    EXPERIMENT=NAME for another)
#   make test        set up .venv with everything (tests, DVC, HF, lm-eval, tracking) and run the
#                    test suite (what CI runs)
# Two pinned sets: requirements.lock (everything) and requirements-pipeline.lock (the core and
# the pipeline extra, the same versions; `make lock-pipeline` derives it from requirements.lock).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
EXPERIMENT ?= cpu
CORES  ?= all
# pipeline jobs call `loopscale`, `snakemake` and `dvc`: the venv's bin comes first
export PATH := $(CURDIR)/$(BIN):$(PATH)

# Snakemake quiet: no job's rule block (its ~40 inputs, outputs, reason), no host banner.
# SNAKEMAKE_QUIET= (empty) shows everything.
SNAKEMAKE_QUIET ?= --quiet rules host
# One line when a job starts and one when it is done ("[ 7/14] done  train  smoke raw-... seed42
# (3.6s)"), a failed job as one FAILED line naming its log, a summary line at the end: the
# project's logger plugin (src/snakemake_logger_plugin_loopscale, installed with the project).
# Where the venv can't import it, Snakemake's own logger (then a job is its scheduler lines);
# SNAKEMAKE_LOGGER= (empty) asks for that. Expanded when a recipe runs, after the set-up.
SNAKEMAKE_LOGGER ?= $(shell $(BIN)/python -c "import snakemake_logger_plugin_loopscale" 2>/dev/null && echo --logger loopscale)
SNAKEMAKE = $(BIN)/snakemake $(SNAKEMAKE_QUIET) $(SNAKEMAKE_LOGGER)

.PHONY: setup setup-pipeline lock-pipeline smoke reproduce confirm drift-law claims-matrix test test-fast bench clean-runs

setup: $(VENV)/.installed

# everything in requirements.lock (the test suite, DVC, HF, lm-eval, tracking)
$(VENV)/.installed: pyproject.toml requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -r requirements.lock
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $@ $(VENV)/.pipeline

# the pipeline alone (the core + the pipeline extra), pinned as in requirements.lock
setup-pipeline: $(VENV)/.pipeline

$(VENV)/.pipeline: pyproject.toml requirements-pipeline.lock
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -r requirements-pipeline.lock
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $@

# requirements-pipeline.lock: pip's resolution of loopscale[pipeline] constrained to
# requirements.lock's versions (pip >= 22.2; run after changing requirements.lock)
lock-pipeline:
	$(PYTHON) tools/pipeline_lock.py

smoke: setup-pipeline
	$(SNAKEMAKE) --cores $(CORES) --config experiment=smoke

reproduce: setup-pipeline
	$(SNAKEMAKE) --cores $(CORES) --config experiment=$(EXPERIMENT)

# the confirmatory study (docs/studies.md): cpu_confirm + cpu_confirm_lr + cpu_long_drift (the
# drift law's held-out point: cpu_long's drifting model alone), then the drift law
confirm: setup-pipeline
	$(SNAKEMAKE) --cores $(CORES) --config experiment=cpu_confirm
	$(SNAKEMAKE) --cores $(CORES) --config experiment=cpu_confirm_lr
	$(SNAKEMAKE) --cores $(CORES) --config experiment=cpu_long_drift
	$(MAKE) drift-law

# the drift law across experiments, from the committed results/<exp>/train_norms.csv
# the claims matrix across experiments (results/claims_matrix) and the README's view of it
claims-matrix: setup-pipeline
	$(BIN)/loopscale report claims-matrix --results results/cpu results/cpu_confirm results/cpu_confirm_lr \
		results/cpu_long results/cpu_long_drift results/cpu_factorial results/cpu_length --out results/claims_matrix \
		--readme cpu,cpu_confirm:d64,cpu_long,cpu_length,cpu_factorial:w128,cpu_factorial:l4,cpu_factorial:ctx128 \
		--splice README.md

drift-law: setup-pipeline
	$(BIN)/loopscale report drift-law --results results/cpu_confirm results/cpu_confirm_lr results/cpu_long_drift \
		--holdout cpu_long_drift --out results/drift_law

# the suite on TEST_WORKERS pytest-xdist workers (2: CI's cores; TEST_WORKERS=0 runs it in one
# process), one CPU thread each (tests/conftest.py)
TEST_WORKERS ?= 2

test: setup
	HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -n $(TEST_WORKERS)

test-fast: setup
	HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -n $(TEST_WORKERS) -m "not slow"

bench: setup-pipeline
	$(BIN)/loopscale bench --preset cpu
