"""Helpers for the Snakemake pipeline (Snakefile, workflow/rules/*.smk).

Validates params.yaml (its schema, then every run's RunConfig and EvalConfig; each problem is one
`ParamsError` line naming the params key), expands experiments into runs (sizes x conditions x
seeds), gives the text of each settings file (`settings_files`) and lists the code each stage
runs (`stage_code`). docs/pipeline.md ("The pipeline module") describes the files it writes.
Imports only `loopscale.config` and `loopscale.registry` (no torch), so the DAG builds fast.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional

import yaml

from . import registry
from .config import (EVAL_PRESETS, LIMITS, MODEL_PRESETS, ConfigError, EvalConfig, RunConfig, did_you_mean,
                     fineweb_defaults, merge, read_yaml, setting_error)
from .io import atomic_write_text
from .registry import AXES, AXIS_DEFAULTS, Condition, axis_values

DIAGNOSTICS = tuple(registry.DIAGNOSTICS)
AXIS_KEYS = {"readout": ("model", "readout"), "loss": ("objective", "loss"),
             "regularizer": ("objective", "regularizer"), "recurrence": ("model", "recurrence")}
NAME_RE = r"[A-Za-z0-9][A-Za-z0-9_.-]*"  # experiment, size and condition-set names (path components), full match

# wildcard constraints for the rules: tight, so odd values never reach a shell
WILDCARDS = {
    "exp": NAME_RE,
    "size": NAME_RE,
    "cond": "-".join("(?:" + "|".join(axis_values(a)) + ")" for a in AXES),
    "seed": r"[0-9]+",
    "diag": "|".join(DIAGNOSTICS),
}


# libyaml when available: the same text as the pure-Python dumper, ~10x faster (the
# paper grid writes 108 config files on every Snakemake start)
_Dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _dump(d: dict) -> str:
    return yaml.dump(d, Dumper=_Dumper, sort_keys=False)


class ParamsError(ValueError):
    """A bad params.yaml. The message is one line and names the offending key."""


# ---------------------------------------------------------------------------
# data model
# ---------------------------------------------------------------------------
@dataclass(frozen=True)
class ConditionSpec:
    """A condition as params.yaml defines it: the condition, its nested run overrides and the
    params key that defined it."""
    condition: Condition
    overrides: str = "{}"  # JSON of the nested overrides (hashable)
    where: str = ""

    @property
    def id(self) -> str:
        return self.condition.id


@dataclass
class PlannedRun:
    """One run of an experiment: where it lives and the settings it is trained and evaluated with."""
    experiment: str
    size: str
    condition: Condition
    seed: int
    config: RunConfig
    eval: EvalConfig
    stream: Optional[dict] = None  # StreamConfig of a streamed (data.source=fineweb) run: RUN/stream.yaml

    @property
    def dir(self) -> str:
        return f"runs/{self.experiment}/{self.size}/{self.condition.id}/seed{self.seed}"


@dataclass
class Experiment:
    name: str
    runs: list[PlannedRun]
    data: dict  # resolved DataConfig as a dict
    diagnostics: tuple[str, ...]
    gpu: int = 0  # GPUs of each evaluation job (and of training, when gpus_per_run is 1)
    gpus_per_run: int = 1  # training ranks of one run (torchrun when > 1)
    nodes_per_run: int = 1  # nodes those ranks span (SLURM; srun starts one torchrun per node)
    description: str = ""
    index: dict = field(default_factory=dict)  # (size, cond, seed) -> PlannedRun
    downstream: Optional[dict] = None  # the experiment's `downstream:` (multiple choice through lm-eval)
    claims: dict = field(default_factory=dict)  # the experiment's `claims:` {family, preregistered} (report stage)

    @property
    def claims_family(self) -> str:
        return str(self.claims.get("family", "paper"))

    @property
    def preregistered(self) -> str:
        return str(self.claims.get("preregistered", "") or "")

    @property
    def streamed(self) -> bool:
        """Training streams the corpus (data.source=fineweb: `loopscale train-stream`)."""
        return self.data.get("source") == "fineweb"

    @property
    def ouro(self) -> bool:
        """Every run is the Ouro architecture: Appendix B's evaluations and tables."""
        return bool(self.runs) and all(r.config.model.arch == "ouro" for r in self.runs)

    @property
    def depth_corpora(self) -> dict[str, str]:
        """{corpus name: prepared data directory} of the variable-depth evaluation (ouro-depth):
        the held-out FineWeb documents and data.eval_corpus for a streamed experiment, else the
        experiment's corpus."""
        if not self.streamed:
            return {self.data["source"]: self.data_dir}
        out = {"fineweb": self.data_dir}
        if self.data.get("eval_corpus"):
            out[self.data["eval_corpus"]] = f"{self.data_dir}/{self.data['eval_corpus']}"
        return out

    def run(self, size: str, cond: str, seed) -> PlannedRun:
        try:
            return self.index[(size, cond, int(seed))]
        except (KeyError, ValueError):
            raise KeyError(f"no run {size}/{cond}/seed{seed} in experiment {self.name!r}") from None

    @property
    def data_dir(self) -> str:
        return f"data/{self.name}"

    @property
    def train_resources(self) -> dict:
        """Snakemake resources of one training job. One node: `gpu` (sbatch --gpus); several:
        `nodes`, one task per node (`tasks`, `mpi`: the job's shell runs srun itself) and
        `gres` GPUs per node. On a CPU experiment (gpu 0) the ranks run on CPU."""
        gpus = self.gpus_per_run if self.gpu else 0
        if self.nodes_per_run == 1:
            return {"gpu": gpus}
        res = {"nodes": self.nodes_per_run, "tasks": self.nodes_per_run, "mpi": "srun"}
        if gpus:
            res["gres"] = f"gpu:{gpus // self.nodes_per_run}"
        return res

    @property
    def train_launcher(self) -> str:
        """The command that starts `loopscale train` with its arguments appended: the plain
        CLI, torchrun on one node, or srun + torchrun with a c10d rendezvous on the first
        node of the SLURM allocation."""
        command = "train-stream" if self.streamed else "train"
        if self.gpus_per_run == 1:
            return f"loopscale {command}"
        per_node = self.gpus_per_run // self.nodes_per_run
        if self.nodes_per_run == 1:
            return f"torchrun --standalone --nproc-per-node {per_node} -m loopscale.cli {command}"
        return ('srun --ntasks-per-node=1 torchrun --nnodes "$SLURM_NNODES" '
                f'--nproc-per-node {per_node} --rdzv-backend c10d --rdzv-id "$SLURM_JOB_ID" '
                '--rdzv-endpoint "$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1):29500" '
                f'-m loopscale.cli {command}')


