# Stage 0: the settings files, one local job each (loopscale.pipeline.settings_files): the data
# config (input of prepare_data) and each run's config.yaml (train), eval.yaml (its
# evaluations) and stream.yaml (a streamed run's training). A job gets its file's text from
# params.yaml through `params` and writes it only when it changed, so a changed setting reruns
# exactly the jobs that read a changed file (a thread count, which no file holds, reruns none).
#
# A job runs when its file is missing, or holds other text than params.yaml now gives: its
# inputs are the files the settings come from (params.yaml, the exp.yaml of a DVC experiment,
# the code that computes the texts), newer than the file after an edit, also in a fresh clone
# without .snakemake/ metadata. They are marked ancient for a file that already holds its
# text, so that editing params.yaml reruns only the jobs whose settings it changed
# (loopscale.pipeline.settings_stale). A file out of date but newer than all of them (edited
# by hand, restored by dvc checkout later) stops the workflow with one line (check_settings).


localrules:
    settings,


rule settings:
    """Write one settings file from params.yaml (if its text changed)."""
    input:
        settings_sources,
    output:
        "{settings}",
    log:
        "logs/settings/{settings}.log",
    params:
        # derived from the output: Snakemake's params trigger leaves it out, so a job runs when
        # its file's text is out of date, never because an earlier job wrote another text
        # (a `dvc checkout` of other settings with their results reruns nothing)
        text=lambda wc, output: SETTINGS[output[0]],
    wildcard_constraints:
        settings=alternatives(SETTINGS),
    run:
        P.write_settings(output[0], params.text, log[0])
