"""Rewrite the generated end of workflow/schemas/params.schema.yaml (the settings sections'
JSON schema, from loopscale.config's dataclasses) after a config field changes:

    python tools/settings_schema.py          # rewrite it
    python tools/settings_schema.py --check  # exit 1 if the committed file is stale

tests/test_settings.py checks the committed file is what this writes."""
import sys
from pathlib import Path

from loopscale.config import SCHEMA_MARKER, settings_schema_yaml

SCHEMA = Path(__file__).resolve().parents[1] / "workflow" / "schemas" / "params.schema.yaml"


def main(argv: list[str]) -> int:
    text = SCHEMA.read_text()
    hand = text.split(SCHEMA_MARKER)[0]
    new = hand + settings_schema_yaml()
    if "--check" in argv:
        if new != text:
            print(f"{SCHEMA} is stale: run python tools/settings_schema.py", file=sys.stderr)
            return 1
        return 0
    SCHEMA.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