# ---------------------------------------------------------------------------
# loading and schema validation
# ---------------------------------------------------------------------------
def load_params(path: str | os.PathLike) -> dict:
    try:
        params = read_yaml(path)
    except ConfigError as e:
        raise ParamsError(str(e)) from None
    if not isinstance(params, dict):
        raise ParamsError(f"{path}: must hold a mapping at top level")
    return params


def load_schema(path: str | os.PathLike) -> dict:
    """The params.yaml schema (workflow/schemas/params.schema.yaml) as a mapping."""
    with open(path) as f:
        return yaml.load(f, Loader=_Loader)


def _key(path: Iterable) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "(top level)"


def check_schema(params: dict, schema: str | os.PathLike | dict, source: str = "params.yaml") -> None:
    """Validate `params` against the JSON schema with `snakemake.utils.validate` (as the
    Snakemake workflow template does; `schema` is its path, or the schema itself); a failure
    is a one-line ParamsError naming the key."""
    import jsonschema
    from snakemake.exceptions import WorkflowError
    from snakemake.utils import validate

    try:
        if isinstance(schema, dict):
            jsonschema.Draft202012Validator(schema).validate(params)
        else:
            validate(params, os.fspath(schema), set_default=False)
        return
    except jsonschema.ValidationError as e:
        err = e
    except WorkflowError as e:  # validate's, raised while handling the ValidationError
        err = e.__context__
        if not isinstance(err, jsonschema.ValidationError):
            raise ParamsError(f"{source}: {e}".splitlines()[0]) from None
    raise ParamsError(f"{source}: {_schema_error(err)}")


