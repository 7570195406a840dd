# Settings and helpers shared by the stages (functions only; the stages hold the rules).
#
# params.yaml is read and validated in full here, before any job: the JSON schema
# (workflow/schemas/params.schema.yaml), then every run's RunConfig is built with
# loopscale.config. A problem stops Snakemake with one line naming the key.
# Then every run's resolved config is written with write-if-changed (unchanged runs keep
# their files and mtimes). Those files are rule inputs, so a changed setting reruns
# exactly the runs it changes, also in a fresh clone without .snakemake/ metadata.
import os
import re
import shlex
import sys

from loopscale import pipeline as P

PARAMS_FILE = config.get("params", "params.yaml")
try:
    PARAMS, EXPERIMENTS = P.load_and_validate(
        PARAMS_FILE,
        os.path.join(workflow.basedir, "workflow", "schemas", "params.schema.yaml"),
        overrides={k: v for k, v in config.items() if k != "params"},
    )
except P.ParamsError as e:
    sys.stderr.write(f"loopscale pipeline: error: {e}\n")
    sys.exit(1)

EXP = EXPERIMENTS[PARAMS["experiment"]]
P.materialize(EXP)


def alternatives(values):
    """A regex matching exactly the given values."""
    return "|".join(re.escape(str(v)) for v in sorted(set(values), key=str))


# --- code each stage depends on (a module that is not an input is invisible) ----------
def code(*names):
    return [os.path.join("src", "loopscale", n) for n in names if os.path.exists(os.path.join("src", "loopscale", n))]


DATA_CODE = code("config.py", "data.py", "io.py")
TRAIN_CODE = code("config.py", "model.py", "objective.py", "data.py", "train.py", "evaluate.py", "io.py")
EVAL_CODE = code(
    "config.py", "model.py", "objective.py", "data.py", "evaluate.py", "io.py", "diagnostics.py", "halting.py"
)
REPORT_CODE = sorted(
    os.path.join(d, f) for d, _, files in os.walk(os.path.join("src", "loopscale", "report")) for f in files if f.endswith(".py")
)
UNEVALUATED = os.path.join(workflow.basedir, "workflow", "scripts", "unevaluated.py")
DATA_FILES = ["tokenizer.json", "train.bin", "validation.bin", "test.bin", "meta.json"]


# --- input and parameter functions -----------------------------------------------------
def run_of(wc):
    return EXP.run(wc.size, wc.cond, wc.seed)


def data_inputs(wc):
    return [os.path.join(P.data_dir(wc.exp), f) for f in DATA_FILES]


def data_dir_of(wc, input):
    return os.path.dirname(input.data[0])


def run_dir_of(wc, input):
    return os.path.dirname(input.config)


def run_files(name):
    """Every run's RUN/<name> in the experiment."""
    return [os.path.join(r.dir, name) for r in EXP.runs]


def eval_files():
    return [os.path.join(r.dir, "eval", f"{d}.json") for r in EXP.runs for d in EXP.diagnostics]


def run_dirs(wc):
    return " ".join(r.dir for r in EXP.runs)


def job_threads(wc):
    return run_of(wc).config.train.threads or 1


def eval_sets(wc):
    """The run's eval settings as `--set eval.KEY=VALUE` arguments for `loopscale eval`."""
    ev = run_of(wc).config.to_dict()["eval"]
    return " ".join(f"--set {shlex.quote(f'eval.{k}={v}')}" for k, v in ev.items())
