"""The pipeline: params.yaml -> Snakemake (Snakefile, workflow/) -> DVC (dvc.yaml).

Fast tests: params validation and expansion (loopscale.pipeline), the schema, lint and
dry runs. Slow tests (@pytest.mark.slow): the smoke grid end to end through
`snakemake --cores 2` and through `dvc repro`, incremental rebuilds in fresh copies of a
completed run (no .snakemake/ metadata, as in a fresh clone or CI), failing fast on bad
params, and `dvc push` / `dvc pull` into a fresh clone.

Every test works in a copy of the working tree under tmp_path (tracked and untracked,
not ignored files; a fresh git repository), never in the repository itself. The jobs
run the copy's code (PYTHONPATH=<copy>/src).
"""
from __future__ import annotations

import copy
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from loopscale import config as C
from loopscale import pipeline as P
from loopscale import registry as R

from workflow_support import (DVC, REPO, SCHEMA, SMOKE, SNAKEMAKE, VENV_BIN,
                              assert_same_tables, copy_worktree, counts, dry_run, edit_params, fresh_copy, git,
                              load, pipeline_env, read_table, run, smk, smoke_runs, tree_digest)


@pytest.fixture(scope="module")
def dry_workspace(tmp_path_factory):
    """A copy of the working tree in which a valid dry run has succeeded (and written nothing)."""
    repo = copy_worktree(tmp_path_factory.mktemp("dry") / "repo")
    smk(repo, "-n", "-q", *SMOKE)
    return repo


@pytest.fixture(scope="module")
def params():
    return yaml.safe_load((REPO / "params.yaml").read_text())


# ---------------------------------------------------------------------------
# fast: settings
# ---------------------------------------------------------------------------
def test_the_schema_leaves_registry_values_to_the_registry(params, tmp_path):
    """The schema (checked by snakemake.utils.validate) names no readout, loss, regularizer,
    recurrence, diagnostic or preset: adding one to the registry never touches it. The
    pipeline checks those values against the registries, and names the choices."""
    d = P.load_schema(SCHEMA)["$defs"]
    for axis in R.AXES:
        assert d[axis] == {"type": "string"}
    assert d["diagnostics"]["items"] == {"type": "string"}
    assert d["size"]["properties"]["preset"] == {"type": "string"}
    for mutate, key, choices in [
            (_mut(["diagnostics"], ["depth", "nroms"]), "diagnostics[1]", R.DIAGNOSTICS),
            (_mut(["condition_sets", "blind_spot", 0, "loss"], "per-loop"), "condition_sets.blind_spot[0].loss",
             R.LOSSES),
            (_mut(["experiments", "smoke", "sizes", "smoke", "preset"], "huge"), "experiments.smoke.sizes.smoke.preset",
             C.MODEL_PRESETS)]:
        p = copy.deepcopy(params)
        mutate(p)
        with pytest.raises(P.ParamsError) as info:
            load(p, tmp_path)
        msg = str(info.value)
        assert f"{key}: unknown value " in msg and msg.endswith(f"; choose one of {', '.join(choices)}"), msg


def test_experiments_expand(params, tmp_path):
    _, exps = load(params, tmp_path)
    assert params["experiment"] == "cpu"
    paper7 = ["rmsnorm-terminal-none-residual", "raw-terminal-none-residual", "rmsnorm-per_loop-none-residual",
              "raw-per_loop-none-residual", "final_norm-per_loop-none-residual",
              "rmsnorm-terminal-norm_penalty-residual", "rmsnorm-per_loop-norm_penalty-residual"]
    loopscale9 = paper7 + ["layernorm-per_loop-none-residual", "rmsnorm-per_loop-none-inter_loop_norm"]
    sets = params["condition_sets"]
    assert [c.id for c in P.expand_conditions("paper7", sets, "x")] == paper7
    assert [c.id for c in P.expand_conditions("loopscale9", sets, "x")] == loopscale9

    cpu, paper, smoke = exps["cpu"], exps["paper"], exps["smoke"]
    assert len(cpu.runs) == 9 * 3 and {r.seed for r in cpu.runs} == {42, 101, 202}
    long = exps["cpu_long"]
    assert len(long.runs) == 9 * 2 and {r.seed for r in long.runs} == {42, 101}
    assert all((r.config.model.d_model, r.config.model.n_layers, r.config.model.seq_len, r.config.train.max_steps)
               == (128, 4, 128, 1500) for r in long.runs)
    assert all(r.config.model.d_model == C.MODEL_PRESETS["cpu"]["model"]["d_model"]
               and r.config.data.source == "builtin" for r in cpu.runs)
    assert len(paper.runs) == 2 * 9 * 3 and {r.seed for r in paper.runs} == {42, 101, 202}
    assert {r.size: r.config.model.d_model for r in paper.runs} == {"44m": 512, "129m": 768}
    assert paper.data["source"] == "wikitext-103" and paper.data["vocab_size"] == 20000 and paper.gpu == 1
    assert 1 <= len(smoke.runs) <= 4
    assert all(r.config.model.d_model == C.MODEL_PRESETS["smoke"]["model"]["d_model"] for r in smoke.runs)
    run = paper.run("129m", "rmsnorm-per_loop-norm_penalty-residual", 101)
    assert run.dir == "runs/paper/129m/rmsnorm-per_loop-norm_penalty-residual/seed101"
    c = run.config
    assert (c.model.readout, c.objective.loss, c.objective.regularizer, c.model.recurrence, c.train.seed) == \
        ("rmsnorm", "per_loop", "norm_penalty", "residual", 101)


def test_grid_and_overrides(params, tmp_path):
    p = copy.deepcopy(params)
    p["experiments"]["smoke"]["conditions"] = [
        {"grid": {"readout": ["rmsnorm", "raw"], "loss": ["per_loop", "terminal"],
                  "regularizer": ["none", "norm_penalty"]}},
        {"readout": "layernorm", "loss": "per_loop", "overrides": {"objective": {"penalty_weight": 0.5}}},
        "blind_spot",  # duplicates of grid points are dropped
    ]
    p["experiments"]["smoke"]["seeds"] = [1, 2]
    _, exps = load(p, tmp_path)
    smoke = exps["smoke"]
    assert len(smoke.runs) == (2 * 2 * 2 + 1) * 2
    ln = smoke.run("smoke", "layernorm-per_loop-none-residual", 2).config
    assert ln.objective.penalty_weight == 0.5 and ln.train.seed == 2


