"""Files written through loopscale.io keep the process umask, like a plain open() (shared
storage: collaborators must be able to read results)."""
import os
import stat

import pytest

from loopscale import io


@pytest.fixture
def umask():
    old = os.umask(0o022)
    yield lambda m: os.umask(m)
    os.umask(old)


@pytest.mark.parametrize("mask,mode", [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_atomic_write_mode_follows_umask(tmp_path, umask, mask, mode):
    umask(mask)
    path = io.atomic_write_json(tmp_path / "sub" / "summary.json", {"status": "completed"})
    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    assert stat.S_IMODE(path.stat().st_mode) == mode == stat.S_IMODE(plain.stat().st_mode)


def test_overwrite_gets_umask_mode(tmp_path, umask):
    path = tmp_path / "table.csv"
    path.write_text("old")
    path.chmod(0o600)
    io.atomic_write_text(path, "new")
    assert path.read_text() == "new"
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