def _schema_error(err) -> str:
    """One line for a jsonschema ValidationError: the key it is about, then the problem."""
    import jsonschema

    while err.context:  # into if/then/else and anyOf branches, to the most specific error
        err = jsonschema.exceptions.best_match(err.context)
    path = list(err.absolute_path)
    said = setting_error(str(path[-2]), str(path[-1]), err.instance) if len(path) > 1 else None
    if said:  # a run setting: the config's own words, after the params key of its section
        return f"{_key(path[:-1])}: {said}"
    if err.validator == "additionalProperties":
        extra = sorted(set(err.instance) - set(err.schema.get("properties", {})))
        hint = did_you_mean(extra[0], err.schema.get("properties", {}), _key(path))
        return f"unknown key {_key(path + extra[:1])!r}{hint}"
    if err.validator == "required":
        missing = [k for k in err.validator_value if k not in err.instance]
        return f"{_key(path + missing[:1])}: required key is missing"
    if err.validator == "enum":
        return _unknown(_key(path), err.instance, err.validator_value)
    return f"{_key(path)}: {err.message.splitlines()[0]}"


def _unknown(key: str, value: Any, choices: Iterable) -> str:
    return f"{key}: unknown value {value!r}; choose one of {', '.join(map(str, choices))}"


# ---------------------------------------------------------------------------
# conditions
# ---------------------------------------------------------------------------
def _condition(item: dict, where: str) -> ConditionSpec:
    axes = {a: item.get(a, AXIS_DEFAULTS.get(a)) for a in AXES}
    for a in AXES:
        if axes[a] is None:
            raise ParamsError(f"{where}.{a}: required key is missing")
        if axes[a] not in axis_values(a):
            raise ParamsError(_unknown(f"{where}.{a}", axes[a], axis_values(a)))
    overrides = item.get("overrides") or {}
    for a, v in _axis_settings(overrides).items():
        if v != axes[a]:
            sec, name = AXIS_KEYS[a]
            raise ParamsError(f"{where}.overrides.{sec}.{name}: {v!r} contradicts the condition's "
                              f"{a} {axes[a]!r} (its run directory names the axes); set {a} instead")
    return ConditionSpec(Condition.of(**axes), overrides=json.dumps(overrides, sort_keys=True), where=where)


def _axis_settings(overrides: Any) -> dict:
    """The condition axes an overrides mapping sets: {axis: value}."""
    out = {}
    for a, (sec, name) in AXIS_KEYS.items():
        section = overrides.get(sec) if isinstance(overrides, dict) else None
        if isinstance(section, dict) and name in section:
            out[a] = section[name]
    return out


def expand_conditions(spec: Any, sets: dict, where: str, _stack: tuple = ()) -> list[ConditionSpec]:
    """A condition spec -> list of conditions (order kept, exact duplicates dropped).

    spec: a condition-set name | a condition {readout, loss, regularizer?, recurrence?,
    overrides?} | a grid {grid: {axis: [values]}, overrides?} | a list of those."""
    out: list[ConditionSpec] = []
    if isinstance(spec, str):
        if spec not in sets:
            choices = ", ".join(sets) or "(none defined)"
            raise ParamsError(f"{where}: unknown condition set {spec!r}; define it under condition_sets "
                              f"(defined: {choices})")
        if spec in _stack:
            raise ParamsError(f"{where}: condition set {spec!r} includes itself")
        out = expand_conditions(sets[spec], sets, f"condition_sets.{spec}", _stack + (spec,))
    elif isinstance(spec, list):
        for i, item in enumerate(spec):
            out += expand_conditions(item, sets, f"{where}[{i}]", _stack)
    elif isinstance(spec, dict) and "grid" in spec:
        grid = spec["grid"]
        values = []
        for a in AXES:
            vs = grid.get(a, [AXIS_DEFAULTS[a]] if a in AXIS_DEFAULTS else None)
            if vs is None:
                raise ParamsError(f"{where}.grid.{a}: required key is missing")
            for i, v in enumerate(vs):
                if v not in axis_values(a):
                    raise ParamsError(_unknown(f"{where}.grid.{a}[{i}]", v, axis_values(a)))
            values.append(vs)
        for combo in itertools.product(*values):
            out.append(_condition({**dict(zip(AXES, combo)), "overrides": spec.get("overrides")},
                                  f"{where}.grid"))
    elif isinstance(spec, dict):
        out.append(_condition(spec, where))
    else:
        raise ParamsError(f"{where}: a condition must be a set name, a mapping or a list, got {spec!r}")
    return _dedupe(out)