def _mut(path, value):
    def f(p):
        node = p
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value
    return f


BAD = [
    (_mut(["colour"], 1), "unknown key 'colour'"),
    (_mut(["experiments", "cpu", "sedes"], [1]), "'experiments.cpu.sedes'"),
    (_mut(["experiments", "cpu", "seeds"], ["x"]), "experiments.cpu.seeds[0]"),
    (_mut(["experiments", "smoke", "evidence"], "no"), "experiments.smoke.evidence"),  # a boolean
    (_mut(["experiments", "cpu", "train", "lrr"], 1), "'experiments.cpu.train.lrr'"),
    (_mut(["experiments", "cpu", "train", "lr"], "fast"), "experiments.cpu.train: train.lr must be a number"),
    (_mut(["experiments", "paper", "sizes", "44m", "preset"], "huge"), "experiments.paper.sizes.44m.preset"),
    (_mut(["experiments", "paper", "sizes", "44m", "overrides"], {"model": {"n_heads": 7}}),
     "experiments.paper.sizes.44m.overrides: model.d_model (512) must be divisible"),
    (_mut(["condition_sets", "paper7", 2, "readout"], "rmsnrom"), "condition_sets.paper7[2].readout: unknown value"),
    (_mut(["condition_sets", "loopscale9", 0], "paper8"), "condition_sets.loopscale9[0]: unknown condition set"),
    (_mut(["experiments", "smoke", "conditions"], {"grid": {"readout": ["raw"], "loss": ["per-loop"]}}),
     "experiments.smoke.conditions.grid.loss[0]"),
    (_mut(["experiments", "smoke", "diagnostics"], ["depth", "nroms"]), "experiments.smoke.diagnostics[1]"),
    (_mut(["experiments", "smoke", "sizes", "a/b"], {"preset": "smoke"}), "experiments.smoke.sizes"),
    (_mut(["experiment"], "nope"), "experiment: unknown experiment 'nope'"),
    (_mut(["condition_sets", "blind_spot", 1], {"readout": "raw", "loss": "per_loop",
                                                 "overrides": {"model": {"readout": "rmsnorm"}}}),
     "condition_sets.blind_spot[1].overrides.model.readout: 'rmsnorm' contradicts the condition's readout 'raw'"),
    (_mut(["experiments", "smoke", "conditions"], {"grid": {"readout": ["raw"], "loss": ["per_loop"]},
                                                   "overrides": {"objective": {"loss": "terminal"}}}),
     "experiments.smoke.conditions.grid.overrides.objective.loss: 'terminal' contradicts"),
    (_mut(["experiments", "smoke", "sizes", "smoke", "overrides"], {"model": {"recurrence": "inter_loop_norm"}}),
     "experiments.smoke.sizes.smoke.overrides.model.recurrence: the conditions set the recurrence"),
]


@pytest.mark.parametrize("mutate,expected", BAD, ids=[e for _, e in BAD])
def test_bad_params_name_the_key(params, tmp_path, mutate, expected):
    p = copy.deepcopy(params)
    mutate(p)
    with pytest.raises(P.ParamsError) as info:
        load(p, tmp_path)
    msg = str(info.value)
    assert expected in msg and "\n" not in msg


def test_write_if_changed_keeps_mtime(tmp_path):
    f = tmp_path / "a" / "config.yaml"
    assert P.write_if_changed(f, "x: 1\n")
    os.utime(f, ns=(1_000_000_000, 1_000_000_000))
    assert not P.write_if_changed(f, "x: 1\n")
    assert f.stat().st_mtime_ns == 1_000_000_000
    assert P.write_if_changed(f, "x: 2\n") and f.read_text() == "x: 2\n"


def write_settings(exp, root: Path) -> list[str]:
    """Write the experiment's settings files as its settings jobs do; the paths (re)written."""
    return [f for f, text in P.settings_files(exp).items() if P.write_if_changed(root / f, text)]


def test_eval_settings_do_not_touch_train_config(params, tmp_path):
    _, exps = load(params, tmp_path)
    assert len(write_settings(exps["smoke"], tmp_path)) == 1 + 2 * len(exps["smoke"].runs)
    assert write_settings(exps["smoke"], tmp_path) == []  # unchanged: nothing rewritten
    assert not any(P.settings_stale(tmp_path / f, t) for f, t in P.settings_files(exps["smoke"]).items())
    run = exps["smoke"].runs[0]
    written = C.load_config(str(tmp_path / run.dir / "config.yaml"))  # what `loopscale train` reads
    assert written.train.threads == 0  # the train job passes its own threads (--set train.threads)
    written.train.threads = run.config.train.threads
    assert written == run.config
    assert C.load_eval_config(str(tmp_path / run.dir / "eval.yaml")) == run.eval == C.eval_preset("smoke")
    p = copy.deepcopy(params)
    p["experiments"]["smoke"]["eval"] = {"max_tokens": 1024}
    _, exps2 = load(p, tmp_path)
    stale = [f for f, t in P.settings_files(exps2["smoke"]).items() if P.settings_stale(tmp_path / f, t)]
    assert stale == write_settings(exps2["smoke"], tmp_path)
    assert sorted(stale) == sorted(f"{r.dir}/eval.yaml" for r in exps2["smoke"].runs)
    assert C.load_eval_config(str(tmp_path / run.dir / "eval.yaml")).max_tokens == 1024


