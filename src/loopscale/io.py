"""Files that survive crashes: atomic writes, safe checkpoint loading, run provenance."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

# torch is imported where it is needed, so the pipeline can use the atomic writers without it


class CheckpointError(RuntimeError):
    """A checkpoint is missing, truncated, corrupted or belongs to another model."""


def _new_file_mode() -> int:
    """The mode open() gives a new file: 0o666 minus the process umask (0o644 under 022)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def atomic_write(path: str | os.PathLike, write) -> Path:
    """Call `write(binary_file)` on a temporary file beside `path`, then rename it over `path`:
    a crash never leaves a truncated file under the final name. The file gets the mode a
    plain open() would give it (mkstemp's 0600 would hide results from collaborators)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, _new_file_mode())
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


def atomic_write_bytes(path, data: bytes) -> Path:
    return atomic_write(path, lambda f: f.write(data))


def atomic_write_text(path, text: str) -> Path:
    return atomic_write_bytes(path, text.encode())


def atomic_write_json(path, obj: Any) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=_jsonable) + "\n")


def _jsonable(o):
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(o, torch.Tensor):
        return o.tolist()
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def atomic_torch_save(path, obj: Any) -> Path:
    import torch
    return atomic_write(path, lambda f: torch.save(obj, f))


def load_checkpoint(path, map_location="cpu") -> dict:
    """Load a checkpoint with weights_only=True (nothing is unpickled beyond tensors and
    plain containers); any failure becomes one CheckpointError naming the file."""
    import torch
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} not found; train the run first (loopscale train)")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # torch raises many kinds for truncated/corrupt/unsafe files
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        if "weights_only" in str(e) or "Unsupported global" in str(e):
            raise CheckpointError(f"checkpoint {path} holds objects that are not plain tensors/containers "
                                  f"and was refused for safety ({first})") from None
        raise CheckpointError(f"checkpoint {path} is truncated or corrupted ({type(e).__name__}: {first}); "
                              f"delete it and rerun to retrain") from None
    if isinstance(ckpt, dict) and ckpt.get("status") == "failed" and "model" not in ckpt:
        raise CheckpointError(f"checkpoint {path} holds no weights: training of this run failed "
                              f"({ckpt.get('error')}); delete it and rerun to retrain")
    if not isinstance(ckpt, dict) or "model" not in ckpt or "config" not in ckpt:
        raise CheckpointError(f"checkpoint {path} is not a loopscale checkpoint (missing model/config)")
    return ckpt


def git_commit(cwd: str | os.PathLike | None = None) -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd or Path(__file__).parent,
                             capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def run_environment(device: str | None = None) -> dict:
    """Provenance recorded with every run."""
    import torch

    from . import __version__
    env = {
        "loopscale": __version__,
        "git_commit": git_commit(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": device,
        "cpu_threads": torch.get_num_threads(),
    }
    if device and device.startswith("cuda") and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    return env
