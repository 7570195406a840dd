"""Snakemake's console output as one line per job: the logger plugin shipped with the project
(src/snakemake_logger_plugin_loopscale, `snakemake --logger loopscale`), used by the Makefile
and the profiles.

The handler is fed synthetic log records shaped as Snakemake 9 logs them (job start, finish,
failure with its log, Snakemake's own errors and warnings); the Makefile's choice of logger is
read from `make -n`; the SLURM profile's dry run still lists every job; and one `make smoke`
(slow) prints at most two lines per job besides a few header and summary lines."""
from __future__ import annotations

import io
import logging
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("snakemake")
from snakemake.logging import ColorizingTextHandler, DefaultFilter, DefaultFormatter  # noqa: E402
from snakemake.settings.enums import Quietness  # noqa: E402
from snakemake_interface_logger_plugins.common import LogEvent  # noqa: E402

import snakemake_logger_plugin_loopscale as plugin  # noqa: E402
from workflow_support import copy_worktree, pipeline_env, smk  # noqa: E402

QUIET = {Quietness.RULES, Quietness.HOST}  # the Makefile's and the profiles' --quiet
RUN = {"exp": "smoke", "size": "d64", "cond": "rmsnorm-per_loop-none-residual", "seed": "42"}
LABEL = "d64 rmsnorm-per_loop-none-residual seed42"


def settings(**kw):
    base = dict(printshellcmds=True, nocolor=True, quiet=QUIET, debug_dag=False, verbose=False,
                show_failed_logs=False, stdout=False, dryrun=False)
    return SimpleNamespace(**{**base, **kw})


def handler(**kw):
    h = plugin.LogHandler(settings(**kw), None)
    h.default.stream = io.StringIO()
    return h


def out(h) -> list[str]:
    return h.default.stream.getvalue().splitlines()


def record(msg=None, level=logging.INFO, created=None, **extra):
    r = logging.makeLogRecord({"msg": msg, "levelno": level, "levelname": logging.getLevelName(level), **extra})
    if created is not None:
        r.created = created
    return r


def job_info(jobid, rule="train", wildcards=RUN, created=100.0):
    return record(f" Rule: {rule}, Jobid: {jobid}", created=created, event=LogEvent.JOB_INFO, jobid=jobid,
                  rule_msg=None, rule_name=rule, local=False, input=["a"], output=["b"], log=[],
                  benchmark=None, wildcards=dict(wildcards), reason="Missing output files: b",
                  resources={}, priority=0, threads=1, indent=False, is_checkpoint=False,
                  printshellcmd=True, is_handover=False, shellcmd="true")


TABLE = ["Job stats:", "(the table)"]  # passed through as it is


def stats(**counts):
    return record("\n".join(TABLE), event=LogEvent.RUN_INFO, stats={**counts, "total": sum(counts.values())})


def finished(jobid, created):
    return record(f"Finished jobid: {jobid} (Rule: train)", created=created, event=LogEvent.JOB_FINISHED,
                  job_id=jobid)


def progress(done, total):
    return record(None, event=LogEvent.PROGRESS, done=done, total=total)


def test_snakemake_finds_the_plugin_by_its_module_name():
    from snakemake_interface_logger_plugins.registry import LoggerPluginRegistry
    found = LoggerPluginRegistry().get_plugin("loopscale")
    assert found.log_handler is plugin.LogHandler and found.settings_cls is None
    h = handler()
    assert h.writes_to_stream and not h.writes_to_file and h.has_filter and h.has_formatter
    assert not h.needs_rulegraph


def test_a_job_is_a_start_line_and_a_done_line_with_its_run_and_time():
    h = handler()
    for r in (stats(train=2, all=1), job_info(1, created=100.0),
              record("Execute 1 jobs...", event=LogEvent.JOB_STARTED, jobs=[1]),
              record("Select jobs to execute..."), record(None, event=LogEvent.SHELLCMD, cmd="loopscale train"),
              finished(1, 112.34), progress(1, 3)):
        h.handle(r)
    assert out(h) == TABLE + [f"[0/3] start train {LABEL}", f"[1/3] done  train {LABEL}  (12.3s)"]
    h.close()
    assert out(h)[-1] == "1/3 jobs done"


