# loopscale pipeline: params.yaml -> prepared data -> one training job per run ->
# one evaluation job per run (all its diagnostics) -> tables -> figures -> report.
#
#   snakemake --cores all                            # the default experiment (params.yaml: experiment)
#   snakemake --cores all --config experiment=smoke  # another experiment
#   snakemake -n                                     # what would run, and why
#
# Stages: workflow/rules/{settings,data,train,eval,report}.smk; helpers: workflow/rules/common.smk
# and loopscale.pipeline. Every job is one call of the `loopscale` command line.
# Documentation: docs/pipeline.md.
from snakemake.utils import min_version

min_version("9.0")


# `snakemake --report report.html` (or .zip): this page, then the files marked report()
report: "workflow/report/workflow.rst"


# settings (validated in full before any job), the selected experiment, helpers
include: "workflow/rules/common.smk"


# tight wildcards: only this experiment's names reach a shell
wildcard_constraints:
    exp=alternatives([EXP.name]),
    size=alternatives(r.size for r in EXP.runs),
    cond=P.WILDCARDS["cond"],
    seed=P.WILDCARDS["seed"],


include: "workflow/rules/settings.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/eval.smk"
include: "workflow/rules/report.smk"


localrules:
    all,


rule all:
    """The default target: the selected experiment's tables, figures and report, and every
    run's results (so that a deleted checkpoint or result is rebuilt: Snakemake rebuilds a
    missing file only when a job that needs it runs or it is a target)."""
    input:
        run_files("summary.json"),
        run_files("model.pt"),
        eval_files(),
        expand(rules.aggregate.output, exp=EXP.name),
        expand(rules.figures.output, exp=EXP.name),
        expand(rules.report.output, exp=EXP.name),
    default_target: True
