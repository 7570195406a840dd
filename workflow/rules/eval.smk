# Stage 3: evaluations of every trained run: the depth evaluation (rule depth_eval) and
# one job per other diagnostic (rule diagnostic). Inputs: the run's summary.json (the
# training job's output), its config.yaml (its eval settings are passed with --set, so an
# edited eval setting reruns the evaluations, not training) and the evaluation code.
# A diverged run yields a JSON with status "diverged" without evaluating (loopscale eval);
# a failed run (summary.json status "failed", no model.pt) one with status "failed"
# (workflow/scripts/unevaluated.py), so `--keep-going` is not even needed for it.
# --threads follows the job's threads (no oversubscription, the same numbers on any host).


rule depth_eval:
    """PPL per exit k=1..K and with extrapolated depth k=1..depth_factor*K."""
    input:
        summary="runs/{exp}/{size}/{cond}/seed{seed}/summary.json",
        config="runs/{exp}/{size}/{cond}/seed{seed}/config.yaml",
        data=data_inputs,
        code=EVAL_CODE,
    output:
        result="runs/{exp}/{size}/{cond}/seed{seed}/eval/depth.json",
    log:
        "logs/{exp}/{size}/{cond}/seed{seed}/depth.log",
    params:
        run=run_dir_of,
        data=data_dir_of,
        sets=eval_sets,
        python=sys.executable,
        unevaluated=UNEVALUATED,
    threads: job_threads
    resources:
        gpu=EXP.gpu,
    conda:
        "../envs/loopscale.yaml"
    shell:
        """
        exec > {log} 2>&1
        if ! grep -q '"status": *"failed"' {input.summary}; then
            loopscale eval depth --model {params.run}/model.pt --data {params.data} --out {output.result} \
                --threads {threads} -q {params.sets}
        else
            {params.python} {params.unevaluated} depth {input.summary} {output.result}
        fi
        """


rule diagnostic:
    """One diagnostic (throughput, norms, radial, lemma, clamp, halting) of one run."""
    input:
        summary="runs/{exp}/{size}/{cond}/seed{seed}/summary.json",
        config="runs/{exp}/{size}/{cond}/seed{seed}/config.yaml",
        data=data_inputs,
        code=EVAL_CODE,
    output:
        result="runs/{exp}/{size}/{cond}/seed{seed}/eval/{diag}.json",
    log:
        "logs/{exp}/{size}/{cond}/seed{seed}/{diag}.log",
    params:
        run=run_dir_of,
        data=data_dir_of,
        sets=eval_sets,
        python=sys.executable,
        unevaluated=UNEVALUATED,
    threads: job_threads
    resources:
        gpu=EXP.gpu,
    conda:
        "../envs/loopscale.yaml"
    shell:
        """
        exec > {log} 2>&1
        if ! grep -q '"status": *"failed"' {input.summary}; then
            loopscale eval {wildcards.diag} --model {params.run}/model.pt --data {params.data} \
                --out {output.result} --threads {threads} -q {params.sets}
        else
            {params.python} {params.unevaluated} {wildcards.diag} {input.summary} {output.result}
        fi
        """