def test_a_failed_job_is_one_line_naming_its_log_then_the_log(tmp_path):
    log = tmp_path / "train.log"
    log.write_text("Traceback (most recent call last):\nRuntimeError: boom\n")
    h = handler(show_failed_logs=True)
    h.handle(stats(train=1, all=1))
    h.handle(job_info(7))
    h.handle(record("Error in rule train, jobid: 7", logging.ERROR, event=LogEvent.JOB_ERROR, rule_name="train",
                    rule_msg=None, jobid=7, input=[], output=[], log=[str(log)], conda_env=None,
                    container_img=None, aux={}, indent=False, shellcmd="loopscale train"))
    lines = out(h)
    assert lines[len(TABLE) + 1] == f"[0/2] FAILED train {LABEL}  log: {log}"
    assert "RuntimeError: boom" in lines  # --show-failed-logs: the log follows
    h.close()
    assert out(h)[-1] == f"0/2 jobs done, 1 FAILED: train {LABEL}"


def job_error(jobid, rule="train", log=(), **kw):
    fields = dict(rule_name=rule, rule_msg=None, jobid=jobid, input=[], output=[], log=list(log), conda_env=None,
                  container_img=None, aux={}, indent=False, shellcmd="loopscale train")
    return record(f"Error in rule {rule}, jobid: {jobid}", logging.ERROR, event=LogEvent.JOB_ERROR, **{**fields, **kw})


def test_a_job_that_succeeds_on_a_retry_is_not_counted_failed():
    """The SLURM profile's `retries`: a job killed by its time limit fails, is resubmitted, resumes."""
    h = handler()
    for r in (stats(train=1), job_info(1), job_error(1, log=["logs/train.log"]), job_info(1, created=200.0),
              finished(1, 260.0), progress(1, 1)):
        h.handle(r)
    h.close()
    assert out(h)[-2:] == [f"[1/1] done  train {LABEL}  (60.0s)", "1/1 jobs done"]


def test_a_record_not_shaped_as_expected_is_shown_as_snakemake_shows_it():
    h = handler()
    h.handle(record("Finished jobid: 3 (Rule: x)", event=LogEvent.JOB_FINISHED))  # no job_id
    assert out(h)[-1] == "Finished jobid: 3 (Rule: x)" and h.done == 0


def test_a_failed_job_without_a_log_names_its_command():
    h = handler()
    h.handle(record("Error in rule x, jobid: 3", logging.ERROR, event=LogEvent.JOB_ERROR, rule_name="x",
                    rule_msg="out of memory", jobid=3, input=[], output=[], log=[], conda_env=None,
                    container_img=None, aux={"external_jobid": "123"}, indent=False, shellcmd="sleep 1"))
    assert out(h) == ["[0/?] FAILED x  command: sleep 1", "    message: out of memory", "    external_jobid: 123"]


def test_a_failed_group_job_is_shown_with_its_jobs_logs():
    h = handler()
    h.handle(record("Error in group g", logging.ERROR, event=LogEvent.GROUP_ERROR, groupid="g",
                    aux_logs=[], job_error_info=[{"rule_name": "eval", "jobid": 4, "output": ["o"],
                                                 "log": ["logs/eval.log"]}]))
    text = h.default.stream.getvalue()
    assert "rule eval:" in text and "logs/eval.log" in text


def default_output(records, **kw) -> str:
    """What Snakemake's own stream handler prints for these records."""
    s = settings(**kw)
    d = ColorizingTextHandler(nocolor=True, stream=io.StringIO(), formatter=DefaultFormatter(s.quiet, False),
                              filter=DefaultFilter(s.quiet, False, False, s.dryrun, s.printshellcmds))
    for r in records:
        d.handle(r)
    return d.stream.getvalue()


def test_snakemake_s_own_errors_and_warnings_pass_through_unchanged():
    records = [record("WorkflowError:\nAt least one job did not complete successfully.", logging.ERROR,
                      event=LogEvent.ERROR, exception="WorkflowError"),
               record("Exiting because a job execution failed. Look below for error messages", logging.ERROR),
               record("Some jobs were triggered by provenance information", logging.WARNING),
               record("Building DAG of jobs..."), stats(train=2, all=1)]
    h = handler()
    for r in records:
        h.handle(r)
    assert h.default.stream.getvalue() == default_output(records)
    assert "At least one job did not complete successfully." in h.default.stream.getvalue()