def test_bad_eval_setting_names_its_params_key(params, tmp_path):
    for mutate, expected in [
            (_mut(["experiments", "smoke", "eval"], {"lemma_loops": 1}), "experiments.smoke.eval: eval.lemma_loops"),
            (_mut(["experiments", "smoke", "eval"], {"max_tokenz": 1}), "unknown key 'experiments.smoke.eval.max_tokenz'"),
            (_mut(["experiments", "smoke", "eval"], {"device": "tpu"}), "experiments.smoke.eval: eval.device: unknown value"),
            (_mut(["experiments", "smoke", "sizes", "smoke", "overrides"], {"eval": {"batch_size": 0}}),
             "experiments.smoke.sizes.smoke.overrides.eval: eval.batch_size"),
            (_mut(["experiments", "smoke", "conditions"], [{"readout": "raw", "loss": "per_loop",
                                                            "overrides": {"eval": {"norm_tokens": "x"}}}]),
             "experiments.smoke.conditions[0].overrides.eval: eval.norm_tokens must be an integer")]:
        p = copy.deepcopy(params)
        mutate(p)
        with pytest.raises(P.ParamsError) as info:
            load(p, tmp_path)
        assert expected in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_names_are_matched_in_full(params, tmp_path):
    """A size name ending in a newline would split a shell command: refused by the schema
    and by the pipeline's own check, whatever the regex engine does with `$`."""
    p = copy.deepcopy(params)
    p["experiments"]["smoke"]["sizes"]["smoke\n"] = p["experiments"]["smoke"]["sizes"].pop("smoke")
    with pytest.raises(P.ParamsError, match=r"experiments\.smoke\.sizes: 'smoke\\n' does not match"):
        P.check_schema(p, P.load_schema(SCHEMA))
    with pytest.raises(P.ParamsError, match=r"experiments\.smoke\.sizes: name 'smoke\\n' must match"):
        P._check_names(p, "params.yaml")


def test_drop_stale_state(tmp_path, smoke_data, capsys):
    """`--drop-stale-state` (the training jobs) deletes a state.pt of other training settings
    (for a streamed run, of other stream settings too) and keeps one it can resume; it acts only
    once the run directory is locked, so a running trainer's state.pt is never deleted."""
    from loopscale import cli
    from loopscale.io import atomic_torch_save, run_lock
    from loopscale.rundir import drop_stale
    cfg = C.preset("smoke")
    state = tmp_path / "state.pt"
    atomic_torch_save(state, {"model": {}, "config": cfg.to_dict(), "step": 3})
    assert not drop_stale(tmp_path, C.preset("smoke", {"train": {"eval_batch_size": 3}})) and state.exists()
    old = {**cfg.to_dict(), "eval": {"max_tokens": 4096}}  # a state.pt from before eval left the run config
    atomic_torch_save(state, {"model": {}, "config": old, "step": 3})
    assert not drop_stale(tmp_path, cfg) and state.exists()
    assert drop_stale(tmp_path, C.preset("smoke", {"train": {"lr": 1e-4}})) and not state.exists()
    assert not drop_stale(tmp_path, cfg)
    atomic_torch_save(state, {"model": {}, "config": cfg.to_dict(), "stream": {"min_chars": 50}, "step": 3})
    assert not drop_stale(tmp_path, cfg, {"stream": {"min_chars": 50}}) and state.exists()
    assert drop_stale(tmp_path, cfg, {"stream": {"min_chars": 10}}) and not state.exists()
    # a held run: the second trainer is refused before it looks at state.pt, which stays
    run = tmp_path / "run"
    run.mkdir()
    atomic_torch_save(run / "state.pt", {"model": {}, "config": cfg.to_dict(), "step": 3})
    before = (run / "state.pt").read_bytes()
    with run_lock(run, "loopscale train"):
        rc = cli.main(["train", "--preset", "smoke", "--set", "train.lr=1e-4", "--data", str(smoke_data),
                       "--out", str(run), "-q", "--drop-stale-state"])
    assert rc == 2 and "is in use by loopscale train" in capsys.readouterr().err
    assert (run / "state.pt").read_bytes() == before


def test_no_preset_alias(params, tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    with pytest.raises(P.ParamsError, match="unknown key 'preset'"):
        P.load_and_validate(path, SCHEMA, overrides={"preset": "smoke"})


# the module each stage's job calls into (`loopscale <command>` dispatches to it)
STAGE_ENTRY = {"data": "loopscale.data", "train": "loopscale.train", "train_stream": "loopscale.train_stream",
               "eval": "loopscale.diagnostics", "report": "loopscale.report", "ouro": "loopscale.ouro_tools"}


def _imports(path: Path, top_level: bool) -> set[str]:
    """The loopscale modules a source file imports (relative imports resolved; `from m import
    x` counts m.x when it is a module); with top_level, only those run on import."""
    import ast
    module = ".".join(path.relative_to(REPO / "src").with_suffix("").parts)
    package = module.removesuffix(".__init__") if path.name == "__init__.py" else module.rpartition(".")[0]
    def walk(node):  # with top_level, not into function bodies
        yield node
        for child in ast.iter_child_nodes(node):
            if not (top_level and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))):
                yield from walk(child)
    out = set()
    for node in walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            out |= {base} | {f"{base}.{a.name}" for a in node.names}
    return {m.removeprefix("loopscale.") for m in out if m.startswith("loopscale.")}


def _source(module: str) -> Path | None:
    base = REPO / "src" / "loopscale" / Path(*module.split("."))
    return next((f for f in (base.with_suffix(".py"), base / "__init__.py") if f.is_file()), None)


def import_closure(entry: str) -> set[str]:
    """Source files (relative to the repository) of the loopscale modules `entry` runs:
    its imports, function-level ones included, followed through the package; a package's
    __init__ counts with what it imports when loaded (its lazy exports serve users)."""
    todo, seen = [entry.removeprefix("loopscale.")], set()
    while todo:
        m = todo.pop()
        if m in seen or m.split(".")[0] in P.NOT_STAGE_CODE:  # the command-line dispatch, the DAG side
            continue
        path = _source(m)
        if path is None:
            continue  # a name imported from a module, not a module
        seen.add(m)
        todo += sorted(_imports(path, top_level=path.name == "__init__.py" and m != entry.removeprefix("loopscale.")))
        parents = m.split(".")[:-1]
        todo += [".".join(parents[:i + 1]) for i in range(len(parents))] + ["__init__"]
    return {str(_source(m).relative_to(REPO)) for m in seen}


