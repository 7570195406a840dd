"""The files of a run directory as the loaders meet them: regular files of bounded size.

A run shared on the Hub or copied around is untrusted input. Before `loopscale.hf` or
`loopscale.harness` hands a run to `loopscale.load` (artifacts.py) or transformers, every file
they read must be a regular file (a FIFO would block the reader forever, a link to /dev/zero
would be read until memory runs out) and the JSON files must be small enough to be what they
claim (a run's JSON files are a few kB). Every refusal is one CheckpointError line."""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from .io import CheckpointError

MAX_JSON_BYTES = 16 * 2**20  # config.json, loopscale.json, tokenizer.json of any loopscale run: far below
# the files a loader of a run reads (name -> what it is); the weights are bounded by their header checks
RUN_FILES = {"config.json": "Hugging Face config", "loopscale.json": "run record", "tokenizer.json": "tokenizer",
             "tokenizer_config.json": "tokenizer config", "special_tokens_map.json": "special tokens map",
             "generation_config.json": "generation config", "model.safetensors": "weights",
             "model.pt": "checkpoint", "eval/halting.json": "halting calibration"}
JSON_FILES = {name for name in RUN_FILES if name.endswith(".json")}


def check_regular(path: Path, what: str) -> None:
    """`path`, where it exists, is a regular file (after links); a JSON file is bounded in size."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return  # absent (or a dangling link): the loader says what is missing
    except OSError as e:
        raise CheckpointError(f"{path} cannot be read ({type(e).__name__}): the run's {what}") from None
    if not stat.S_ISREG(st.st_mode):
        kind = ("a directory" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode)
                else "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)
                else "a socket" if stat.S_ISSOCK(st.st_mode) else "not a regular file")
        raise CheckpointError(f"{path} is {kind}, not a regular file: refusing to read it as the run's {what}")
    if path.name.endswith(".json") and st.st_size > MAX_JSON_BYTES:
        raise CheckpointError(f"{path} is {st.st_size} bytes: too large for the run's {what} "
                              f"(at most {MAX_JSON_BYTES})")


def check_run_dir(run: Path) -> None:
    """Every file a loader of the run reads is a regular file of bounded size, and every JSON
    file among them parses (not nested beyond the parser), before a loader reads it (one line)."""
    for name, what in RUN_FILES.items():
        check_regular(run / name, what)
    for name in JSON_FILES:
        if (run / name).exists():
            read_json(run / name, RUN_FILES[name])


def read_json(path: Path, what: str):
    """A run's JSON file: regular, at most MAX_JSON_BYTES read, UTF-8, JSON, not nested beyond
    what the parser can take; each failure one CheckpointError line."""
    check_regular(path, what)
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_JSON_BYTES + 1)
    except OSError as e:
        raise CheckpointError(f"{path} cannot be read ({type(e).__name__}): the run's {what}") from None
    if len(raw) > MAX_JSON_BYTES:
        raise CheckpointError(f"{path} is over {MAX_JSON_BYTES} bytes: too large for the run's {what}")
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise CheckpointError(f"{path} is not UTF-8 text: not the run's {what}") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}): not the run's {what}") from None
    except RecursionError:
        raise CheckpointError(f"{path} is nested too deeply to be the run's {what}") from None