def test_without_quiet_rules_the_output_is_snakemake_s_own():
    """`--quiet reason` (the profiles' comment: list every job again) gives Snakemake's rule blocks."""
    records = [stats(train=1), job_info(1), finished(1, 101.0), progress(1, 1)]
    h = handler(quiet={Quietness.REASON})
    for r in records:
        h.handle(r)
    text = h.default.stream.getvalue()
    assert re.search(r"^rule train:$", text, re.M) and "Finished jobid: 1" in text
    assert re.sub(r"\[\w{3} \w{3} .*?\]", "[date]", text) == re.sub(
        r"\[\w{3} \w{3} .*?\]", "[date]", default_output(records, quiet={Quietness.REASON}))


def test_a_dry_run_lists_every_job_as_a_plan_line_and_no_summary():
    h = handler(dryrun=True, stdout=True)
    h.handle(stats(settings=1, train=1))
    h.handle(job_info(1, rule="settings", wildcards={"settings": "runs/smoke/d64/x/seed42/config.yaml"}))
    h.handle(job_info(2))
    h.handle(stats(settings=1, train=1))  # the same table after the jobs: once is enough
    h.close()
    assert out(h) == TABLE + ["[1/2] plan  settings runs/smoke/d64/x/seed42/config.yaml", f"[2/2] plan  train    {LABEL}"]


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    return copy_worktree(tmp_path_factory.mktemp("logger") / "repo")


def make_n(repo: Path, venv: Path, target="smoke") -> str:
    return subprocess.run(["make", "-n", target, f"VENV={venv}"], cwd=repo, env=pipeline_env(repo),
                          capture_output=True, text=True, check=True).stdout


def test_make_uses_the_plugin_where_the_venv_has_it_and_snakemake_s_logger_where_not(repo, tmp_path):
    venv = Path(sys.executable).parent.parent
    for target in ("smoke", "reproduce", "confirm"):
        calls = [line for line in make_n(repo, venv, target).splitlines() if "--config" in line]
        assert calls and all(" --logger loopscale " in line for line in calls), calls
    bare = tmp_path / "venv-without-the-project"  # a python that can't import the plugin
    (bare / "bin").mkdir(parents=True)
    (bare / "bin" / "python").symlink_to("/bin/false")
    calls = [line for line in make_n(repo, bare).splitlines() if "--config" in line]
    assert calls and "--logger" not in calls[0] and "--quiet rules host" in calls[0]


def test_the_slurm_profile_s_dry_run_lists_every_job(repo):
    proc = smk(repo, "--workflow-profile", "slurm", "--config", "experiment=smoke", "-n")
    total = int(re.search(r"^total\s+(\d+)$", proc.stdout, re.M).group(1))
    plans = re.findall(r"^\[\s*(\d+)/(\d+)\] plan  (\w+)", proc.stdout, re.M)
    assert len(plans) == total and {int(n) for n, _, _ in plans} == set(range(1, total + 1))
    assert {rule for _, _, rule in plans} >= {"settings", "prepare_data", "train", "eval", "report", "all"}


@pytest.mark.slow
def test_make_smoke_prints_a_line_or_two_per_job(repo):
    """`make smoke` (its set-up skipped: the venv running the tests has the pipeline): every job
    starts and is done once, named by rule and run; besides, the header (the job stats table)
    and the end (log path, elapsed time, summary) only."""
    venv = Path(sys.executable).parent.parent
    proc = subprocess.run(["make", "--no-print-directory", "-o", f"{venv}/.pipeline", "smoke", f"VENV={venv}", "CORES=2"], cwd=repo,
                          env=pipeline_env(repo), capture_output=True, text=True, timeout=900)
    lines = (proc.stdout + proc.stderr).splitlines()
    assert proc.returncode == 0, "\n".join(lines[-60:])
    total = int(next(re.match(r"total\s+(\d+)$", x).group(1) for x in lines if re.match(r"total\s+\d+$", x)))
    table = lines.index("Job stats:")
    done = [x.split(" done  ", 1)[1].rsplit("  (", 1)[0] for x in lines if " done  " in x]
    started = [x.split(" start ", 1)[1] for x in lines if " start " in x]
    assert len(done) == total == len(set(done)) and sorted(started) == sorted(done), "\n".join(lines)
    assert lines[-1] == f"{total}/{total} jobs done"
    end = next(i for i in range(table, len(lines)) if lines[i].startswith("total"))
    other = [x for x in lines[:table] + lines[end + 1:] if " done  " not in x and " start " not in x]
    assert len(other) <= 12, "\n".join(other)  # the make line, Snakemake's header, log, elapsed, summary
    assert len(lines) <= 2 * total + (end + 1 - table) + 12