@pytest.mark.parametrize("stage", P.STAGES)
def test_stage_code_holds_every_imported_module(stage):
    """Each stage's declared code (loopscale.pipeline.STAGE_ONLY) holds every module its entry
    module imports, directly or not, also inside functions."""
    declared = {str(Path(f).relative_to(REPO)) for f in P.stage_code(stage, REPO / "src")}
    missing = import_closure(STAGE_ENTRY[stage]) - declared
    assert not missing, f"{stage}: add {sorted(missing)} to loopscale.pipeline.STAGE_ONLY[{stage!r}]"
    if stage == "eval":  # `loopscale eval story` writes its files with the report's code
        assert "src/loopscale/report/document.py" in declared


def test_stage_code_lists_existing_modules_and_keeps_stages_apart(tmp_path):
    package = REPO / "src" / "loopscale"
    for name in {m for ms in P.STAGE_ONLY.values() for m in ms} | set(P.NOT_STAGE_CODE):
        assert (package / name).is_dir() if name.endswith("/") else (package / f"{name}.py").is_file(), name
    code = {s: {Path(f).relative_to(REPO).as_posix() for f in P.stage_code(s, REPO / "src")} for s in P.STAGES}
    assert "src/loopscale/diagnostics.py" not in code["train"] | code["data"] | code["report"]
    assert "src/loopscale/train.py" not in code["eval"] | code["data"]
    assert not any(f.startswith("src/loopscale/cli/") or f == "src/loopscale/pipeline.py"
                   for fs in code.values() for f in fs)
    # a module no stage claims is code of every stage
    (tmp_path / "loopscale" / "report").mkdir(parents=True)
    for f in ("__init__.py", "model.py", "train.py", "new.py", "report/__init__.py"):
        (tmp_path / "loopscale" / f).write_text("")
    rel = {s: [Path(f).relative_to(tmp_path).as_posix() for f in P.stage_code(s, tmp_path)] for s in ("data", "train")}
    assert rel == {"data": ["loopscale/__init__.py", "loopscale/model.py", "loopscale/new.py"],
                   "train": ["loopscale/__init__.py", "loopscale/model.py", "loopscale/new.py", "loopscale/train.py"]}


# ---------------------------------------------------------------------------
# fast: Snakemake on the workflow (no jobs run)
# ---------------------------------------------------------------------------
def test_lint_clean(dry_workspace):
    proc = smk(dry_workspace, "--lint", *SMOKE)
    assert "Congratulations" in proc.stdout + proc.stderr


def job_inputs(repo: Path, rule: str, *args: str) -> list[list[str]]:
    """The input files of every `rule` job that `snakemake -n` lists."""
    out = smk(repo, "-n", *SMOKE, *args).stdout
    blocks = re.split(r"\n(?=(?:local)?rule \w+:)", out)
    return [re.search(r"^\s+input: (.*)$", b, re.M).group(1).split(", ") for b in blocks
            if re.match(rf"(?:local)?rule {rule}:", b)]


def test_smoke_dag(dry_workspace):
    c = counts(dry_run(dry_workspace))
    n = len(P.load_and_validate(dry_workspace / "params.yaml", SCHEMA, overrides={"experiment": "smoke"})[1]["smoke"].runs)
    assert n >= 1
    # settings: the data config and each run's config.yaml and eval.yaml (settings.smk)
    assert c == {"settings": 1 + 2 * n, "prepare_data": 1, "train": n, "eval": n, "aggregate": 1, "figures": 1,
                 "report": 1, "all": 1}


def test_rule_inputs_are_derived(dry_workspace):
    """The train jobs depend on every module training imports (model.py through train.py,
    io.py through the package) and on the data rule's outputs."""
    trains = job_inputs(dry_workspace, "train")
    data = ["data/smoke/tokenizer.json", "data/smoke/train.bin", "data/smoke/validation.bin", "data/smoke/test.bin",
            "data/smoke/meta.json"]
    for inputs in trains:
        assert set(P.stage_code("train", "src")) <= set(inputs)
        assert {"src/loopscale/model.py", "src/loopscale/objective.py", "src/loopscale/io.py"} <= set(inputs)
        assert set(data) <= set(inputs)
    for inputs in job_inputs(dry_workspace, "eval"):
        assert "src/loopscale/halting.py" in inputs and inputs[1].endswith("/model.pt")


def test_nothing_is_written_while_the_workflow_is_parsed(dry_workspace):
    """A dry run and `--list-rules` with changed settings (a new seed, another max_steps) plan
    from them but write nothing: the settings files are outputs of the settings jobs."""
    good = (dry_workspace / "params.yaml").read_text()
    exps = P.load_and_validate(dry_workspace / "params.yaml", SCHEMA, overrides={"experiment": "smoke"})[1]
    write_settings(exps["smoke"], dry_workspace)  # the files an earlier invocation wrote
    before = tree_digest(dry_workspace)
    dirs = sorted(p for p in dry_workspace.rglob("*") if p.is_dir() and ".snakemake" not in p.parts)
    try:
        edit_params(dry_workspace, lambda p: p["experiments"]["smoke"].update(
            seeds=[42, 7], train={"max_steps": 21, "threads": 1}))
        c = counts(dry_run(dry_workspace))
        n = len(exps["smoke"].runs)
        # the old runs' config.yaml (max_steps), the new runs' config.yaml and eval.yaml
        assert c["train"] == 2 * n and c["settings"] == n + 2 * n
        for args in (("--dry-run",), ("-nq",), ("--list-rules",), ("--lint",)):
            smk(dry_workspace, *args, *SMOKE)
            assert tree_digest(dry_workspace) == before, args
            assert sorted(p for p in dry_workspace.rglob("*") if p.is_dir() and ".snakemake" not in p.parts) == dirs
    finally:
        (dry_workspace / "params.yaml").write_text(good)


