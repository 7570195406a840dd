"""The command line's refusals of bad arguments: `bench`, `generate`, `eval`, `train` and
`prepare-data` (a directory or a broken tokenizer file) stop before any work with exit code 2
and one line naming what is wrong."""
from pathlib import Path

import pytest

from cli_support import one_line_error, run_cli


SMOKE = ["--preset", "smoke", "--set", "train.threads=1", "--set", "train.log_every=5", "--set", "train.ckpt_every=5"]


# ---------------------------------------------------------------------------
# arguments: one line each, before any work
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("args, words", [
    (["--steps", "0"], ["--steps", ">= 1"]),
    (["--steps", "-3"], ["--steps", "-3"]),
    (["--eval-batches", "0"], ["--eval-batches"]),
    (["--eval-warmup", "-2"], ["--eval-warmup"]),
    (["--warmup", "-1"], ["--warmup"]),
    (["--threads", "100000"], ["--threads", "1024"]),
    (["--device", "foo"], ["--device", "'foo'"]),
])
def test_bench_arguments_are_refused_in_one_line(args, words, capsys):
    rc, err = run_cli(capsys, "bench", "--preset", "smoke", "--no-memory", "--no-eval", *args)
    one_line_error(rc, err, *words)


def test_thread_and_seed_bounds_hold_for_every_command(tmp_path, smoke_data, capsys):
    rc, err = run_cli(capsys, "generate", "--run", tmp_path, "--prompt", "the", "--threads", "100000")
    one_line_error(rc, err, "--threads")
    rc, err = run_cli(capsys, "generate", "--run", tmp_path, "--prompt", "the", "--seed", str(2 ** 70))
    one_line_error(rc, err, "--seed")
    rc, err = run_cli(capsys, "generate", "--run", tmp_path, "--prompt", "the", "--device", "foo")
    one_line_error(rc, err, "--device")
    rc, err = run_cli(capsys, "eval", "depth", "--model", tmp_path / "model.pt", "--data", smoke_data,
                      "--out", tmp_path / "d.json", "--threads", "100000")
    one_line_error(rc, err, "--threads")
    rc, err = run_cli(capsys, "train", *SMOKE, "--set", "train.threads=100000", "--data", smoke_data,
                      "--out", tmp_path / "run")
    one_line_error(rc, err, "train.threads")
    assert not (tmp_path / "run").exists()
    rc, err = run_cli(capsys, "train", "--preset", "smoke", "--set", f"train.seed={2 ** 64}", "--data", smoke_data,
                      "--out", tmp_path / "run")
    one_line_error(rc, err, "train.seed")


# ---------------------------------------------------------------------------
# prepare-data: a directory as train_file, a bad --tokenizer
# ---------------------------------------------------------------------------
def _text_files_args(tmp_path, train_file):
    (tmp_path / "valid.txt").write_text("the cat sat on the mat\n" * 20)
    return ["prepare-data", "--preset", "smoke", "--set", "data.source=text-files",
            "--set", f"data.train_file={train_file}", "--set", f"data.validation_file={tmp_path / 'valid.txt'}",
            "--out", tmp_path / "data"]


def test_a_directory_as_train_file_says_so(tmp_path, capsys):
    (tmp_path / "corpus").mkdir()
    rc, err = run_cli(capsys, *_text_files_args(tmp_path, tmp_path / "corpus"))
    one_line_error(rc, err, "is a directory", "data.train_file")


@pytest.mark.parametrize("content", [b"\xff\xfe garbage \x00", b"{not json", b'{"version": "1.0"}'])
def test_prepare_data_with_a_broken_tokenizer_file_is_one_line(tmp_path, capsys, content):
    (tmp_path / "train.txt").write_text("the cat sat on the mat\n" * 50)
    tok = tmp_path / "tokenizer.json"
    tok.write_bytes(content)
    rc, err = run_cli(capsys, *_text_files_args(tmp_path, tmp_path / "train.txt"), "--tokenizer", tok)
    one_line_error(rc, err, str(tok))
    assert not (tmp_path / "data").exists()


def test_prepare_data_with_an_unreadable_tokenizer_file_is_one_line(tmp_path, capsys, monkeypatch):
    (tmp_path / "train.txt").write_text("the cat sat on the mat\n" * 50)
    tok = tmp_path / "tokenizer.json"
    tok.write_text("{}")
    real = Path.read_bytes

    def denied(self):
        if self.name == "tokenizer.json":
            raise PermissionError(13, "Permission denied", str(self))
        return real(self)
    monkeypatch.setattr(Path, "read_bytes", denied)  # as root, chmod 000 would not stop a read
    rc, err = run_cli(capsys, *_text_files_args(tmp_path, tmp_path / "train.txt"), "--tokenizer", tok)
    one_line_error(rc, err, "Permission denied", str(tok))


def test_prepare_data_refuses_a_tokenizer_with_non_contiguous_ids(tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<unk>": 3, "the": 4, "cat": 5, "sat": 9}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    (tmp_path / "train.txt").write_text("the cat sat on the mat\n" * 50)
    tok.save(str(tmp_path / "tok.json"))
    rc, err = run_cli(capsys, *_text_files_args(tmp_path, tmp_path / "train.txt"), "--tokenizer", tmp_path / "tok.json")
    one_line_error(rc, err, "not contiguous", "id 6")
    assert not (tmp_path / "data").exists()
