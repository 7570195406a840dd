"""Files that survive crashes: atomic writes, safe checkpoint loading, run provenance."""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

# torch is imported where it is needed, so the pipeline can use the atomic writers without it


class CheckpointError(RuntimeError):
    """A checkpoint is missing, truncated, corrupted or belongs to another model."""


def read_text_file(path: str | os.PathLike, name: str, error: type[Exception] = ValueError,
                   max_bytes: int | None = None) -> str:
    """A UTF-8 text file's contents; any problem is one `error` whose message starts with
    `name` (not found / a directory / too large / cannot be read / not UTF-8)."""
    p = Path(path)
    try:
        if p.is_dir():
            raise error(f"{name}: is a directory, not a file")
        if max_bytes is not None and (size := p.stat().st_size) > max_bytes:
            raise error(f"{name}: {size:,} bytes, over the {max_bytes:,} allowed")
        raw = p.read_bytes()
    except FileNotFoundError:
        raise error(f"{name}: file not found") from None
    except OSError as e:
        raise error(f"{name}: cannot be read ({e.strerror or type(e).__name__})") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{name}: not UTF-8 text (byte {e.start})") from None


def _new_file_mode() -> int:
    """The mode open() gives a new file: 0o666 minus the process umask (0o644 under 022)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def atomic_write(path: str | os.PathLike, write) -> Path:
    """Call `write(binary_file)` on a temporary file beside `path`, then rename it over `path`:
    a crash never leaves a truncated file under the final name. The file gets the mode a
    plain open() would give it (mkstemp's 0600 would hide results from collaborators).
    Only regular files are replaced: a symlink is written through to its target, a device or
    a pipe (`-o /dev/stdout`) is written in place."""
    path = Path(path)
    if path.is_symlink():  # write through to the link's target, keep the link
        path = Path(os.path.realpath(path))
    if path.is_dir():
        raise IsADirectoryError(errno.EISDIR, "is a directory, not a file", str(path))
    if path.exists() and not path.is_file():  # a device or a pipe (-o /dev/stdout): written in place
        try:
            with open(path, "wb") as f:
                write(f)
                f.flush()
        except OSError as e:
            raise OSError(e.errno, e.strerror, str(path)) from None
        return path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise NotADirectoryError(errno.ENOTDIR, "lies under a file, not a directory", str(path)) from None
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, _new_file_mode())
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(e, OSError) and e.errno and not e.filename:  # a failed write: name the file
            raise OSError(e.errno, e.strerror or os.strerror(e.errno), str(path)) from None
        raise
    return path


class RunLocked(RuntimeError):
    """Another process holds the lock of a run directory."""


@contextlib.contextmanager
def run_lock(directory: str | os.PathLike, what: str):
    """Hold an exclusive, non-blocking lock on DIR/.lock while the block runs (the `filelock`
    package: flock on POSIX, msvcrt on Windows). A second holder is refused at once with one
    line naming the first (the lock file's text); the lock is released when the block ends and
    dropped by the system when the process exits, however it ends (no stale lock after a kill)."""
    import filelock
    path = Path(directory) / ".lock"
    lock = filelock.FileLock(str(path), timeout=0)
    try:
        lock.acquire()
    except filelock.Timeout:
        try:
            holder = path.read_text(errors="replace").strip()
        except OSError:
            holder = ""
        raise RunLocked(f"{directory} is in use by {holder or 'another process'}; "
                        "wait for it to finish or stop it") from None
    with contextlib.suppress(OSError):  # the holder's name is only a courtesy (Windows may not share it)
        path.write_text(f"{what} (pid {os.getpid()})\n")
    try:
        yield
    finally:
        lock.release(force=True)


# the files that make a directory a loopscale run (what `write_run --force` may replace)
RUN_MARKERS = ("model.pt", "config.json", "loopscale.json", "summary.json", "model.safetensors")


@contextlib.contextmanager
def write_run(directory: str | os.PathLike, what: str, force: bool = False):
    """The run directory a command writes a whole run into (`convert-paper`, `ouro-import`),
    locked for the duration (`run_lock`: a trainer or another writer on it is refused with one
    line). Yields the directory to write into:

      an empty or new directory     itself;
      a run, without `force`        refused (CheckpointError), nothing touched;
      a run, with `force`           a new sibling directory; when the block ends without an
                                    error it takes the run's place in one rename (the old run is
                                    then deleted), and on an error (a full disk, a kill) it is
                                    removed and the old run stays as it was, never a mix."""
    import shutil
    out = Path(directory)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise CheckpointError(f"--out {out} is a file or lies under one; choose another --out") from None
    with run_lock(out, what):
        entries = sorted(p.name for p in out.iterdir() if p.name != ".lock")
        if not entries:
            yield out
            return
        if not force:
            raise CheckpointError(f"{out} already holds a run ({', '.join(entries[:4])}); choose another --out "
                                  f"or pass --force to replace it")
        if not any((out / n).exists() for n in RUN_MARKERS):
            raise CheckpointError(f"{out} is not empty and not a loopscale run; --force replaces runs only")
        for old in out.parent.glob(f".{out.name}.new-*"):  # what a killed replacement left
            if old.is_dir() and not old.is_symlink():
                shutil.rmtree(old, ignore_errors=True)
        stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.new-", dir=out.parent))
        try:
            os.chmod(stage, out.stat().st_mode & 0o7777)
            yield stage
            swap_directories(stage, out)  # stage now holds the old run
        except BaseException:
            shutil.rmtree(stage, ignore_errors=True)
            raise
        shutil.rmtree(stage, ignore_errors=True)


def swap_directories(a: Path, b: Path) -> None:
    """Exchange two directories' names: atomically where the system can (Linux renameat2
    RENAME_EXCHANGE), else by two renames, undoing the first when the second fails."""
    if sys.platform.startswith("linux"):
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        fn = getattr(libc, "renameat2", None)
        if fn is not None:
            at_fdcwd, rename_exchange = -100, 2
            if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
                return
            err = ctypes.get_errno()
            if err not in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
                raise OSError(err, os.strerror(err), str(b))
    aside = a.with_name(a.name + ".old")
    os.rename(b, aside)
    try:
        os.rename(a, b)
    except BaseException:
        os.rename(aside, b)
        raise
    os.rename(aside, a)


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


class _KeepWriteError:
    """A file wrapper that remembers the OSError of a failed write: torch.save turns it into a
    RuntimeError without the errno ("unexpected pos ..."), this puts the real one back."""

    def __init__(self, f):
        self.f, self.error = f, None

    def write(self, b):
        try:
            return self.f.write(b)
        except OSError as e:
            self.error = e
            raise

    def flush(self):
        self.f.flush()


def atomic_torch_save(path, obj: Any) -> Path:
    import torch

    def save(f):
        w = _KeepWriteError(f)
        try:
            torch.save(obj, w)
        except RuntimeError:
            if w.error is not None:  # disk full, file-size limit, ...: the file system's own error
                raise w.error from None
            raise
    return atomic_write(path, save)


def weights_sha256(state: dict) -> str:
    """Content hash of a state dict: every tensor's name, dtype, shape and bytes, in name order."""
    import torch
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous()
        h.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _load_error(path: Path, e: Exception) -> CheckpointError:
    first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
    with open(path, "rb") as f:
        is_zip = f.read(4) == b"PK\x03\x04"  # torch.save's format; anything else is not a checkpoint
    if is_zip and "unsupported global" in str(e).lower():  # a class weights_only will not build
        return CheckpointError(f"checkpoint {path} holds objects that are not plain tensors/containers "
                               f"and was refused for safety ({first})")
    return CheckpointError(f"checkpoint {path} is truncated or corrupted "
                           f"({'not a PyTorch checkpoint file' if not is_zip else f'{type(e).__name__}: {first}'}); "
                           f"delete it and rerun to retrain")


