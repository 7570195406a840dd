"""Reading the repository's git history in tests (pre-registrations must precede results)."""
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def git(*args) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, check=True).stdout.strip()


def history_available() -> bool:
    try:
        return git("rev-parse", "--is-shallow-repository") == "false"
    except (OSError, subprocess.CalledProcessError):
        return False


def first_commit(path: Path) -> str:
    """The commit that first added anything under `path` ('' if none)."""
    out = git("log", "--diff-filter=A", "--format=%H", "--", str(path.relative_to(REPO)))
    return out.splitlines()[-1] if out else ""


def is_ancestor(a: str, b: str) -> bool:
    return subprocess.run(["git", "-C", str(REPO), "merge-base", "--is-ancestor", a, b]).returncode == 0
