"""Reading run directories: config, status, validation, training log and diagnostics.

Nothing here trusts the directory layout: the condition, size and seed come from the run's
own `loopscale.json` (`config.json` in runs written before it; `config.yaml` when a run crashed before writing it). A missing or
broken file never raises; it turns into a status ("failed", "missing") or an empty value.
"""
from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from ..registry import DIAGNOSTICS, Condition


# -- sizes ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Size:
    """A model size: the architecture dims shared by all conditions (the readout/recurrence
    choice adds or removes a few norm gains, which must not split a size)."""
    d_model: int
    n_layers: int
    n_loops: int
    n_heads: int = 0
    d_ff: int = 0
    vocab_size: int = 0
    seq_len: int = 0

    @property
    def params(self) -> int:
        """Parameter count of this size with the RMSNorm readout and residual recurrence."""
        return _params_of(self)

    @property
    def label(self) -> str:
        p = self.params
        head = f"{_fmt_params(p)} " if p else ""
        return f"{head}(d{self.d_model}, {self.n_layers}L, K={self.n_loops})"

    def sort_key(self) -> tuple:
        return (self.params, self.d_model, self.n_layers, self.n_loops, self.n_heads, self.d_ff, self.vocab_size,
                self.seq_len)


@functools.cache
def _params_of(size: "Size") -> int:
    try:
        from ..config import ModelConfig
        from ..model import count_params
        return count_params(ModelConfig(
            vocab_size=size.vocab_size, d_model=size.d_model, n_layers=size.n_layers, n_heads=size.n_heads,
            d_ff=size.d_ff, seq_len=size.seq_len, n_loops=size.n_loops))
    except Exception:
        return 0


def _fmt_params(n: int) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.1f}B"
    if n >= 9.5e6:
        return f"{n / 1e6:.0f}M"
    if n >= 1e6:
        return f"{n / 1e6:.1f}M"
    return f"{n / 1e3:.0f}k"


# -- one run ----------------------------------------------------------------------------
@dataclass
class Run:
    path: Path
    config: dict  # the resolved RunConfig dict ({} if unreadable)
    env: dict
    data: dict
    summary: dict  # {} if missing
    status: str  # completed | diverged | failed
    note: str  # human-readable status: "completed", "diverged at step 412", "failed: ..."
    metrics: list = field(default_factory=list)  # training log records
    evals: dict = field(default_factory=dict)  # diag name -> payload (only files that parsed)
    problems: list = field(default_factory=list)  # files whose values are unusable: "FILE: why"

    # convenience accessors ---------------------------------------------------------------
    def cfg(self, section: str, key: str, default=None):
        return (self.config.get(section) or {}).get(key, default)

    @property
    def condition(self) -> Condition:
        return Condition.from_config(self.config)

    @property
    def seed(self) -> Optional[int]:
        return self.cfg("train", "seed")

    @property
    def size(self) -> Size:
        m = self.config.get("model") or {}

        def i(key):
            v = m.get(key)
            return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0
        return Size(i("d_model"), i("n_layers"), i("n_loops"), i("n_heads"), i("d_ff"), i("vocab_size"),
                    i("seq_len"))

    @property
    def completed(self) -> bool:
        return self.status == "completed"

    def seed_key(self) -> tuple:
        """Orders runs by seed (none first), then path."""
        return (self.seed if self.seed is not None else -1, str(self.path))

    def diag(self, name: str) -> Optional[dict]:
        """The payload of eval/<name>.json if it exists, parsed and has status ok."""
        d = self.evals.get(name)
        return d if isinstance(d, dict) and d.get("status", "ok") == "ok" else None

    def diag_status(self, name: str) -> str:
        d = self.evals.get(name)
        if d is None:
            return "missing"
        return str(d.get("status", "ok")) if isinstance(d, dict) else "unreadable"


def _read_json(path: Path) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _read_jsonl(path: Path) -> list:
    out = []
    try:
        with open(path, "rb") as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                try:
                    out.append(json.loads(line.decode("utf-8")))
                except ValueError:  # a line torn by a crash, or not UTF-8: skipped, not fatal
                    continue
    except OSError:
        pass
    return out


# -- the values the tables read: a mistyped one marks its file, never crashes the grid ------
_NON_NEGATIVE = {"norm", "scale", "tokens_per_s", "radial_fraction", "mean", "median", "p99", "max", "std", "min",
                 "p99_over_median", "mean_loops", "speedup"}
_PPL_LIKE = {"ppl", "ppl_full", "ppl_ratio", "rel_ppl"}  # >= 0, +inf allowed (an overflowing exp(CE))
_REAL = {"ce", "delta_ce", "mean_cos"}


