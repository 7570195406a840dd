# Stage 3: one evaluation job per trained run: `loopscale eval all --only <diagnostics>`
# runs the experiment's diagnostics in one process, loading the model once (one GPU
# allocation per run on a cluster). Inputs: the run's summary.json and model.pt (the
# training job's outputs), its eval.yaml (its evaluation settings, --eval-config, so an
# edited eval setting reruns the evaluations, not training) and the evaluation code.
# A failed run (summary.json status "failed") or a diverged one gets result files with
# that status, written by `loopscale eval` without evaluating, so the grid completes.
# --threads follows the job's threads (no oversubscription, the same numbers on any host).


rule eval:
    """The experiment's diagnostics (depth, throughput, norms, radial, lemma, clamp, halting) of one run."""
    input:
        summary="runs/{exp}/{size}/{cond}/seed{seed}/summary.json",
        model="runs/{exp}/{size}/{cond}/seed{seed}/model.pt",
        eval_config="runs/{exp}/{size}/{cond}/seed{seed}/eval.yaml",
        data=rules.prepare_data.output,
        code=EVAL_CODE,
    output:
        expand("runs/{{exp}}/{{size}}/{{cond}}/seed{{seed}}/eval/{diag}.json", diag=EXP.diagnostics),
    log:
        "logs/{exp}/{size}/{cond}/seed{seed}/eval.log",
    params:
        data=data_dir_of,
        outdir=lambda wc, output: os.path.dirname(output[0]),
        only=",".join(EXP.diagnostics),
    threads: job_threads
    resources:
        gpu=EXP.gpu,
    conda:
        "../envs/loopscale.yaml"
    shell:
        "loopscale eval all --model {input.model:q} --data {params.data:q} --outdir {params.outdir:q}"
        " --only {params.only:q} --threads {threads} -q --eval-config {input.eval_config:q} > {log:q} 2>&1"


# Appendix B's evaluations of an Ouro experiment (every run model.arch ouro), one job per run:
# `loopscale ouro-depth` (PPL at K = 1..8, the final readout on step K) on each corpus of
# Experiment.depth_corpora (held-out FineWeb and WikiText for a FineWeb experiment), and with a
# `downstream:` block `loopscale ouro-downstream` (multiple choice through lm-eval). A failed or
# diverged run gets result files with its status. Read by appendix_b.csv (report.smk).


rule ouro_depth:
    """Variable-depth PPL (K = 1..8) of one Ouro run on each evaluation corpus."""
    input:
        summary="runs/{exp}/{size}/{cond}/seed{seed}/summary.json",
        model="runs/{exp}/{size}/{cond}/seed{seed}/model.pt",
        eval_config="runs/{exp}/{size}/{cond}/seed{seed}/eval.yaml",
        data=rules.prepare_data.output,
        code=OURO_CODE,
    output:
        [f"runs/{{exp}}/{{size}}/{{cond}}/seed{{seed}}/eval/ouro_depth-{c}.json" for c in EXP.depth_corpora],
    log:
        "logs/{exp}/{size}/{cond}/seed{seed}/ouro_depth.log",
    params:
        cmd=ouro_depth_command,
    threads: job_threads
    resources:
        gpu=EXP.gpu,
    conda:
        "../envs/loopscale.yaml"
    shell:
        "export OMP_NUM_THREADS={threads}; ( {params.cmd} ) > {log:q} 2>&1"


rule downstream:
    """Appendix B's downstream multiple choice (lm-eval, the loopscale model type) of one Ouro run."""
    input:
        summary="runs/{exp}/{size}/{cond}/seed{seed}/summary.json",
        model="runs/{exp}/{size}/{cond}/seed{seed}/model.pt",
        code=OURO_CODE,
    output:
        "runs/{exp}/{size}/{cond}/seed{seed}/eval/downstream.json",
    log:
        "logs/{exp}/{size}/{cond}/seed{seed}/downstream.log",
    params:
        run=lambda wc, input: os.path.dirname(input.model),
        args=downstream_args,
        tasks=lambda wc: json.dumps(EXP.downstream),  # a changed downstream block reruns the job
    threads: job_threads
    resources:
        gpu=EXP.gpu,
    conda:
        "../envs/loopscale.yaml"
    shell:
        "export OMP_NUM_THREADS={threads}; loopscale ouro-downstream --run {params.run:q} {params.args} --out {output:q} > {log:q} 2>&1"
