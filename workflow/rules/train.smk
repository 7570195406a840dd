# Stage 2: one training job per run (experiment x size x condition x seed).
#
# Input: RUN/config.yaml (the run's training config, written by settings.smk), so a changed
# setting retrains exactly the runs it changes; the evaluation settings live in
# RUN/eval.yaml, an input of the evaluations only.
#
# Outputs: summary.json and model.pt, which every outcome writes (completed | diverged |
# failed: with --record-failure a crash is recorded in both, model.pt then holding no
# weights), so a deleted model.pt retrains and --delete-all-output removes checkpoints.
# metrics.jsonl and loopscale.json (+ the artifact files) sit beside them. RUN/state.pt (resume state) is
# deliberately undeclared: Snakemake deletes the declared outputs of a failed job, and
# resuming needs it; one left by other training settings is dropped (--drop-stale-state).
#
# Threads: RUN/config.yaml holds train.threads: 0 and the job passes its own threads
# (--set train.threads), so changing train.threads in params.yaml retrains nothing: it
# changes a job's speed, not its result (tests/test_pipeline.py).
#
# Signals: the job execs the trainer (no shell between), which watches its parent
# (--stop-with-parent, from its first instant; LOOPSCALE_PARENT_PID names snakemake even before
# then): when snakemake dies, even by SIGKILL, training checkpoints and stops as
# on SIGTERM, and `--rerun-incomplete` resumes it. Snakemake interrupted alone (Ctrl-C or
# SIGINT to its pid) waits for the running job, then records it incomplete; the finished run
# keeps second names of model.pt and summary.json, so the rerun puts it back instead of
# retraining it (loopscale.rundir.KEPT).
#
# Time limits and preemption: a SIGTERM (SLURM sends one before the time limit) saves
# state.pt and exits 143, a failed job; Snakemake retries it (`--retries`, set by the
# SLURM profiles) and the retry resumes from state.pt. A crash is a result (status
# failed), not retried.
#
# An experiment whose data.source is fineweb (Appendix B's recipe) trains with `loopscale
# train-stream` instead: the corpus streamed (the held-out documents left out), RUN/stream.yaml
# its stream settings, the data directory its validation split and tokenizer.
#
# An experiment with gpus_per_run > 1 trains through torchrun (one rank per GPU; srun starts
# one torchrun per node when nodes_per_run > 1): Experiment.train_launcher/train_resources.


rule train:
    """Train one run; a crash is recorded as status "failed" (exit 0)."""
    input:
        config="runs/{exp}/{size}/{cond}/seed{seed}/config.yaml",
        data=rules.prepare_data.output,
        code=TRAIN_CODE,
        # a streamed run (data.source=fineweb): its stream settings, loopscale train-stream --stream-config
        stream=["runs/{exp}/{size}/{cond}/seed{seed}/stream.yaml"] if EXP.streamed else [],
    output:
        summary="runs/{exp}/{size}/{cond}/seed{seed}/summary.json",
        model="runs/{exp}/{size}/{cond}/seed{seed}/model.pt",
    log:
        "logs/{exp}/{size}/{cond}/seed{seed}/train.log",
    params:
        run=run_dir_of,
        data=data_dir_of,
        launch=EXP.train_launcher,
        ranks=ranks_per_node(),
        stream=lambda wc, input: f"--stream-config {shlex.quote(input.stream[0])} " if input.stream else "",
    threads: train_threads
    resources:
        **EXP.train_resources,
    conda:
        "../envs/loopscale.yaml"
    shell:
        "LOOPSCALE_PARENT_PID=$PPID exec {params.launch} --config {input.config:q} {params.stream}--data {params.data:q} --out {params.run:q}"
        " --set train.threads=$(( {threads} / {params.ranks} ))"
        " -q --record-failure --drop-stale-state --stop-with-parent > {log:q} 2>&1"