def _dedupe(conds: list[ConditionSpec]) -> list[ConditionSpec]:
    seen: dict[str, ConditionSpec] = {}
    for c in conds:
        prev = seen.setdefault(c.id, c)
        if prev.overrides != c.overrides:
            raise ParamsError(f"{c.where}: condition {c.id} is also defined at {prev.where} "
                              f"with different overrides")
    return list(seen.values())


# ---------------------------------------------------------------------------
# run configs
# ---------------------------------------------------------------------------
Layer = tuple[str, str, dict]  # (params key that set it, the config section it patches or "", patch)


def _split_eval(overrides: Optional[dict]) -> tuple[dict, dict]:
    """Nested run overrides -> (training part, `eval` part)."""
    d = dict(overrides or {})
    return d, d.pop("eval", None) or {}


def _merge_layers(base: dict, layers: list[Layer]) -> dict:
    """Merge the layers in order; an unknown key is named by its full params key."""
    for where, section, patch in layers:
        if not patch:
            continue
        try:
            if section:
                base = {**base, section: merge(base[section], patch, where)}
            else:
                base = merge(base, patch, where)
        except ConfigError as e:
            raise ParamsError(str(e)) from None
    return base


def _build(cls, base: dict, layers: list[Layer], what: str):
    """Merge once, validate once. When validation fails, the first layer whose addition
    breaks it is named (`<params key>: <problem>`)."""
    try:
        return cls.from_dict(_merge_layers(base, layers))
    except ConfigError as e:
        error = e
    for n in range(1, len(layers) + 1):
        try:
            cls.from_dict(_merge_layers(base, layers[:n]))
        except ConfigError as e:
            raise ParamsError(f"{layers[n - 1][0]}: {e}") from None
    raise ParamsError(f"{what}: {error}") from None


