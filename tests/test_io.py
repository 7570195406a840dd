"""Writing files when the file system says no (io.py, the trainer's checkpoints): one line,
nothing recorded as a result; atomic writes replace regular files only."""
import errno
import os
import resource
import stat
import subprocess
import sys

import pytest

from loopscale import cli
from loopscale.io import atomic_write_text


SMOKE = ["--preset", "smoke", "--set", "train.max_steps=20", "--set", "train.ckpt_every=10", "-q"]


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_a_symlink_is_written_through(tmp_path):
    target = tmp_path / "real.yaml"
    target.write_text("old\n")
    (tmp_path / "link.yaml").symlink_to(target)
    atomic_write_text(tmp_path / "link.yaml", "new\n")
    assert (tmp_path / "link.yaml").is_symlink() and target.read_text() == "new\n"


@pytest.mark.skipif(os.geteuid() != 0, reason="creating a device node needs root")
def test_a_device_is_written_in_place_not_replaced(tmp_path, capsys):
    full = tmp_path / "full"  # a /dev/full of our own (char device 1:7): every write is ENOSPC
    os.mknod(full, stat.S_IFCHR | 0o666, os.makedev(1, 7))
    rc = cli.main(["config", "--preset", "smoke", "-o", str(full)])
    err = one_line(capsys)
    assert rc == 2 and "No space left on device" in err
    assert stat.S_ISCHR(full.stat().st_mode)
    null = tmp_path / "null"
    os.mknod(null, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    assert cli.main(["config", "--preset", "smoke", "-o", str(null)]) == 0 and stat.S_ISCHR(null.stat().st_mode)


@pytest.mark.parametrize("where", ["a directory", "under a file"])
def test_output_onto_a_directory_or_under_a_file_is_one_line(where, tmp_path, capsys, smoke_data):
    (tmp_path / "file").write_text("x")
    out = tmp_path if where == "a directory" else tmp_path / "file" / "config.yaml"
    assert cli.main(["config", "--preset", "smoke", "-o", str(out)]) == 2
    assert str(out) in one_line(capsys)
    run = tmp_path / "file" if where == "a directory" else tmp_path / "file" / "run"
    assert cli.main(["train", *SMOKE, "--data", str(smoke_data), "--out", str(run)]) == 2
    assert "run directory" in one_line(capsys)
    assert (tmp_path / "file").read_text() == "x"


def test_a_full_disk_during_a_checkpoint_is_not_recorded_as_failed(smoke_data, tmp_path, capsys, monkeypatch):
    from loopscale import train as T
    orig = T.atomic_torch_save

    def save(path, obj):
        if path.name == "state.pt":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        orig(path, obj)
    monkeypatch.setattr(T, "atomic_torch_save", save)
    run = tmp_path / "run"
    rc = cli.main(["train", *SMOKE, "--data", str(smoke_data), "--out", str(run), "--record-failure"])
    err = one_line(capsys)
    assert rc == 2 and "No space left on device" in err and "state.pt" in err
    assert not (run / "summary.json").exists()  # transient: the next attempt trains it


def test_a_file_size_limit_during_a_checkpoint_is_one_line(smoke_data, tmp_path, cli_env):
    """A real limit (RLIMIT_FSIZE): torch.save's own error hides the errno; it is put back."""
    run = tmp_path / "run"

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, 300_000))  # metrics fit, state.pt does not
    proc = subprocess.run([sys.executable, "-m", "loopscale.cli", "train", *SMOKE, "--data", str(smoke_data),
                           "--out", str(run), "--record-failure"], env=cli_env, capture_output=True, text=True,
                          preexec_fn=limit, timeout=300)
    last = proc.stderr.strip().splitlines()[-1]  # after the progress log lines
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert last.startswith("loopscale: error:") and "state.pt: File too large" in last, proc.stderr
    assert not (run / "summary.json").exists() and not list(run.glob(".*.tmp"))


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_read_only_output_directory_is_one_line(tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        assert cli.main(["config", "--preset", "smoke", "-o", str(ro / "c.yaml")]) == 2
        assert "Permission denied" in one_line(capsys)
    finally:
        ro.chmod(0o700)