def _bad_number(key: str, v) -> Optional[str]:
    """Why the value `v` of a metric `key` cannot be a result, completing 'KEY is ...' (None
    when it can be one, is absent, or `key` is not a metric)."""
    if v is None:
        return None
    if key == "k":
        return None if isinstance(v, int) and not isinstance(v, bool) and v >= 1 else f"{v!r}, not a loop index >= 1"
    if key not in _METRICS:
        return None
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return f"{v!r}, not a number"
    if math.isnan(v):
        return "NaN"
    if math.isinf(v) and not (key in _PPL_LIKE and v > 0):
        return str(v)
    if key not in _REAL and v < 0:
        return f"negative ({v:g})"
    return None


_METRICS = _NON_NEGATIVE | _PPL_LIKE | _REAL


def malformed(payload: Any, where: str = "") -> Optional[str]:
    """The first metric of a result payload that is mistyped, NaN or out of range, as
    'WHERE is WHY' (None when every metric the tables read is a valid number or absent)."""
    if isinstance(payload, list):
        for i, v in enumerate(payload):
            why = malformed(v, f"{where}[{i}]")
            if why:
                return why
        return None
    if not isinstance(payload, dict):
        return None
    for k, v in payload.items():
        at = f"{where}.{k}" if where else str(k)
        if isinstance(v, (dict, list)):
            why = f"{at} is a {type(v).__name__}, not a number" if str(k) in _METRICS | {"k"} else malformed(v, at)
        else:
            why = _bad_number(str(k), v)
            why = why and f"{at} is {why}"
        if why:
            return why
    return None


def _check_summary(summary: dict) -> Optional[str]:
    """Why summary.json's final validation cannot be used (None when it can)."""
    val = summary.get("validation")
    if val is None:
        return None
    if not isinstance(val, dict):
        return "validation is not a mapping"
    for key, kind in (("val_ce", "ce"), ("val_norm", "norm")):
        v = val.get(key)
        if v is None and key == "val_norm":
            continue
        if not isinstance(v, list):
            return f"validation.{key} is {v!r}, not a list"
        for i, x in enumerate(v):
            why = _bad_number(kind, x)
            if why:
                return f"validation.{key}[{i}] is {why}"
    return None


def load_run(path: str | os.PathLike) -> Run:
    """Read one run directory; never raises for missing or broken files."""
    path = Path(path)
    cj = _read_json(path / "loopscale.json")  # the run record (config.json before that layout)
    if not (isinstance(cj, dict) and isinstance(cj.get("config"), dict)):
        cj = _read_json(path / "config.json")
    config, env, data = {}, {}, {}
    if isinstance(cj, dict) and isinstance(cj.get("config"), dict):
        config, env, data = cj["config"], cj.get("env") or {}, cj.get("data") or {}
    else:
        try:
            with open(path / "config.yaml") as f:
                y = yaml.safe_load(f)
            if isinstance(y, dict):
                config = y.get("config", y) if isinstance(y.get("config"), dict) else y
        except (OSError, yaml.YAMLError):
            pass
    summary = _read_json(path / "summary.json")
    summary = summary if isinstance(summary, dict) else {}
    status = summary.get("status")
    if not summary:
        status, note = "failed", "failed: no summary.json (crashed or never finished)"
    elif status == "completed":
        note = "completed"
    elif status == "diverged":
        at = summary.get("diverged_at_step")
        note = f"diverged at step {at}" if at is not None else "diverged"
    else:
        status = "failed"
        err = summary.get("error")
        note = f"failed: {str(err).splitlines()[0][:120]}" if err else "failed"
    if not config:
        note += " (no readable config)"
    records = _read_jsonl(path / "metrics.jsonl")
    metrics = [r for r in records if isinstance(r, dict) and r.get("split") is None and "norm" in r]
    problems: list = []
    bad_summary = _check_summary(summary) if status == "completed" else None
    if bad_summary:  # its values are not used; the run says why
        summary = {k: v for k, v in summary.items() if k != "validation"}
        problems.append(f"summary.json malformed: {bad_summary}")
    evals = {}
    for name, diag in DIAGNOSTICS.items():
        p = path / diag.file
        if p.exists():
            d = _read_json(p)
            why = malformed(d) if isinstance(d, dict) and d.get("status", "ok") == "ok" else None
            if not isinstance(d, dict):
                evals[name] = {"status": "unreadable"}
                problems.append(f"{diag.file} unreadable: {'empty' if _empty(p) else 'not a JSON object'}")
            elif why:
                evals[name] = {"status": "malformed"}
                problems.append(f"{diag.file} malformed: {why}")
            else:
                evals[name] = d
    note += "".join(f" ({p})" for p in problems)
    return Run(path=path, config=config, env=env, data=data, summary=summary, status=status, note=note,
               metrics=metrics, evals=evals, problems=problems)