def build_experiment(params: dict, name: str) -> Experiment:
    sets = params.get("condition_sets") or {}
    exp = params["experiments"][name]
    where = f"experiments.{name}"
    conditions = expand_conditions(exp["conditions"], sets, f"{where}.conditions")
    if not conditions:
        raise ParamsError(f"{where}.conditions: no conditions")
    seeds = list(exp["seeds"])
    diagnostics = tuple(exp.get("diagnostics", params.get("diagnostics", DIAGNOSTICS)))
    for i, d in enumerate(diagnostics):
        if d not in DIAGNOSTICS:
            key = f"{where}.diagnostics" if "diagnostics" in exp else "diagnostics"
            raise ParamsError(_unknown(f"{key}[{i}]", d, DIAGNOSTICS))
    gpus_per_run, nodes_per_run = int(exp.get("gpus_per_run", 1)), int(exp.get("nodes_per_run", 1))
    if gpus_per_run % nodes_per_run:
        raise ParamsError(f"{where}.gpus_per_run: {gpus_per_run} ranks do not split evenly over "
                          f"nodes_per_run {nodes_per_run}")
    runs, data, data_from = [], None, None
    for size, spec in exp["sizes"].items():
        swhere = f"{where}.sizes.{size}"
        preset = spec["preset"]
        if preset not in MODEL_PRESETS:
            raise ParamsError(_unknown(f"{swhere}.preset", preset, MODEL_PRESETS))
        for a in _axis_settings(spec.get("overrides")):
            sec, name = AXIS_KEYS[a]
            raise ParamsError(f"{swhere}.overrides.{sec}.{name}: the conditions set the {a}; "
                              f"a size's overrides cannot (it would be overwritten)")
        size_train, size_eval = _split_eval(spec.get("overrides"))
        size_layers = [(f"{swhere}.preset", "", MODEL_PRESETS[preset]), (f"{where}.data", "data", exp.get("data")),
                       (f"{where}.train", "train", exp.get("train")), (f"{swhere}.overrides", "", size_train)]
        size_data = _merge_layers(RunConfig().to_dict(), size_layers)["data"]
        if data is None:
            data, data_from = size_data, swhere
        elif size_data != data:
            raise ParamsError(f"{swhere}: its data settings differ from those of {data_from}; an experiment "
                              f"prepares one corpus: set them in {where}.data")
        size_conditions = conditions
        if "conditions" in spec:  # a size may run its own conditions (and seeds)
            size_conditions = expand_conditions(spec["conditions"], sets, f"{swhere}.conditions")
            if not size_conditions:
                raise ParamsError(f"{swhere}.conditions: no conditions")
        size_seeds = list(spec.get("seeds", seeds))
        planned = len(runs) + len(size_conditions) * len(size_seeds)
        if planned > LIMITS["grid_runs"]:  # before any run is built (and before Snakemake writes a run directory)
            raise ParamsError(f"{where}: {planned:,} runs (sizes x conditions x seeds) or more, beyond the "
                              f"{LIMITS['grid_runs']:,} one experiment may plan (config.LIMITS['grid_runs']); "
                              f"split it into several experiments")
        for cs in size_conditions:
            c = cs.condition
            cond_train, cond_eval = _split_eval(json.loads(cs.overrides))
            if "data" in cond_train:
                raise ParamsError(f"{cs.where}.overrides.data: an experiment prepares one corpus: set data "
                                  f"settings in {where}.data")
            ev = _build(EvalConfig, EvalConfig().to_dict(), [
                (f"{swhere}.preset", "", EVAL_PRESETS[preset]), (f"{where}.eval", "", exp.get("eval")),
                (f"{swhere}.overrides.eval", "", size_eval), (f"{cs.where}.overrides.eval", "", cond_eval)],
                f"{swhere} x {c.id}")
            axes: dict = {}
            for a, (sec, key) in AXIS_KEYS.items():
                axes.setdefault(sec, {})[key] = getattr(c, a)
            for seed in size_seeds:
                rc = _build(RunConfig, RunConfig().to_dict(), size_layers + [
                    (cs.where, "", axes), (f"{cs.where}.overrides", "", cond_train),
                    (f"{where}.seeds", "train", {"seed": seed})], f"{swhere} x {c.id} x seed {seed}")
                if rc.train.batch_size % (gpus_per_run * rc.train.grad_accum):
                    raise ParamsError(f"{where}.gpus_per_run: train.batch_size {rc.train.batch_size} of {swhere} "
                                      f"(the global batch) is not divisible by gpus_per_run x train.grad_accum "
                                      f"({gpus_per_run} x {rc.train.grad_accum})")
                stream = (_stream_settings(rc, exp.get("stream"), f"{where}.stream")
                          if rc.data.source == "fineweb" else None)
                runs.append(PlannedRun(name, size, Condition.from_config(rc.to_dict()), int(seed), rc, ev, stream))
    if exp.get("stream") is not None and (data or {}).get("source") != "fineweb":
        raise ParamsError(f"{where}.stream: the streaming recipe needs data.source=fineweb")
    downstream = _downstream(exp.get("downstream"), f"{where}.downstream")
    e = Experiment(name=name, runs=runs, data=data, diagnostics=diagnostics, gpu=int(exp.get("gpu", 0)),
                   gpus_per_run=gpus_per_run, nodes_per_run=nodes_per_run, description=exp.get("description", ""),
                   claims=dict(exp.get("claims") or {}), downstream=downstream)
    if downstream is not None and not e.ouro:
        raise ParamsError(f"{where}.downstream: Appendix B's downstream evaluation runs on Ouro experiments "
                          f"(model.arch ouro)")
    e.index = {(r.size, r.condition.id, r.seed): r for r in runs}
    return e


def _stream_settings(rc: RunConfig, recipe: Optional[dict], where: str) -> dict:
    """A streamed run's StreamConfig dict (loopscale.fineweb.stream_settings), one-line errors."""
    from .fineweb import stream_settings
    try:
        return stream_settings(rc.data.__dict__, recipe, rc.train.seed)
    except ConfigError as e:
        raise ParamsError(f"{where}: {e}") from None


DOWNSTREAM_DEFAULTS = {"tasks": None, "loops": [], "limit": 0, "include_path": None, "per_token_norm": False,
                       "batch_size": 8}


