"""The Ouro track in the pipeline: `paper-ouro` plans multi-GPU training jobs under the SLURM
profile (dry run), and `ouro-smoke` trains, evaluates and reports tiny Ouro runs on a CPU, both
as params.yaml has it (the builtin corpus, `loopscale train`) and on the FineWeb path
(train-stream, a second evaluation corpus, downstream through lm-eval)."""
import csv
import json
import math

import pytest

from workflow_support import copy_worktree, smk
from workflow_support import jobs_of


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    return copy_worktree(tmp_path_factory.mktemp("ouro-pipeline") / "repo")


def test_paper_ouro_trains_data_parallel_under_slurm(repo):
    # the profile is quiet: --quiet reason lists each job (its resources and command) again
    out = smk(repo, "--workflow-profile", "slurm", "--config", "experiment=paper-ouro", "-n",
              "--quiet", "reason").stdout
    train = [j for j in jobs_of(out) if j["rule"] == "train"]
    conds = sorted(j["wildcards"]["cond"] for j in train)
    assert conds == sorted(f"{r}-terminal-none-inter_loop_norm"
                           for r in ("rmsnorm", "final_raw", "final_alpha", "per_loop_alpha"))
    assert all(j["resources"]["gpu"] == 4 for j in train)
    assert out.count("torchrun --standalone --nproc-per-node 4 -m loopscale.cli train") == 4
    from loopscale import pipeline as P
    runs = P.build_experiment(P.load_params(repo / "params.yaml"), "paper-ouro").runs
    assert {r.config.model.arch for r in runs} == {"ouro"} and {r.config.model.d_ff for r in runs} == {5632}


@pytest.fixture(scope="module")
def builtin_repo(tmp_path_factory):
    return copy_worktree(tmp_path_factory.mktemp("ouro-builtin") / "repo")


