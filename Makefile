# loopscale: two commands do everything.
#   make smoke       set up .venv and run the smoke experiment (a minute on 2 cores after set-up:
#                    two conditions, a tiny model, every stage; results/smoke/REPORT.md)
#   make reproduce   set up .venv and run the cpu experiment of the pipeline (results/ rebuilt;
#                    EXPERIMENT=NAME for another)
#   make test        set up .venv and run the test suite (what CI runs)
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
EXPERIMENT ?= cpu
CORES  ?= all
# pipeline jobs call `loopscale`, `snakemake` and `dvc`: the venv's bin comes first
export PATH := $(CURDIR)/$(BIN):$(PATH)

.PHONY: setup smoke reproduce confirm drift-law test test-fast bench clean-runs

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -r requirements.lock
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $@

smoke: setup
	$(BIN)/snakemake --cores $(CORES) --config experiment=smoke

reproduce: setup
	$(BIN)/snakemake --cores $(CORES) --config experiment=$(EXPERIMENT)

# the confirmatory study (docs/studies.md): cpu_confirm + cpu_confirm_lr + cpu_long_drift (the
# drift law's held-out point: cpu_long's drifting model alone), then the drift law
confirm: setup
	$(BIN)/snakemake --cores $(CORES) --config experiment=cpu_confirm
	$(BIN)/snakemake --cores $(CORES) --config experiment=cpu_confirm_lr
	$(BIN)/snakemake --cores $(CORES) --config experiment=cpu_long_drift
	$(MAKE) drift-law

# the drift law across experiments, from the committed results/<exp>/train_norms.csv
drift-law: setup
	$(BIN)/loopscale report drift-law --results results/cpu_confirm results/cpu_confirm_lr results/cpu_long_drift \
		--holdout cpu_long_drift --out results/drift_law

# the suite on TEST_WORKERS pytest-xdist workers (2: CI's cores; TEST_WORKERS=0 runs it in one
# process), one CPU thread each (tests/conftest.py)
TEST_WORKERS ?= 2

test: setup
	HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -n $(TEST_WORKERS)

test-fast: setup
	HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -n $(TEST_WORKERS) -m "not slow"

bench: setup
	$(BIN)/loopscale bench --preset cpu