def _empty(p: Path) -> bool:
    try:
        return p.stat().st_size == 0
    except OSError:
        return False


def load_runs(paths) -> list[Run]:
    """Load run directories, sorted by size, condition and seed (order of `paths` is irrelevant)."""
    return sorted(map(load_run, paths), key=lambda r: (r.size.sort_key(), r.condition.sort_key(), *r.seed_key()))


# -- which runs may be averaged ---------------------------------------------------------
_SEED_FREE = ("seed",)  # with config.RESULT_FREE: what may differ between seeds of one experiment


RUN_FILES = ("loopscale.json", "config.json", "config.yaml", "summary.json", "metrics.jsonl")


def find_run_dirs(paths: list[str]) -> list[Path]:
    """Run directories among `paths`: a path holding a run file is a run; any other
    directory is searched recursively for runs (so `--runs runs/cpu` works). Sorted, unique."""
    found: set[Path] = set()
    for p in map(Path, paths):
        if not p.exists():
            raise FileNotFoundError(f"run directory {p} does not exist")
        if any((p / f).exists() for f in RUN_FILES):
            found.add(p)
            continue
        for f in sorted(p.rglob("*")):
            if f.name in RUN_FILES and f.is_file() and "eval" not in f.parent.name:
                found.add(f.parent)
    if not found:
        raise FileNotFoundError(f"no run directories (holding {' or '.join(RUN_FILES)}) under {' '.join(paths)}")
    return sorted(found)


def load_run_dirs(paths: list[str]) -> list[Run]:
    """The runs found under `paths` (find_run_dirs), loaded and checked: never copies of one
    run, nor runs of two experiments, to be averaged together."""
    runs = load_runs(find_run_dirs(paths))
    check_runs(runs)
    return runs


def experiment_key(config: dict) -> str:
    """The run's config without its seed and the settings results do not depend on
    (config.RESULT_FREE; the evaluation settings): equal for the seeds of one experiment."""
    from ..config import RESULT_FREE, RunConfig
    try:  # settings added since a run was trained take their defaults, as when it trained
        d = RunConfig.from_checkpoint(config).to_dict()
    except Exception:  # not a valid config: compared as written
        d = json.loads(json.dumps(config, default=str))
    d.pop("eval", None)
    train = d.get("train") if isinstance(d.get("train"), dict) else {}
    for k in (*RESULT_FREE, *_SEED_FREE):
        train.pop(k, None)
    return json.dumps(d, sort_keys=True)


def _first_difference(a: dict, b: dict, where: str = "") -> str:
    """The first setting (dotted) where two config dicts differ, with both values."""
    for k in sorted(set(a) | set(b), key=str):
        va, vb = a.get(k), b.get(k)
        if va == vb:
            continue
        if isinstance(va, dict) and isinstance(vb, dict):
            return _first_difference(va, vb, f"{where}{k}.")
        return f"{where}{k} {va!r} vs {vb!r}"
    return "?"


def check_runs(runs: list[Run]) -> None:
    """Refuse, in one ConfigError naming both runs, what must never be averaged: two runs of one
    (size, condition, seed) (copies of one run would count as two seeds, ± 0), or runs in one
    table row that are not seeds of one experiment (e.g. 20 and 1,500 steps). Runs without a
    readable config are not checked (they are listed, never averaged)."""
    from ..config import ConfigError
    seen: dict = {}
    groups: dict = {}
    for r in runs:
        if not r.config:
            continue
        row = f"{r.condition.label} [{r.size.label}]"
        key = (r.size, r.condition, str(r.seed))
        if key in seen:
            raise ConfigError(f"runs {seen[key].path} and {r.path} are both {row} seed {r.seed}: two copies of "
                              f"one run would be averaged as two seeds; give the report only one of them")
        seen[key] = r
        first = groups.setdefault((r.size, r.condition), r)
        a, b = experiment_key(first.config), experiment_key(r.config)
        if a != b:
            diff = _first_difference(json.loads(a), json.loads(b))
            raise ConfigError(f"runs {first.path} and {r.path} ({row}) are not seeds of one experiment "
                              f"({diff}); report each experiment's runs separately")


def finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
