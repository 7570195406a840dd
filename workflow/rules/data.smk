# Stage 1: corpus -> tokenizer + uint16 token files, once per experiment.
# data/<exp>/config.yaml (the experiment's data settings) is written by settings.smk.


rule prepare_data:
    """Fetch/read the corpus, fit the tokenizer and write the token files of one experiment."""
    input:
        config="data/{exp}/config.yaml",
        code=DATA_CODE,
    output:
        tokenizer="data/{exp}/tokenizer.json",
        train="data/{exp}/train.bin",
        validation="data/{exp}/validation.bin",
        test="data/{exp}/test.bin",
        meta="data/{exp}/meta.json",
        # data.source=fineweb: data.eval_corpus beside the held-out documents, the same tokenizer
        eval_corpus=[f"data/{{exp}}/{EXP.data['eval_corpus']}/meta.json"] if EXP.streamed and EXP.data.get("eval_corpus") else [],
    log:
        "logs/{exp}/prepare_data.log",
    params:
        out=lambda wc, output: os.path.dirname(output.meta),
    threads: 1
    conda:
        "../envs/loopscale.yaml"
    shell:
        "loopscale prepare-data --config {input.config:q} --out {params.out:q} > {log:q} 2>&1"