def _downstream(spec: Optional[dict], where: str) -> Optional[dict]:
    """The `downstream:` block with its defaults (the schema has checked the types)."""
    if spec is None:
        return None
    d = {**DOWNSTREAM_DEFAULTS, **spec}
    for t in d["tasks"]:
        if not re.fullmatch(NAME_RE, t):
            raise ParamsError(f"{where}.tasks: task name {t!r} must match {NAME_RE}")
    if d["include_path"] is not None and not str(d["include_path"]).strip():
        raise ParamsError(f"{where}.include_path: must be a folder of lm-eval task YAML files")
    return d


def _check_names(params: dict, source: str) -> None:
    """Names that become path components and shell words match NAME_RE in full (the schema
    says so too; this does not depend on how a regex engine treats a trailing newline)."""
    named = [("experiments", params["experiments"]), ("condition_sets", params.get("condition_sets") or {})]
    named += [(f"experiments.{e}.sizes", x.get("sizes") or {}) for e, x in params["experiments"].items()]
    for where, names in named:
        for name in names:
            if not re.fullmatch(NAME_RE, str(name)):
                raise ParamsError(f"{source}: {where}: name {name!r} must match {NAME_RE}")


# keys of the experiment-settings file (exp.yaml) and where each goes: run overrides of
# every size (they win over the preset and the experiment's own train/eval), or the
# experiment's data settings and seed list
SETTINGS_RUN_KEYS = ("model", "objective", "train", "eval")
SETTINGS_EXP_KEYS = ("data", "seeds")


def _deep_merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def apply_settings(params: dict, settings: Any, source: str) -> dict:
    """Layer an experiment-settings file over params.yaml: {experiment: {model|objective|train|
    eval: {...}, data: {...}, seeds: [...]}}. This is the small flat surface `dvc exp run -S
    exp.yaml:smoke_dvc.train.max_steps=40` edits, so that the commented params.yaml is never
    rewritten; every value is then validated with params.yaml's own checks."""
    if settings is None:
        return params
    if not isinstance(settings, dict):
        raise ParamsError(f"{source}: must hold a mapping {{experiment: settings}} at top level")
    exps = params.get("experiments")
    for name, block in settings.items():
        if not isinstance(exps, dict) or name not in exps:
            raise ParamsError(f"{source}: {name}: no experiment of that name in params.yaml")
        if block is None:
            continue
        if not isinstance(block, dict):
            raise ParamsError(f"{source}: {name}: must be a mapping of settings")
        bad = sorted(set(block) - set(SETTINGS_RUN_KEYS) - set(SETTINGS_EXP_KEYS))
        if bad:
            raise ParamsError(f"{source}: {name}.{bad[0]}: unknown key; choose one of "
                              f"{', '.join(SETTINGS_RUN_KEYS + SETTINGS_EXP_KEYS)}")
        exp = dict(exps[name])
        if block.get("seeds") is not None:
            exp["seeds"] = block["seeds"]
        if isinstance(block.get("data"), dict):
            exp["data"] = _deep_merge(exp.get("data") or {}, block["data"])
        run = {k: block[k] for k in SETTINGS_RUN_KEYS if block.get(k) is not None}
        if run and isinstance(exp.get("sizes"), dict):
            exp["sizes"] = {size: ({**spec, "overrides": _deep_merge(spec.get("overrides") or {}, run)}
                                   if isinstance(spec, dict) else spec) for size, spec in exp["sizes"].items()}
        exps[name] = exp
    return params


def load_and_validate(params_path: str | os.PathLike, schema_path: str | os.PathLike,
                      overrides: Optional[dict] = None,
                      settings_path: Optional[str | os.PathLike] = None) -> tuple[dict, dict[str, Experiment]]:
    """Read params.yaml (+ the experiment-settings file `settings_path`, see apply_settings,
    + `overrides`, e.g. Snakemake's --config), validate everything and build every
    experiment. Returns (params, {name: Experiment})."""
    params = load_params(params_path)
    source = str(params_path)
    touched: set = set()  # experiments the settings file changed: their errors name it too
    if settings_path:
        try:
            settings = read_yaml(settings_path)
        except ConfigError as e:
            raise ParamsError(str(e)) from None
        params = apply_settings(params, settings, str(settings_path))
        touched = {n for n, b in settings.items() if b} if isinstance(settings, dict) else set()
    layered = f"{params_path} with {settings_path}" if touched else source
    params.update(overrides or {})
    check_schema(params, schema_path, layered)
    _check_names(params, source)
    if params["experiment"] not in params["experiments"]:
        raise ParamsError(f"{source}: experiment: unknown experiment {params['experiment']!r}; "
                          f"choose one of {', '.join(params['experiments'])}")
    experiments = {}
    for name in params["experiments"]:
        try:
            experiments[name] = build_experiment(params, name)
        except ParamsError as e:
            raise ParamsError(f"{layered if name in touched else source}: {e}") from None
    return params, experiments