def test_a_settings_file_newer_than_params_is_named(dry_workspace):
    """An out-of-date settings file that is newer than params.yaml (edited by hand, or restored
    by `dvc checkout` afterwards) would not be rewritten in a fresh clone: one line naming it."""
    exps = P.load_and_validate(dry_workspace / "params.yaml", SCHEMA, overrides={"experiment": "smoke"})[1]
    write_settings(exps["smoke"], dry_workspace)
    path = dry_workspace / exps["smoke"].runs[0].dir / "config.yaml"
    good = path.read_text()
    try:
        path.write_text(good.replace("max_steps: 20", "max_steps: 5"))
        proc = smk(dry_workspace, "-n", *SMOKE, check=False)
        assert proc.returncode != 0
        assert proc.stderr.strip().splitlines() == [
            f"loopscale pipeline: error: {path.relative_to(dry_workspace)} holds other settings than params.yaml "
            "gives and is newer than it, so it might not be rewritten: delete it (the pipeline writes it again)"]
        os.utime(path, ns=(1_000_000_000, 1_000_000_000))  # older than params.yaml: its settings job reruns
        jobs = dry_run(dry_workspace)
        assert ("settings", str(path.relative_to(dry_workspace))) in jobs
    finally:
        path.write_text(good)


def test_bad_params_stop_snakemake_with_one_line(dry_workspace):
    before = tree_digest(dry_workspace)
    good = (dry_workspace / "params.yaml").read_text()
    try:
        (dry_workspace / "params.yaml").write_text(good.replace("seeds: [42]\n    conditions: blind_spot",
                                                                "seeds: [42]\n    conditions: blind_spots"))
        proc = smk(dry_workspace, "-n", *SMOKE, check=False)
    finally:
        (dry_workspace / "params.yaml").write_text(good)
    assert proc.returncode != 0
    defined = ", ".join(yaml.safe_load(good)["condition_sets"])  # in params.yaml's order
    assert proc.stderr.strip().splitlines() == [
        "loopscale pipeline: error: params.yaml: experiments.smoke.conditions: unknown condition set "
        f"'blind_spots'; define it under condition_sets (defined: {defined})"]
    assert tree_digest(dry_workspace) == before


@pytest.mark.parametrize("section,key,value", [("eval", "depth_factor", 0), ("train", "threads", -3),
                                               ("train", "grad_clip", 0)])
def test_a_setting_out_of_range_stops_snakemake(dry_workspace, section, key, value):
    """Range checks (config.validate) run while Snakemake builds the DAG: before any job, and
    before an eval job's outputs could be deleted."""
    before = tree_digest(dry_workspace)
    good = (dry_workspace / "params.yaml").read_text()
    try:
        edit_params(dry_workspace, lambda p: p["experiments"]["smoke"].update({section: {key: value}}))
        proc = smk(dry_workspace, "-n", *SMOKE, check=False)
    finally:
        (dry_workspace / "params.yaml").write_text(good)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1
    assert lines[0].startswith("loopscale pipeline: error:") and f"{section}.{key} must be" in lines[0]
    assert tree_digest(dry_workspace) == before


def test_paper_grid_dry_run_is_fast(dry_workspace, record_property):
    t0 = time.monotonic()
    out = smk(dry_workspace, "-n", "--config", "experiment=paper").stdout
    wall = time.monotonic() - t0
    record_property("paper_dry_run_s", round(wall, 2))
    print(f"\npaper grid dry run: {wall:.1f} s")
    c = counts([(m, "") for m in re.findall(r"^(?:local)?rule (\w+):", out, re.M)])
    # one training and one evaluation job per run (all seven diagnostics, the model loaded once),
    # and a settings job for each of the 109 settings files (the data config, 2 per run)
    assert c == {"settings": 109, "prepare_data": 1, "train": 54, "eval": 54, "aggregate": 1, "figures": 1,
                 "report": 1, "all": 1}
    assert wall < 60, f"dry run of the paper grid took {wall:.1f} s"


# ---------------------------------------------------------------------------
# slow: the smoke grid end to end, incremental rebuilds
# ---------------------------------------------------------------------------
@pytest.mark.slow
def test_smoke_grid_end_to_end(smoke_local, record_property):
    repo, wall = smoke_local
    record_property("smoke_grid_wall_s", wall)
    print(f"\nsmoke grid (snakemake --cores 2): {wall:.0f} s")
    runs = smoke_runs(repo)
    assert len(runs) == 2
    for r in runs:
        assert json.loads((r / "summary.json").read_text())["status"] == "completed"
        assert (r / "model.pt").is_file() and (r / "config.yaml").is_file()
        for d in yaml.safe_load((repo / "params.yaml").read_text())["experiments"]["smoke"]["diagnostics"]:
            assert json.loads((r / "eval" / f"{d}.json").read_text())["status"] == "ok"
        assert (repo / "logs" / r.relative_to(repo / "runs") / "train.log").is_file()
    res = repo / "results" / "smoke"
    for f in ("main.csv", "main.md", "runs.csv", "claims.md", "REPORT.md", "figures/norm_per_loop.png"):
        assert (res / f).is_file(), f
    assert len(read_table(res / "runs.csv")) == 2
    assert not list((repo / "runs" / "smoke").rglob("state.pt"))  # removed once a run is finished
    # outputs are ignored by git (except results/cpu); no index refresh: the workspace is shared
    assert git(repo, "--no-optional-locks", "status", "--porcelain") == ""


@pytest.mark.slow
def test_nothing_to_do_in_a_fresh_copy(smoke_local, tmp_path):
    repo = fresh_copy(smoke_local[0], tmp_path / "repo")
    assert dry_run(repo) == []
    t0 = time.monotonic()
    out = smk(repo, "--cores", "all", *SMOKE)
    assert "Nothing to be done" in out.stdout + out.stderr
    assert time.monotonic() - t0 < 60


@pytest.mark.slow
def test_a_deleted_checkpoint_retrains(smoke_local, tmp_path):
    """model.pt is a declared output: deleting it retrains that run (and only it), and
    --delete-all-output removes checkpoints."""
    repo = fresh_copy(smoke_local[0], tmp_path / "repo")
    run_dir = smoke_runs(repo)[0]
    (run_dir / "model.pt").unlink()
    jobs = dry_run(repo)
    assert counts(jobs) == {"train": 1, "eval": 1, "aggregate": 1, "figures": 1, "report": 1, "all": 1}
    assert all(str(run_dir.relative_to(repo)) in o for r, o in jobs if r in ("train", "eval"))
    out = smk(repo, "--delete-all-output", "--dry-run", *SMOKE).stdout
    other = smoke_runs(repo)[1].relative_to(repo)
    assert f"{other}/model.pt" in out and f"{other}/summary.json" in out
    assert not list((repo / "runs").rglob("state.pt")) and (repo / other / "model.pt").is_file()


