# Stage 4: aggregate every run of the experiment into tables, then figures, then the report.
# Inputs: the runs' result files and the report code (src/loopscale/report/**). The
# outputs are the files `loopscale report` documents (src/loopscale/report/__init__.py).
# They take seconds: local rules (on a cluster they run in the snakemake process's host,
# not as allocations). Files marked with report() go into `snakemake --report report.html`
# (captions: workflow/report/*.rst; categories Claims, Figures, Tables, in that order).

TABLES = ["main", "depth", "norms", "radial", "lemma", "clamp", "scale", "halting", "halting_paper", "story", "drift",
          "runs", "claims", "choices"]
# the experiment's claims (params.yaml `claims:`): the dose family adds the dose-response table and figure
CLAIMS_ARGS = (f"--claims {shlex.quote(EXP.claims_family)}" +
               (f" --preregistered {shlex.quote(EXP.preregistered)}" if EXP.preregistered else ""))
FIGURE_ARGS = f"--claims {shlex.quote(EXP.claims_family)}"
DOSE = EXP.claims_family == "dose"
FIGURES = ["norm_per_loop", "norm_training", "ppl_depth", "frontier", "frontier_exits", "radial_vs_norm",
           "norm_histogram", "lemma", "scale", "exit_training", "drift", "story_quadrant"]
EXP_FIGURES = [*FIGURES, "dose"] if DOSE else FIGURES


localrules:
    aggregate,
    figures,
    report,


rule aggregate:
    """Tables (CSV + Markdown) of every run and condition, and the paper's claims."""
    input:
        summaries=run_files("summary.json"),
        evals=eval_files(),
        code=REPORT_CODE,
    output:
        csv=[reported_table(t) for t in TABLES],
        md=expand("results/{{exp}}/{table}.md", table=TABLES),
        norm_loops=reported_table("norm_loops"),
        per_seed="results/{exp}/per_seed.csv",
        train_norms="results/{exp}/train_norms.csv",  # the drift laws' training logs (loopscale report drift-law)
        metrics="results/{exp}/metrics.json",
        # an Ouro experiment: Appendix B's tables (variable depth, downstream accuracy)
        appendix_b=[reported_table("appendix_b"), "results/{exp}/appendix_b.md"] if EXP.ouro else [],
        dose=[reported_table("dose"), "results/{exp}/dose.md"] if DOSE else [],
    log:
        "logs/{exp}/aggregate.log",
    params:
        runs=run_dirs,
        out=lambda wc, output: os.path.dirname(output.norm_loops),
        claims=CLAIMS_ARGS,
    conda:
        "../envs/loopscale.yaml"
    shell:
        "loopscale report tables --runs {params.runs:q} --out {params.out:q} {params.claims} > {log:q} 2>&1"


rule figures:
    """Figures of the experiment, each as PNG and PDF."""
    input:
        tables=rules.aggregate.output.csv,
        summaries=run_files("summary.json"),
        evals=eval_files(),
        code=REPORT_CODE,
    output:
        png=[report(f"results/{{exp}}/figures/{f}.png", caption="../report/figures.rst", category="Figures",
                    labels={"figure": f}) for f in EXP_FIGURES],
        pdf=expand("results/{{exp}}/figures/{figure}.pdf", figure=EXP_FIGURES),
    log:
        "logs/{exp}/figures.log",
    params:
        runs=run_dirs,
        out=lambda wc, output: os.path.dirname(output.png[0]),
        claims=FIGURE_ARGS,
    conda:
        "../envs/loopscale.yaml"
    shell:
        "loopscale report figures --runs {params.runs:q} --out {params.out:q} {params.claims} > {log:q} 2>&1"


rule report:
    """REPORT.md: the experiment's findings next to the paper's claims."""
    input:
        tables=rules.aggregate.output,
        figures=rules.figures.output,
        params=PARAMS_FILE,
        code=REPORT_CODE,
    output:
        report="results/{exp}/REPORT.md",
    log:
        "logs/{exp}/report.log",
    params:
        runs=run_dirs,
        results=lambda wc, output: os.path.dirname(output.report),
        figures=lambda wc, input: os.path.dirname(input.figures[0]),
    conda:
        "../envs/loopscale.yaml"
    shell:
        "loopscale report write --runs {params.runs:q} --results {params.results:q} --figures {params.figures:q}"
        " --params {input.params:q} --experiment {wildcards.exp:q} --out {output.report:q} > {log:q} 2>&1"