# ---------------------------------------------------------------------------
# settings files (workflow/rules/settings.smk writes them, one job each)
# ---------------------------------------------------------------------------
def write_if_changed(path: str | os.PathLike, text: str) -> bool:
    """Write `text` to `path` atomically unless it already holds exactly that text.

    Returns True when the file was (re)written. An unchanged file keeps its mtime."""
    path = Path(path)
    try:
        if path.read_text() == text:
            return False
    except (FileNotFoundError, IsADirectoryError, UnicodeDecodeError):
        pass
    atomic_write_text(path, text)
    return True


_HEADER = "# Written by the pipeline from params.yaml ({what}); do not edit: edit params.yaml.\n"


def _run_header(run: PlannedRun, what: str) -> str:
    """The header of one of a run's settings files, `what` saying which."""
    return _HEADER.format(what=f"experiment {run.experiment}, run {run.size}/{run.condition.id}/seed{run.seed}: {what}")


def config_texts(run: PlannedRun) -> tuple[str, str]:
    """(config.yaml, eval.yaml) texts of a run: its training config and its evaluation settings."""
    train = _run_header(run, "training config, input of `loopscale train --config`")
    ev = _run_header(run, "evaluation settings, input of `loopscale eval --eval-config`")
    # train.threads changes how fast a job runs, not what it computes: the train rule passes
    # the job's threads on the command line, so a changed thread count reruns nothing
    cfg = run.config.to_dict()
    cfg["train"]["threads"] = 0
    cfg["data"] = compact_data(cfg["data"])
    return train + _dump(cfg), ev + _dump(run.eval.to_dict())


def compact_data(data: dict) -> dict:
    """Data settings without the data.source=fineweb keys that hold their defaults: the files
    of every other experiment stay as they were before those keys existed (nothing reruns)."""
    defaults = fineweb_defaults()
    return {k: v for k, v in data.items() if not (k in defaults and v == defaults[k])}


def settings_files(exp: Experiment) -> dict[str, str]:
    """{path: text} of every settings file of the experiment: data/<exp>/config.yaml (input of
    prepare_data) and each run's config.yaml (train), eval.yaml (its evaluations) and, when
    streamed, stream.yaml (train-stream)."""
    files = {f"{exp.data_dir}/config.yaml": _HEADER.format(what=f"experiment {exp.name}, data settings")
             + _dump({"data": compact_data(exp.data)})}
    for run in exp.runs:
        files[f"{run.dir}/config.yaml"], files[f"{run.dir}/eval.yaml"] = config_texts(run)
        if run.stream is not None:
            header = _run_header(run, "stream settings, input of `loopscale train-stream --stream-config`")
            files[f"{run.dir}/stream.yaml"] = header + _dump({"stream": run.stream})
    return files


# when a settings job runs (by modification times, also in a fresh clone): docs/pipeline.md,
# "The pipeline module"
SETTINGS_CODE = ("config", "registry", "pipeline", "fineweb")  # the modules that compute the texts


def write_settings(path: str, text: str, log: str) -> None:
    """The settings job: write the file if its text changed, and say which in the log."""
    changed = write_if_changed(path, text)
    Path(log).write_text(f"{path}: {'written' if changed else 'unchanged'}\n")


def settings_stale(path: str | os.PathLike, text: str) -> bool:
    """Whether the settings file exists and holds other text than `text`."""
    try:
        return Path(path).read_text() != text
    except (FileNotFoundError, IsADirectoryError, UnicodeDecodeError):
        return False


