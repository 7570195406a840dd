"""Write requirements-pipeline.lock: what `pip install loopscale[pipeline]` installs, each at
requirements.lock's version (pip's resolver, constrained by requirements.lock; nothing is
installed). Run from the repository root after changing requirements.lock or the pipeline
extra: `make lock-pipeline`. tests/test_packaging.py checks the two locks agree."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# installed into every venv and left out of a lock, as `pip freeze` does
UNPINNED = {"pip", "setuptools", "wheel", "distribute"}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_lines(path: Path) -> dict:
    """normalised name -> the lock's own line `Name==version`."""
    return {norm(line.split("==", 1)[0]): line.strip() for line in path.read_text().splitlines()
            if "==" in line and not line.startswith("#")}


def main() -> int:
    full = lock_lines(REPO / "requirements.lock")
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--dry-run",
                        "--ignore-installed", "--report", str(report), "-c", str(REPO / "requirements.lock"),
                        f"{REPO}[pipeline]"], check=True)
        names = [i["metadata"]["name"] for i in json.loads(report.read_text())["install"]]
    names = [n for n in names if norm(n) not in UNPINNED | {"loopscale"}]
    missing = [n for n in names if norm(n) not in full]
    if missing:
        print(f"pipeline_lock: not pinned in requirements.lock: {', '.join(missing)}", file=sys.stderr)
        return 1
    lines = sorted((full[norm(n)] for n in names), key=str.lower)
    (REPO / "requirements-pipeline.lock").write_text("\n".join(lines) + "\n")
    print(f"requirements-pipeline.lock: {len(lines)} of requirements.lock's {len(full)} pins")
    return 0


if __name__ == "__main__":
    sys.exit(main())
