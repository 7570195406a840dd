# Stage 2: one training job per run (experiment x size x condition x seed).
#
# Input: RUN/train-config.yaml (the resolved config minus eval settings, written by
# common.smk), so a changed setting retrains exactly the runs it changes while an eval
# setting reruns only the evaluations. The job trains from RUN/config.yaml (the same
# settings plus eval; deliberately not an input), so model.pt carries the full config.
#
# Only summary.json is declared as output: it is the one file every outcome writes
# (completed | diverged | failed, thanks to --record-failure). model.pt, metrics.jsonl and
# config.json sit beside it. RUN/state.pt (resume state) is deliberately undeclared:
# Snakemake deletes declared outputs of a failed job, and resuming needs it. A state.pt
# left by other training settings is dropped first (it could not be resumed).


rule train:
    """Train one run; a crash is recorded as status "failed" in summary.json (exit 0)."""
    input:
        config="runs/{exp}/{size}/{cond}/seed{seed}/train-config.yaml",
        data=data_inputs,
        code=TRAIN_CODE,
    output:
        summary="runs/{exp}/{size}/{cond}/seed{seed}/summary.json",
    log:
        "logs/{exp}/{size}/{cond}/seed{seed}/train.log",
    params:
        run=run_dir_of,
        full_config=lambda wc, input: os.path.join(os.path.dirname(input.config), "config.yaml"),
        data=data_dir_of,
        python=sys.executable,
    threads: job_threads
    resources:
        gpu=EXP.gpu,
    conda:
        "../envs/loopscale.yaml"
    shell:
        """
        exec > {log} 2>&1
        if [ -e {params.run}/state.pt ]; then
            {params.python} -m loopscale.pipeline drop-stale-state {params.run} {params.full_config}
        fi
        loopscale train --config {params.full_config} --data {params.data} --out {params.run} -q --record-failure
        """
