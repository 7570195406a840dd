# Stage 4: aggregate every run of the experiment into tables, then figures, then the report.
# Inputs: the runs' result files and the report code (src/loopscale/report/**).


rule aggregate:
    """Per-run and per-condition tables (CSV + Markdown)."""
    input:
        summaries=run_files("summary.json"),
        evals=eval_files(),
        code=REPORT_CODE,
    output:
        runs="results/{exp}/runs.csv",
        tables="results/{exp}/tables.md",
    log:
        "logs/{exp}/aggregate.log",
    params:
        runs=run_dirs,
        out=lambda wc, output: os.path.dirname(output.tables),
    conda:
        "../envs/loopscale.yaml"
    shell:
        "loopscale report tables --runs {params.runs} --out {params.out} > {log} 2>&1"


rule figures:
    """Figures of the experiment."""
    input:
        tables=rules.aggregate.output,
        summaries=run_files("summary.json"),
        evals=eval_files(),
        code=REPORT_CODE,
    output:
        figures=directory("results/{exp}/figures"),
    log:
        "logs/{exp}/figures.log",
    params:
        runs=run_dirs,
    conda:
        "../envs/loopscale.yaml"
    shell:
        "loopscale report figures --runs {params.runs} --out {output.figures} > {log} 2>&1"


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
        results=lambda wc, input: os.path.dirname(input.tables[0]),
    conda:
        "../envs/loopscale.yaml"
    shell:
        "loopscale report write --results {params.results} --params {input.params}"
        " --experiment {wildcards.exp} --out {output.report} > {log} 2>&1"
