"""Result file of a diagnostic for a run that has no model to evaluate.

    python workflow/scripts/unevaluated.py DIAGNOSTIC RUN/summary.json RUN/eval/DIAGNOSTIC.json

Training with --record-failure turns a crash into summary.json status "failed" and leaves
no model.pt. The evaluation rules then call this script instead of `loopscale eval`, so
the grid completes and the tables show the failure. It refuses (exit 1) when the summary
does not say "failed": then model.pt is missing for another reason, and that is an error.
Standard library only (no torch import): it runs in milliseconds.
"""
import json
import os
import sys
import tempfile


def main(argv):
    if len(argv) != 3:
        sys.stderr.write(__doc__)
        return 2
    diagnostic, summary_path, out = argv
    with open(summary_path) as f:
        summary = json.load(f)
    status = summary.get("status")
    if status != "failed":
        run = os.path.dirname(summary_path) or "."
        sys.stderr.write(f"unevaluated.py: {run}/model.pt is missing but {summary_path} says status {status!r}; "
                         f"delete {summary_path} to retrain the run\n")
        return 1
    result = {"diagnostic": diagnostic, "status": "failed", "tokens": 0,
              "note": "training failed; nothing was evaluated", "error": summary.get("error")}
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(out)}.", suffix=".tmp", dir=os.path.dirname(out) or ".")
    with os.fdopen(fd, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    os.replace(tmp, out)
    print(json.dumps({"diagnostic": diagnostic, "status": "failed"}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
