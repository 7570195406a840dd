"""Rewrite the generated end of workflow/schemas/params.schema.yaml: the JSON schema of the run
settings (loopscale.config.settings_schemas, read from the dataclasses' annotations), one line
per setting, after the marker line. Run it after a config field changes:

    python tools/settings_schema.py          # rewrite the file
    python tools/settings_schema.py --check  # exit 1 if the committed file is stale (a test runs this)
"""
import math
import sys
from pathlib import Path

import yaml

from loopscale.config import settings_schemas

SCHEMA = Path(__file__).resolve().parents[1] / "workflow" / "schemas" / "params.schema.yaml"
MARKER = "\n  # ---- generated from loopscale.config (tools/settings_schema.py); do not edit below ----\n"


def generated() -> str:
    """The `$defs` entries that end params.schema.yaml, the marker first."""
    def flow(x) -> str:
        return yaml.safe_dump(x, default_flow_style=True, sort_keys=False, width=math.inf).strip()

    lines = [MARKER.rstrip("\n")]
    for name, s in settings_schemas().items():
        lines += [f"  {name}:", f"    type: {s['type']}", "    additionalProperties: false", "    properties:"]
        lines += [f"      {key}: {flow(p)}" for key, p in s["properties"].items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    text = SCHEMA.read_text()
    new = text.split(MARKER)[0] + generated()
    if "--check" in argv:
        if new != text:
            print(f"{SCHEMA} is stale: run python tools/settings_schema.py", file=sys.stderr)
        return int(new != text)
    SCHEMA.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
