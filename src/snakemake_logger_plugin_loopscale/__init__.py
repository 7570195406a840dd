"""Snakemake's console output as one line per job (`snakemake --logger loopscale`).

Snakemake finds this logger plugin by its module name (`snakemake_logger_plugin_<name>`); it is
installed with the project. With `--quiet rules` (the Makefile and the profiles give it) a job
is a start line and a done line with a progress counter, the rule and the wildcards that name
its run, e.g.

    [ 3/14] done  train     d64 rmsnorm-per_loop-none-residual seed42  (12.3s)

a failed job is one FAILED line naming its log (followed by the log itself with
`--show-failed-logs`), a dry run lists each job as a `plan` line, and a run ends with a summary
line. Everything else (the job stats table, Snakemake's own errors and warnings) is passed to
Snakemake's default filter and formatter unchanged; without `rules` in `--quiet` the whole
output is Snakemake's default (e.g. `--quiet reason` shows every rule block again).
"""
from __future__ import annotations

import logging
import sys

from snakemake_interface_logger_plugins.base import LogHandlerBase
from snakemake_interface_logger_plugins.common import LogEvent

# the wildcard of the experiment: the same for every job of one invocation (--config experiment=)
HIDDEN_WILDCARDS = {"exp"}
# the scheduler's lines around every job; its start and end are this plugin's lines instead
SCHEDULER_NOISE = {"Select jobs to execute..."}


def describe(rule: str, wildcards: dict, width: int = 0) -> str:
    """`train     d64 rmsnorm-per_loop-none-residual seed42`: a numeric value keeps its name."""
    parts = [f"{k}{v}" if str(v).isdigit() else str(v) for k, v in (wildcards or {}).items()
             if k not in HIDDEN_WILDCARDS]
    return " ".join([rule.ljust(width)] + parts).rstrip()


class LogHandler(LogHandlerBase):
    def __post_init__(self) -> None:
        from snakemake.logging import ColorizingTextHandler, DefaultFilter, DefaultFormatter
        from snakemake.settings.enums import Quietness

        s = self.common_settings
        quiet = set(s.quiet or ())
        # everything this plugin does not rewrite goes through Snakemake's own stream handler
        self.default = ColorizingTextHandler(nocolor=s.nocolor, stream=sys.stdout if s.stdout else sys.stderr,
                                             formatter=DefaultFormatter(quiet, s.show_failed_logs),
                                             filter=DefaultFilter(quiet, s.debug_dag, s.verbose, s.dryrun,
                                                                  s.printshellcmds))
        self.compact = Quietness.RULES in quiet and Quietness.ALL not in quiet
        self.jobs: dict[int, tuple[str, float]] = {}  # jobid -> (description, start time)
        self.done = self.planned = self.total = self.width = 0
        self.failed: list[str] = []
        self.stats_table = None
        self.closed = False

    writes_to_stream = True
    writes_to_file = False
    has_filter = True
    has_formatter = True
    needs_rulegraph = False

    def line(self, record: logging.LogRecord, text: str) -> None:
        with self.default._output_lock:
            self.default.stream.write(self.default.decorate(record, text) + "\n")
            self.default.flush()

    def counter(self, n: int) -> str:
        return f"[{n:>{len(str(self.total))}}/{self.total or '?'}]"

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.rewrite(record)
        except Exception:  # a record not shaped as expected: shown as Snakemake would show it
            self.default.handle(record)

    def rewrite(self, record: logging.LogRecord) -> None:
        event = getattr(record, "event", None)
        if not self.compact:
            return self.default.handle(record)
        if event == LogEvent.RUN_INFO and isinstance(getattr(record, "stats", None), dict):
            if record.msg == self.stats_table:  # a dry run repeats the job stats table after its jobs
                return None
            self.stats_table, self.total = record.msg, record.stats.get("total", self.total)
            self.width = max((len(k) for k in record.stats if k != "total"), default=0)
        if event == LogEvent.JOB_INFO:
            what = describe(record.rule_name, record.wildcards, self.width)
            self.jobs[record.jobid] = (what, record.created)
            if self.common_settings.dryrun:
                self.planned += 1
                return self.line(record, f"{self.counter(self.planned)} plan  {what}")
            return self.line(record, f"{self.counter(self.done)} start {what}")
        if event == LogEvent.JOB_FINISHED:
            what, start = self.jobs.get(record.job_id, (f"job {record.job_id}", record.created))
            self.done += 1
            if what in self.failed:  # it failed before and a retry (--retries) succeeded
                self.failed.remove(what)
            return self.line(record, f"{self.counter(self.done)} done  {what}  ({record.created - start:.1f}s)")
        if event == LogEvent.PROGRESS:  # its total counts the whole DAG, the stats table's what runs
            self.done, self.total = record.done, max(self.total or record.total, record.done)
            return None
        if event == LogEvent.JOB_ERROR:
            return self.job_error(record)
        if event == LogEvent.GROUP_ERROR:  # Snakemake's own filter would drop it under --quiet rules
            return self.line(record, self.default.format(record))
        if event in (LogEvent.JOB_STARTED, LogEvent.SHELLCMD) or (event is None and record.msg in SCHEDULER_NOISE):
            return None
        return self.default.handle(record)

    def job_error(self, record: logging.LogRecord) -> None:
        from snakemake.logging import show_logs

        what = self.jobs.get(record.jobid, (describe(record.rule_name, {}, self.width), 0))[0]
        self.failed.append(what)
        logs = list(record.log or [])
        where = f"log: {', '.join(logs)}" if logs else f"command: {record.shellcmd or '(none)'}"
        text = [f"{self.counter(self.done)} FAILED {what}  {where}"]
        text += [f"    message: {record.rule_msg}"] if record.rule_msg else []
        text += [f"    {k}: {v}" for k, v in (record.aux or {}).items()]
        if self.common_settings.show_failed_logs and logs:
            text += list(show_logs(logs))
        self.line(record, "\n".join(text))

    def close(self) -> None:
        if not self.closed and self.compact and not self.common_settings.dryrun and (self.jobs or self.done):
            summary = f"{self.done}/{self.total} jobs done"
            if self.failed:
                summary += f", {len(self.failed)} FAILED: " + "; ".join(self.failed)
            record = logging.makeLogRecord({"levelno": logging.ERROR if self.failed else logging.INFO,
                                            "levelname": "ERROR" if self.failed else "INFO"})
            self.line(record, summary)
        self.closed = True
        super().close()