CRASH_SHIM = """
import os
if os.environ.get("LOOPSCALE_TEST_CRASH"):  # a crash (say, out of memory) in the runs named so
    import loopscale.train as T
    _train = T.train
    def train(cfg, data_dir, out_dir, **kw):
        if os.environ["LOOPSCALE_TEST_CRASH"] in str(out_dir):
            raise RuntimeError("simulated crash")
        return _train(cfg, data_dir, out_dir, **kw)
    T.train = train
"""


@pytest.mark.slow
def test_a_crashed_run_is_recorded_and_the_grid_completes(smoke_local, tmp_path):
    """A training crash is a result: summary.json and model.pt (no weights) say failed, the
    eval job writes "failed" results, the tables show it, and nothing is left to do."""
    repo = fresh_copy(smoke_local[0], tmp_path / "repo")
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(CRASH_SHIM)
    target = "raw-per_loop-none-residual"
    edit_params(repo, lambda p: p["experiments"]["smoke"].__setitem__("conditions", [
        {"readout": "rmsnorm", "loss": "per_loop"}, {"readout": "raw", "loss": "per_loop",
                                                     "overrides": {"train": {"lr": 2e-3}}}]))
    env = pipeline_env(repo, {"LOOPSCALE_TEST_CRASH": target,
                              "PYTHONPATH": os.pathsep.join([str(shim), str(repo / "src")])})
    run([SNAKEMAKE, "--cores", "2", *SMOKE], repo, env=env)
    run_dir = repo / "runs" / "smoke" / "smoke" / target / "seed42"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"] == "RuntimeError: simulated crash"
    assert (run_dir / "model.pt").is_file() and not list(run_dir.glob("model.safetensors"))
    for d in ("depth", "norms", "radial"):
        assert json.loads((run_dir / "eval" / f"{d}.json").read_text())["status"] == "failed"
    rows = {r["condition_id"]: r["status"] for r in read_table(repo / "results" / "smoke" / "runs.csv")}
    assert rows == {target: "failed", "rmsnorm-per_loop-none-residual": "completed"}
    assert dry_run(repo) == []


@pytest.mark.slow
def test_nothing_reruns_through_another_path_to_the_venv(smoke_local, tmp_path):
    """No rule's params hold an interpreter or script path: the finished grid, reached
    through another path to the same venv (here a symlink), has nothing to do, also with
    Snakemake's metadata (params, code) kept."""
    repo = tmp_path / "repo"
    shutil.copytree(smoke_local[0], repo, symlinks=True)
    link = tmp_path / "venv link"  # and a space in the path
    link.symlink_to(VENV_BIN.parent, target_is_directory=True)
    env = pipeline_env(repo, {"PATH": os.pathsep.join([str(link / "bin"), os.environ.get("PATH", "")])})
    proc = run([str(link / "bin" / "python"), "-m", "snakemake", "-n", *SMOKE], repo, env=env)
    assert "Nothing to be done" in proc.stdout + proc.stderr, proc.stdout[-3000:]


@pytest.mark.slow
def test_touching_diagnostics_reruns_evaluations_not_training(smoke_local, tmp_path):
    repo = fresh_copy(smoke_local[0], tmp_path / "repo")
    (repo / "src" / "loopscale" / "diagnostics.py").touch()
    c = counts(dry_run(repo))
    n = len(smoke_runs(repo))
    assert c == {"eval": n, "aggregate": 1, "figures": 1, "report": 1, "all": 1}


@pytest.mark.slow
def test_eval_setting_reruns_evaluations_not_training(smoke_local, tmp_path):
    repo = fresh_copy(smoke_local[0], tmp_path / "repo")
    edit_params(repo, lambda p: p["experiments"]["smoke"].__setitem__("eval", {"max_tokens": 2048}))
    c = counts(dry_run(repo))
    assert "train" not in c and "prepare_data" not in c and c["eval"] == len(smoke_runs(repo))


@pytest.mark.slow
def test_a_thread_setting_reruns_nothing(smoke_local, tmp_path):
    """train.threads changes a job's speed, not its result: no run retrains or re-evaluates
    (the job passes its threads to training; RUN/config.yaml does not carry them). Only the
    report, which quotes params.yaml, is rewritten."""
    repo = fresh_copy(smoke_local[0], tmp_path / "repo")
    edit_params(repo, lambda p: p["experiments"]["smoke"]["train"].__setitem__("threads", 2))
    assert set(counts(dry_run(repo))) == {"report", "all"}
    for run in smoke_runs(repo):  # the job's threads reached training (params.yaml: threads 1)
        assert json.loads((run / "loopscale.json").read_text())["config"]["train"]["threads"] == 1


@pytest.mark.slow
def test_adding_a_seed_trains_only_the_new_runs(smoke_local, tmp_path):
    repo = fresh_copy(smoke_local[0], tmp_path / "repo")
    edit_params(repo, lambda p: p["experiments"]["smoke"].__setitem__("seeds", [42, 7]))
    jobs = dry_run(repo)
    trains = [o for r, o in jobs if r == "train"]
    assert len(trains) == 2 and all("/seed7/" in o for o in trains)
    assert all("/seed7/" in o for r, o in jobs if r == "eval")
    assert "prepare_data" not in counts(jobs)


