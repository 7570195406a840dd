# Settings and helpers shared by the stages (functions only; the stages hold the rules).
#
# params.yaml is read and validated in full here, before any job: snakemake.utils.validate
# against the JSON schema (workflow/schemas/params.schema.yaml), then every run's RunConfig
# and EvalConfig are built with loopscale.config. A problem stops Snakemake with one line
# naming the key (loopscale.pipeline.load_and_validate). Nothing is written here: each
# settings file (a run's config.yaml, eval.yaml, stream.yaml; the data config) is the output
# of a job of workflow/rules/settings.smk, which the jobs that read it depend on.
import json
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
        overrides={k: v for k, v in config.items() if k not in ("params", "settings")},
        settings_path=config.get("settings"),  # exp.yaml: what `dvc exp run -S` edits
    )
except P.ParamsError as e:
    sys.stderr.write(f"loopscale pipeline: error: {e}\n")
    sys.exit(1)
EXP = EXPERIMENTS[PARAMS["experiment"]]
SETTINGS = P.settings_files(EXP)  # {path: text} of every settings file of the experiment
SRC = os.path.relpath(os.path.join(workflow.basedir, "src"))
# what the settings come from: the inputs of the settings jobs (workflow/rules/settings.smk)
SETTINGS_SOURCES = [PARAMS_FILE, *([config["settings"]] if config.get("settings") else []),
                    *(f for m in P.SETTINGS_CODE if os.path.isfile(f := os.path.join(SRC, "loopscale", f"{m}.py")))]
if workflow.is_main_process:
    try:
        P.check_settings(SETTINGS, SETTINGS_SOURCES)
    except P.ParamsError as e:
        sys.stderr.write(f"loopscale pipeline: error: {e}\n")
        sys.exit(1)
    _account = P.placeholder_account(getattr(workflow.resource_settings, "default_resources", None))
    if _account:  # the SLURM profile as shipped: say so before anything is submitted
        sys.stderr.write(f"loopscale pipeline: warning: {_account}\n")

# the code each stage runs (loopscale.pipeline.STAGE_ONLY): an input of its jobs
DATA_CODE, EVAL_CODE, REPORT_CODE, OURO_CODE = (P.stage_code(s, SRC) for s in ("data", "eval", "report", "ouro"))
TRAIN_CODE = P.stage_code("train_stream" if EXP.streamed else "train", SRC)  # data.source=fineweb: train-stream


def alternatives(values):
    """A regex matching exactly the given values."""
    return "|".join(re.escape(str(v)) for v in sorted(set(values), key=str))


# --- input and parameter functions -----------------------------------------------------
def run_of(wc):
    return EXP.run(wc.size, wc.cond, wc.seed)


def data_dir_of(wc, input):
    return os.path.dirname(input.data[0])


def run_dir_of(wc, input):
    return os.path.dirname(input.config)


def settings_sources(wc):
    """A settings job's inputs: what its file's settings come from, ancient while the file holds
    them (an edit of params.yaml then reruns only the jobs whose settings it changed)."""
    if P.settings_stale(wc.settings, SETTINGS[wc.settings]):
        return SETTINGS_SOURCES
    return [ancient(f) for f in SETTINGS_SOURCES]


def run_files(name):
    """Every run's RUN/<name> in the experiment."""
    return [os.path.join(r.dir, name) for r in EXP.runs]


def eval_files():
    return [os.path.join(r.dir, "eval", f"{d}.json") for r in EXP.runs for d in EXP.diagnostics] + ouro_files()


def ouro_files():
    """Appendix B's evaluations of an Ouro experiment: variable depth on each corpus, downstream."""
    if not EXP.ouro:
        return []
    names = [f"ouro_depth-{c}.json" for c in EXP.depth_corpora] + (["downstream.json"] if EXP.downstream else [])
    return [os.path.join(r.dir, "eval", n) for r in EXP.runs for n in names]


def run_dirs(wc):
    return [r.dir for r in EXP.runs]


def job_threads(wc):
    return run_of(wc).config.train.threads or 1


def ranks_per_node():
    return max(1, EXP.gpus_per_run // EXP.nodes_per_run)


def train_threads(wc):
    """A training job's CPUs: train.threads for each of its ranks on one node."""
    return job_threads(wc) * ranks_per_node()


def reported_table(table):
    """A result table marked for `snakemake --report` (claims first, then the other tables)."""
    claims = table == "claims"
    return report(f"results/{{exp}}/{table}.csv", caption=f"../report/{'claims' if claims else 'tables'}.rst",
                  category="Claims" if claims else "Tables", labels={"table": table})


# --- Appendix B's evaluations of an Ouro experiment (eval.smk: ouro_depth, downstream) ---
def ouro_depth_command(wc, input, output, threads):
    run = run_of(wc)
    seq = run.config.model.seq_len
    windows = -(-run.eval.max_tokens // seq) if run.eval.max_tokens else 0
    cmds = [f"loopscale ouro-depth --model {shlex.quote(input.model)} --data {shlex.quote(d)} --max-k 8"
            f" --windows {windows} --batch-size {run.eval.batch_size} --out {shlex.quote(o)}"
            for d, o in zip(EXP.depth_corpora.values(), output)]
    return " && ".join(cmds)


def downstream_args(wc):
    d = EXP.downstream or {}
    args = [f"--tasks {shlex.quote(','.join(d.get('tasks') or []))}", f"--limit {d.get('limit', 0)}",
            f"--batch-size {d.get('batch_size', 8)}", f"--device {'cuda' if EXP.gpu else 'cpu'}"]
    if d.get("loops"):
        args.append(f"--loops {','.join(map(str, d['loops']))}")
    if d.get("include_path"):
        args.append(f"--include-path {shlex.quote(str(d['include_path']))}")
    if d.get("per_token_norm"):
        args.append("--per-token-norm")
    return " ".join(args)