def load_checkpoint(path, map_location="cpu") -> dict:
    """Load a checkpoint with weights_only=True (nothing is unpickled beyond tensors and
    plain containers) and verify its weights: the content hash recorded when it was written
    (`weights_sha256`), and finite values. Any failure is one CheckpointError naming the file."""
    import torch
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} not found; train the run first (loopscale train)")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # torch raises many kinds for truncated/corrupt/unsafe files
        raise _load_error(path, e) from None
    if isinstance(ckpt, dict) and ckpt.get("status") == "failed" and "model" not in ckpt:
        raise CheckpointError(f"checkpoint {path} holds no weights: training of this run failed "
                              f"({ckpt.get('error')}); delete it and rerun to retrain")
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("model"), dict) or "config" not in ckpt:
        raise CheckpointError(f"checkpoint {path} is not a loopscale checkpoint (missing model/config)")
    if not all(isinstance(t, torch.Tensor) for t in ckpt["model"].values()):
        raise CheckpointError(f"checkpoint {path} is not a loopscale checkpoint (its model holds non-tensors)")
    recorded = ckpt.get("weights_sha256")
    if recorded is not None and recorded != weights_sha256(ckpt["model"]):
        raise CheckpointError(f"checkpoint {path} is corrupted: its weights differ from the hash recorded "
                              f"when it was written; delete it and rerun to retrain")
    bad = [k for k, t in ckpt["model"].items() if t.is_floating_point() and not torch.isfinite(t).all()]
    if bad:
        raise CheckpointError(f"checkpoint {path} is corrupted: {bad[0]} holds non-finite weights "
                              f"(training never saves them); delete it and rerun to retrain")
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


# ---------------------------------------------------------------------------
# a job's lifetime: it never outlives its launcher
# ---------------------------------------------------------------------------
PARENT_ENV = "LOOPSCALE_PARENT_PID"  # the launcher's pid, set by the pipeline's train rule ($PPID of its shell)
_watching: list[int] = []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (its own parent has not reaped it yet) is gone too
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def watch_parent(poll_s: float = 0.5) -> None:
    """`--stop-with-parent`: end this process the way a preemption does (SIGTERM: a last state.pt,
    exit 143) when its parent dies, so a pipeline job never outlives a snakemake that was killed
    (even with SIGKILL) and no orphan trainer holds the run's lock. Called first thing in `main`,
    before the heavy imports: the parent is recorded from the first instant, and the launcher's
    pid in $LOOPSCALE_PARENT_PID (the shell's $PPID, which also names snakemake under torchrun)
    catches a parent that died before even that. A daemon thread polls (portable; Linux's
    PR_SET_PDEATHSIG would fire when the parent's *thread* ends, not the process). Idempotent."""
    if _watching:
        return
    parent = os.getppid()
    try:
        launcher = int(os.environ.get(PARENT_ENV, "") or 0)
    except ValueError:
        launcher = 0
    _watching.append(parent)

    def gone() -> bool:
        return os.getppid() != parent or (launcher > 1 and not _alive(launcher))

    def watch():
        while not gone():
            time.sleep(poll_s)
        logging.getLogger("loopscale.train").info("parent process %d ended: stopping as on SIGTERM", parent)
        os.kill(os.getpid(), signal.SIGTERM)
    threading.Thread(target=watch, name="loopscale-parent-watch", daemon=True).start()