@pytest.mark.slow
def test_changed_condition_reruns_only_it_and_a_divergence_is_recorded(smoke_local, tmp_path):
    """Give one condition an lr that diverges: only its jobs + the aggregates rerun, and the
    grid completes with the divergence in the tables."""
    repo = fresh_copy(smoke_local[0], tmp_path / "repo")
    target = "raw-per_loop-none-residual"

    def edit(p):
        p["experiments"]["smoke"]["conditions"] = [
            {"readout": "rmsnorm", "loss": "per_loop"},
            {"readout": "raw", "loss": "per_loop", "overrides": {"train": {"lr": 1.0e4}}},
        ]
    edit_params(repo, edit)
    jobs = dry_run(repo)
    c = counts(jobs)
    assert c == {"settings": 1, "train": 1, "eval": 1, "aggregate": 1, "figures": 1, "report": 1, "all": 1}
    assert all(target in o for r, o in jobs if r in ("settings", "train", "eval"))

    other = repo / "runs" / "smoke" / "smoke" / "rmsnorm-per_loop-none-residual" / "seed42"
    untouched = tree_digest(other, dirs=(".",))
    smk(repo, "--cores", "2", "--keep-going", *SMOKE)
    summary = json.loads((repo / "runs" / "smoke" / "smoke" / target / "seed42" / "summary.json").read_text())
    assert summary["status"] == "diverged"
    rows = {r["condition_id"]: r["status"] for r in read_table(repo / "results" / "smoke" / "runs.csv")}
    assert rows == {target: "diverged", "rmsnorm-per_loop-none-residual": "completed"}
    assert tree_digest(other, dirs=(".",)) == untouched
    assert dry_run(repo) == []


@pytest.mark.slow
def test_bad_params_fail_fast_and_leave_a_completed_run_byte_identical(smoke_local, tmp_path):
    """An unknown key, a wrong type and an unknown condition value: `snakemake -n` stops
    with one line naming the key, before any job, and no file changes."""
    repo = fresh_copy(smoke_local[0], tmp_path / "repo")
    before = tree_digest(repo)
    good = (repo / "params.yaml").read_text()
    cases = [
        (good.replace("train: {max_steps: 20, threads: 1}", "train: {max_stepz: 20, threads: 1}", 1),  # smoke's
         "params.yaml: unknown key 'experiments.smoke.train.max_stepz'; "
         "did you mean 'experiments.smoke.train.max_steps'?"),
        (good.replace("seeds: [42]\n    conditions: blind_spot", "seeds: [forty-two]\n    conditions: blind_spot", 1),
         "params.yaml: experiments.smoke.seeds[0]: 'forty-two' is not of type 'integer'"),
        (good.replace("  blind_spot:\n    - {readout: rmsnorm, loss: per_loop}\n",
                      "  blind_spot:\n    - {readout: rms, loss: per_loop}\n"),
         "params.yaml: condition_sets.blind_spot[0].readout: unknown value 'rms'; "
         "choose one of " + ", ".join(R.axis_values("readout"))),
    ]
    for text, message in cases:
        assert text != good
        (repo / "params.yaml").write_text(text)
        proc = smk(repo, "-n", *SMOKE, check=False)
        assert proc.returncode != 0
        assert proc.stderr.strip().splitlines() == [f"loopscale pipeline: error: {message}"]
        assert proc.stdout.strip() == ""
        assert tree_digest(repo) == before


# ---------------------------------------------------------------------------
# slow: DVC
# ---------------------------------------------------------------------------
@pytest.mark.slow
def test_dvc_repro_push_pull(smoke_local, tmp_path, record_property):
    """`dvc repro smoke` runs the grid; a second repro is a no-op; a deleted checkpoint is
    retrained; after `dvc push`, a fresh clone's `dvc pull` + `snakemake --touch` needs no
    training, evaluation or data prep."""
    a = copy_worktree(tmp_path / "a")
    t0 = time.monotonic()
    run([DVC, "repro", "smoke"], a)
    record_property("smoke_dvc_repro_s", round(time.monotonic() - t0, 1))
    assert all(json.loads((r / "summary.json").read_text())["status"] == "completed" for r in smoke_runs(a))
    assert_same_tables(a / "results" / "smoke", smoke_local[0] / "results" / "smoke")  # deterministic on CPU

    t0 = time.monotonic()
    out = run([DVC, "repro", "smoke"], a).stdout
    assert "didn't change" in out and time.monotonic() - t0 < 30
    assert dry_run(a) == []

    # a deleted checkpoint: DVC sees runs/smoke changed and its Snakemake retrains the run
    lost = smoke_runs(a)[0] / "model.pt"
    lost.unlink()
    run([DVC, "repro", "smoke"], a)
    assert lost.is_file() and dry_run(a) == []

    git(a, "add", "dvc.lock")
    git(a, "commit", "-q", "-m", "dvc.lock of the smoke stage")
    run([DVC, "push", "smoke"], a)
    assert (tmp_path / "loopscale-dvc-remote").is_dir()  # the default remote: ../loopscale-dvc-remote

    b = tmp_path / "b"
    subprocess.run(["git", "clone", "-q", str(a), str(b)], check=True)
    run([DVC, "pull", "smoke"], b)
    assert len(smoke_runs(b)) == len(smoke_runs(a))
    smk(b, "--touch", "--cores", "1", *SMOKE)
    rules = counts(dry_run(b))
    # data, runs and results come from the remote: nothing is retrained or re-evaluated
    assert not {"prepare_data", "train", "eval"} & set(rules), rules


def test_every_dvc_stage_drives_its_own_experiment():
    """Each DVC stage (the top dvc.yaml and the opt-in files under workflow/dvc/) runs the
    Snakemake grid of an experiment that params.yaml defines, from the repository root,
    depends on that experiment's settings and caches its data, runs and results."""
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    files = [REPO / "dvc.yaml", *sorted((REPO / "workflow" / "dvc").glob("*/dvc.yaml"))]
    seen = set()
    for f in files:
        for name, stage in yaml.safe_load(f.read_text())["stages"].items():
            assert (f.parent / stage.get("wdir", ".")).resolve() == REPO, (f, name)
            if stage["cmd"].startswith("loopscale report "):
                # a cross-experiment report (the drift law): it reads the results of the
                # experiment stages of its file and writes results/<its name>
                assert [next(iter(o)) for o in stage["outs"]] == [f"results/{name}"], (f, name)
                assert all(d.startswith(("src/", "results/")) for d in stage["deps"]), (f, name)
                seen.add(name)
                continue
            exp = re.search(r"--config experiment=(\S+)", stage["cmd"]).group(1)
            assert exp == name and exp in params["experiments"], (f, name)
            assert f"experiments.{exp}" in stage["params"], (f, name)
            assert [next(iter(o)) for o in stage["outs"]] == [f"data/{exp}", f"runs/{exp}", f"results/{exp}"]
            seen.add(exp)
    # every experiment with committed results can be rebuilt through DVC
    assert {d.name for d in (REPO / "results").iterdir() if d.is_dir()} <= seen