def check_settings(files: dict[str, str], sources: list[str]) -> None:
    """A settings file that is out of date but not older than any of its sources (edited by hand,
    or restored by `dvc checkout` after them) would not be rewritten in a fresh clone: one line
    saying what to do."""
    newest = max((os.stat(s).st_mtime_ns for s in sources if os.path.exists(s)), default=0)
    for path, text in files.items():
        if settings_stale(path, text) and os.stat(path).st_mtime_ns >= newest:
            raise ParamsError(f"{path} holds other settings than {sources[0]} gives and is newer "
                              f"than it, so it might not be rewritten: delete it (the pipeline writes it again)")


# the SLURM profile's account until a user sets theirs (profiles/slurm/config.yaml, EDIT (1))
PLACEHOLDER_ACCOUNT = "my_account"


def placeholder_account(default_resources) -> Optional[str]:
    """A warning when Snakemake's default resources (`--default-resources`, a profile's
    `default-resources`: a mapping of name -> value or Snakemake's Resources) still give
    `slurm_account` as the profile's placeholder; None otherwise."""
    try:
        value = default_resources.get("slurm_account")
    except (AttributeError, TypeError):
        return None
    if value is not None and not isinstance(value, str):  # a snakemake Resource: its text as given
        value = getattr(value, "raw", None)
    if isinstance(value, str) and value.strip("'\" ") == PLACEHOLDER_ACCOUNT:
        return (f"slurm_account is still the placeholder {PLACEHOLDER_ACCOUNT!r} (profiles/slurm/config.yaml): set "
                f"your account (`sacctmgr show assoc user=$USER`), or delete the line if your site has none; "
                f"sbatch would refuse every job")
    return None


# ---------------------------------------------------------------------------
# code each stage depends on
# ---------------------------------------------------------------------------
# Modules (under src/loopscale/, a trailing / for a subpackage) that only some stages run; every
# other module is code of every stage (docs/pipeline.md, "The pipeline module").
# NOT_STAGE_CODE: the command-line dispatch, the DAG side and tools no job runs.
STAGE_ONLY = {
    "train": ("train", "rundir", "distributed"),
    "train_stream": ("train", "train_stream", "rundir", "distributed"),
    "eval": ("diagnostics", "exits", "halting", "report/"),
    "report": ("report/",),
    "ouro": ("ouro_tools", "exits", "generate", "harness", "hf"),
}
STAGES = ("data", *STAGE_ONLY)
NOT_STAGE_CODE = ("cli/", "pipeline", "bench", "convert")


def _module_paths(names: Iterable[str], package: Path) -> set[Path]:
    out = set()
    for name in names:
        out |= set((package / name).rglob("*.py")) if name.endswith("/") else {package / f"{name}.py"}
    return {p for p in out if p.is_file()}


def stage_code(stage: str, src: str | os.PathLike = "src") -> list[str]:
    """The source files of the code the pipeline stage `stage` (one of STAGES) runs."""
    package = Path(src) / "loopscale"
    others = _module_paths([m for ms in STAGE_ONLY.values() for m in ms] + list(NOT_STAGE_CODE), package)
    shared = set(package.rglob("*.py")) - others
    return sorted(str(p) for p in shared | _module_paths(STAGE_ONLY.get(stage, ()), package))


# ---------------------------------------------------------------------------
# job-side helpers: python -m loopscale.pipeline <command>
# ---------------------------------------------------------------------------
def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loopscale.pipeline", description="pipeline helpers")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("check", help="validate params.yaml and list the runs of an experiment")
    s.add_argument("--params", default="params.yaml")
    s.add_argument("--schema", default="workflow/schemas/params.schema.yaml")
    s.add_argument("--experiment")
    args = p.parse_args(argv)
    try:
        params, exps = load_and_validate(args.params, args.schema,
                                         {"experiment": args.experiment} if args.experiment else None)
    except ParamsError as e:
        print(f"loopscale pipeline: error: {e}", file=sys.stderr)
        return 2
    exp = exps[params["experiment"]]
    for r in exp.runs:
        print(r.dir)
    print(f"# {exp.name}: {len(exp.runs)} runs, diagnostics: {', '.join(exp.diagnostics)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