@pytest.mark.slow
def test_ouro_smoke_end_to_end_on_the_builtin_corpus(builtin_repo):
    """The issue's command as it stands, `snakemake --cores 2 --config experiment=ouro-smoke`:
    the builtin corpus with a fitted word-level tokenizer, `loopscale train` (not train-stream)
    for each of the three readouts, the diagnostics, variable depth K = 1..8 on the builtin
    validation split, and a REPORT.md that links appendix_b.md."""
    repo = builtin_repo
    smk(repo, "--cores", "2", "--config", "experiment=ouro-smoke")
    meta = json.loads((repo / "data/ouro-smoke/meta.json").read_text())
    assert meta["source"] == "builtin" and meta["tokens"]["train"] > 0
    assert meta["special_tokens"] == {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<unk>": 3}  # loopscale's fitted tokenizer
    base = repo / "runs/ouro-smoke/ouro-smoke"
    for r in ("rmsnorm", "final_raw", "final_alpha"):
        run = base / f"{r}-terminal-none-inter_loop_norm/seed42"
        summary = json.loads((run / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["total_steps"] == 20  # `loopscale train`'s summary
        assert not (run / "stream.yaml").exists() and "stream_passes" not in summary
        assert json.loads((run / "loopscale.json").read_text())["config"]["model"]["arch"] == "ouro"
        radial = json.loads((run / "eval/radial.json").read_text())
        assert radial["status"] == "ok"
        assert radial["loops"][-1]["readout"] == {"rmsnorm": "rmsnorm", "final_raw": "raw", "final_alpha": "alpha"}[r]
        depth = json.loads((run / "eval/ouro_depth-builtin.json").read_text())
        assert depth["status"] == "ok" and [x["K"] for x in depth["rows"]] == list(range(1, 9))
        assert all(math.isfinite(x["ppl"]) and x["ppl"] > 1 for x in depth["rows"])
        assert not (run / "eval/downstream.json").exists()  # ouro-smoke has no downstream: block
    with open(repo / "results/ouro-smoke/appendix_b.csv") as f:
        table = list(csv.DictReader(f))
    assert {(t["table"], t["data"]) for t in table} == {("variable_depth", "builtin")} and len(table) == 3 * 8
    report = (repo / "results/ouro-smoke/REPORT.md").read_text()
    assert "[appendix_b.md](appendix_b.md)" in report and (repo / "results/ouro-smoke/appendix_b.md").is_file()


def fineweb_params(repo):
    """ouro-smoke on Appendix B's FineWeb path: a local parquet in FineWeb's schema and a tiny
    word-level tokenizer (test_ouro_fineweb's helpers), WikiText from the repository's local
    Salesforce/wikitext fixture as the second corpus, downstream on test_harness's local
    multiple-choice task. Written as a params file beside params.yaml (--config params=...)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import yaml
    from tokenizers import Tokenizer, models, pre_tokenizers

    from hf_support import QUESTIONS, write_mc_task
    from ouro_support import WORDS, fineweb_rows
    fw = repo / "fineweb"
    (fw / "tok").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(fineweb_rows(60)), fw / "000_00000.parquet")
    words = WORDS + sorted({w for q in QUESTIONS for t in [q["question"], *q["choices"]] for w in t.split()})
    tok = Tokenizer(models.WordLevel({"<unk>": 0, **{w: i + 1 for i, w in enumerate(words)}}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(fw / "tok" / "tokenizer.json"))
    write_mc_task(fw)
    params = yaml.safe_load((repo / "params.yaml").read_text())
    exp = params["experiments"]["ouro-smoke"]
    exp["data"] = {"source": "fineweb", "pretrained_tokenizer": "fineweb/tok", "data_files": ["fineweb/000_00000.parquet"],
                   "heldout_documents": 12, "eval_corpus": "wikitext-103",
                   "hf_dataset": "tests/fixtures/official/corpus/hf"}
    exp["stream"] = {"shuffle_buffer": 16, "warmup_steps": 2}
    exp["downstream"] = {"tasks": ["ls_mc"], "loops": [2, 4], "include_path": str(fw), "per_token_norm": True}
    (repo / "params-fineweb.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    return "params-fineweb.yaml"


@pytest.mark.slow
def test_ouro_smoke_end_to_end_on_fineweb(repo):
    """ouro-smoke through every stage on the FineWeb path: prepare-data writes the held-out
    documents and WikiText with the pretrained tokenizer, train-stream trains each readout on
    the stream without them, ouro_depth evaluates K = 1..8 on both corpora, downstream runs
    lm-eval, and appendix_b.csv holds both tables with the paper column "not reported"."""
    params = fineweb_params(repo)
    smk(repo, "--cores", "2", "--config", f"params={params}", "experiment=ouro-smoke")
    meta = json.loads((repo / "data/ouro-smoke/meta.json").read_text())
    assert meta["tokens"]["train"] == 0 and meta["tokens"]["validation"] > 0 and meta["eval_corpus"]["name"] == "wikitext-103"
    assert json.loads((repo / "data/ouro-smoke/wikitext-103/meta.json").read_text())["tokens"]["validation"] > 0
    with open(repo / "results/ouro-smoke/main.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 3
    base = repo / "runs/ouro-smoke/ouro-smoke"
    for r in ("rmsnorm", "final_raw", "final_alpha"):
        run = base / f"{r}-terminal-none-inter_loop_norm/seed42"
        summary = json.loads((run / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["steps"] == 20
        assert "stream_passes" in summary and (run / "stream.yaml").is_file()  # trained by train-stream
        radial = json.loads((run / "eval/radial.json").read_text())
        assert radial["status"] == "ok"
        assert radial["loops"][-1]["readout"] == {"rmsnorm": "rmsnorm", "final_raw": "raw", "final_alpha": "alpha"}[r]
        for corpus in ("fineweb", "wikitext-103"):
            depth = json.loads((run / f"eval/ouro_depth-{corpus}.json").read_text())
            assert depth["status"] == "ok" and [x["K"] for x in depth["rows"]] == list(range(1, 9))
        down = json.loads((run / "eval/downstream.json").read_text())
        assert [(x["task"], x["loops"]) for x in down["rows"]] == [("ls_mc", 2), ("ls_mc", 4)]
        assert all(0 <= x["acc"] <= 1 and "acc_norm_token" in x for x in down["rows"])
    with open(repo / "results/ouro-smoke/appendix_b.csv") as f:
        table = list(csv.DictReader(f))
    depth_rows = [t for t in table if t["table"] == "variable_depth"]
    assert {t["data"] for t in depth_rows} == {"fineweb", "wikitext-103"} and len(depth_rows) == 3 * 2 * 8
    assert {(t["data"], t["metric"]) for t in table if t["table"] == "downstream"} == \
        {("ls_mc", m) for m in ("acc", "acc_norm", "acc_norm_token")}
    assert {t["paper"] for t in table} == {"not reported"}
    assert (repo / "results/ouro-smoke/appendix_b.md").is_file()
    assert "[appendix_b.md](appendix_b.md)" in (repo / "results/ouro-smoke/REPORT.md").read_text()


@pytest.mark.parametrize("edit, message", [
    ({"data": {"heldout_documents": 0}}, r"data\.heldout_documents must be >= 2 with data\.source=fineweb"),
    ({"data": {"eval_corpus": "wikitext-7"}}, r"data\.eval_corpus: unknown value 'wikitext-7'"),
    ({"data": {"pretrained_tokenizer": None}}, r"data\.pretrained_tokenizer is required"),
    ({"stream": {"tokenizer": "x"}}, r"unknown key 'experiments\.paper-ouro\.stream\.tokenizer'"),
    ({"stream": {"warmup_steps": -1}}, r"experiments\.paper-ouro\.stream\.warmup_steps: -1 is less than"),
    ({"downstream": {"loops": [4]}}, r"experiments\.paper-ouro\.downstream\.tasks: required key is missing"),
    ({"downstream": {"tasks": ["piqa"], "limit": -2}}, r"downstream\.limit: -2 is less than the minimum"),
    ({"downstream": {"tasks": ["pi qa"]}}, r"downstream\.tasks: task name 'pi qa' must match"),
])
def test_bad_fineweb_and_downstream_settings_are_one_line_errors(tmp_path, edit, message):
    """The new keys of a FineWeb/Ouro experiment are checked before any job: one line naming the key."""
    import re

    import yaml

    from loopscale import pipeline as P
    from workflow_support import REPO
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    exp = params["experiments"]["paper-ouro"]
    for k, v in edit.items():
        exp[k] = {**exp.get(k, {}), **v} if k == "data" else v
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    with pytest.raises(P.ParamsError) as e:
        P.load_and_validate(tmp_path / "params.yaml", REPO / "workflow/schemas/params.schema.yaml")
    assert re.search(message, str(e.value)) and len(str(e.value).splitlines()) == 1, str(e.value)


def test_other_experiments_configs_carry_no_fineweb_keys():
    """The data.source=fineweb keys are left out of written configs at their defaults, so the
    files of every other experiment (and so its runs) stay as they were."""
    from loopscale import pipeline as P
    from loopscale.config import FINEWEB_KEYS
    from workflow_support import REPO
    params = P.load_params(REPO / "params.yaml")
    run = P.build_experiment(params, "cpu").runs[0]
    text = P.config_texts(run)[0]
    assert not any(f"{k}:" in text for k in FINEWEB_KEYS)
    ouro = P.build_experiment(params, "paper-ouro").runs[0]
    assert "heldout_documents: 2000" in P.config_texts(ouro)[0] and ouro.stream["heldout_documents"] == 2000