def test_the_docs_name_the_dvc_plugin_of_every_remote_type_they_mention():
    """docs/troubleshooting.md: s3:// and ssh:// remotes need DVC plugins that
    requirements.lock does not install; every doc naming such a remote names the plugin."""
    lock = (REPO / "requirements.lock").read_text()
    for doc in [REPO / "README.md", *(REPO / "docs").glob("*.md")]:
        text = doc.read_text()
        for scheme, plugin in (("s3://", "dvc-s3"), ("ssh://", "dvc-ssh")):
            if scheme in text:
                assert f"pip install {plugin}" in text or plugin in lock, (doc.name, scheme)


@pytest.mark.slow
def test_a_killed_snakemake_needs_unlock_before_rerun_incomplete(tmp_path):
    """docs/troubleshooting.md: after a killed snakemake, `--rerun-incomplete` alone is
    refused (the lock stays); `snakemake --unlock` first, then it finishes."""
    import signal
    repo = copy_worktree(tmp_path / "repo")
    target = ("--until", "prepare_data")
    proc = subprocess.Popen([SNAKEMAKE, "--cores", "1", *SMOKE, *target], cwd=repo, env=pipeline_env(repo),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    locks = repo / ".snakemake" / "locks"
    t0 = time.monotonic()
    while not (locks.exists() and any(locks.iterdir())) and time.monotonic() - t0 < 120:
        time.sleep(0.1)
    assert locks.exists() and any(locks.iterdir()), "snakemake never took its lock"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)
    again = smk(repo, "--cores", "1", "--rerun-incomplete", *SMOKE, *target, check=False)
    assert again.returncode != 0 and "unlock" in (again.stdout + again.stderr).lower()
    smk(repo, "--unlock", *SMOKE)
    smk(repo, "--cores", "1", "--rerun-incomplete", *SMOKE, *target)
    assert (repo / "data" / "smoke" / "meta.json").is_file()


def _sigint_as_in_a_shell() -> None:
    """In the child before exec: SIGINT delivered and handled by default, as for a command started
    from a shell, whatever an earlier test in this worker process left behind (an ignored SIGINT
    is inherited through exec, and Python then never raises KeyboardInterrupt)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


@pytest.mark.slow
def test_snakemake_interrupted_alone_never_retrains_a_finished_run(tmp_path):
    """SIGINT to the snakemake process alone (not its group): Snakemake waits for the running
    training job, which finishes, then records it incomplete; `--rerun-incomplete` deletes its
    model.pt and summary.json and reruns it, and the run is put back, not retrained."""
    repo = copy_worktree(tmp_path / "repo")
    edit_params(repo, lambda p: p["experiments"]["smoke"]["train"].update(max_steps=300))
    exps = P.load_and_validate(repo / "params.yaml", SCHEMA, overrides={"experiment": "smoke"})[1]
    run_dir = repo / exps["smoke"].runs[0].dir
    target = str(run_dir.relative_to(repo) / "model.pt")
    proc = subprocess.Popen([SNAKEMAKE, target, "--cores", "1", *SMOKE], cwd=repo, env=pipeline_env(repo),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=_sigint_as_in_a_shell)
    t0 = time.monotonic()
    # the training job is under way: its first log record is written (config.json would be too
    # late: it is the last file a finished run writes)
    while not ((run_dir / "metrics.jsonl").exists() and (run_dir / "metrics.jsonl").stat().st_size):
        assert proc.poll() is None and time.monotonic() - t0 < 300, proc.stdout.read()
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out = proc.communicate(timeout=600)[0]
    assert proc.returncode != 0 and "Terminating processes on user request" in out, out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 300  # the job ran to its end
    model = (run_dir / "model.pt").read_bytes()
    again = smk(repo, target, "--cores", "1", "--rerun-incomplete", *SMOKE)
    assert "ncomplete" in again.stdout + again.stderr  # Snakemake did see it as incomplete
    log = (repo / "logs" / run_dir.relative_to(repo / "runs") / "train.log").read_text()
    assert "kept the finished run" in log and "done:" not in log, log  # restored, not trained again
    assert (run_dir / "model.pt").read_bytes() == model


def test_duplicate_experiment_in_params_stops_the_pipeline_planner(tmp_path):
    from loopscale import pipeline as P
    text = (REPO / "params.yaml").read_text()
    i = text.index("\nexperiments:\n") + len("\nexperiments:\n")
    j = text.index("\n  ", i + 1)  # the first experiment's block, copied once more at the end
    block_end = text.find("\n  ", j + 1)
    while block_end != -1 and text[block_end + 3] == " ":
        block_end = text.find("\n  ", block_end + 1)
    first = text[i:block_end if block_end != -1 else len(text)].rstrip("\n")
    (tmp_path / "params.yaml").write_text(text.rstrip("\n") + "\n" + first + "\n")
    with pytest.raises(P.ParamsError, match="duplicate key"):
        P.load_and_validate(tmp_path / "params.yaml", REPO / "workflow" / "schemas" / "params.schema.yaml")


def test_an_exp_yaml_error_names_exp_yaml(tmp_path):
    from loopscale.pipeline import ParamsError, load_and_validate
    root = Path(__file__).parent.parent
    name = next(iter(json.loads(json.dumps(
        __import__("yaml").safe_load((root / "params.yaml").read_text())))["experiments"]))
    settings = tmp_path / "exp.yaml"
    settings.write_text(f"{name}:\n  train:\n    lr: -1\n")
    with pytest.raises(ParamsError, match="exp.yaml") as e:
        load_and_validate(root / "params.yaml", root / "workflow" / "schemas" / "params.schema.yaml",
                          settings_path=settings)
    assert "train.lr" in str(e.value)
