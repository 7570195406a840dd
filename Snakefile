# loopscale pipeline: params.yaml -> prepared data -> one training job per run ->
# depth evaluation + diagnostics per run -> tables -> figures -> report.
#
#   snakemake --cores all                            # the default experiment (params.yaml: experiment)
#   snakemake --cores all --config experiment=smoke  # another experiment
#   snakemake -n                                     # what would run, and why
#
# Stages: workflow/rules/{data,train,eval,report}.smk; helpers: workflow/rules/common.smk
# and loopscale.pipeline. Every job is one call of the `loopscale` command line.
# Documentation: docs/pipeline.md.
from snakemake.utils import min_version

min_version("9.0")


# settings (validated in full before any job), the selected experiment, helpers
include: "workflow/rules/common.smk"


# tight wildcards: only this experiment's names reach a shell
wildcard_constraints:
    exp=alternatives([EXP.name]),
    size=alternatives(r.size for r in EXP.runs),
    cond=P.WILDCARDS["cond"],
    seed=P.WILDCARDS["seed"],
    diag=alternatives(d for d in P.DIAGNOSTICS if d != "depth"),


include: "workflow/rules/data.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/eval.smk"
include: "workflow/rules/report.smk"


rule all:
    """The default target: the selected experiment's tables, figures and report."""
    input:
        expand(rules.aggregate.output, exp=EXP.name),
        expand(rules.figures.output, exp=EXP.name),
        expand(rules.report.output, exp=EXP.name),
    default_target: True
