"""Shared by the conversion tests (test_convert): an official checkpoint
edited one field at a time, and the one-line refusal `loopscale convert-paper` must give.
A helper module, not a test file."""
from __future__ import annotations

import copy

import torch

from loopscale.cli import main
from official import CHECKPOINTS, OFFICIAL as FIX


def _refused(tmp_path, capsys, ckpt_obj, needle: str, extra=()) -> str:
    path = tmp_path / "bad.pt"
    if isinstance(ckpt_obj, bytes):
        path.write_bytes(ckpt_obj)
    elif ckpt_obj is not None:
        torch.save(ckpt_obj, path)
    capsys.readouterr()
    assert main(["convert-paper", str(path), "--out", str(tmp_path / "run"), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
    assert not (tmp_path / "run").exists()
    return err[0]


def _with(mutate, name="perstep_norm"):
    ck = copy.deepcopy(_base(name))
    mutate(ck)
    return ck


def _set(section, key, value):
    """Set config[section][key] to `value`, or to value(ck) where it is a function of the
    checkpoint (a wrong value made from the real one, so it differs in every fixture set)."""
    return lambda ck: ck["config"].setdefault(section, {}).__setitem__(key, value(ck) if callable(value) else value)


def _base(name: str = "perstep_norm") -> dict:
    p = FIX / name / "last.pt"
    return torch.load(p if p.exists() else CHECKPOINTS[0], weights_only=True)
