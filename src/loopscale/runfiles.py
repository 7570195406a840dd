"""The files of a run directory as the loaders meet them: regular files of bounded size.

A run shared on the Hub or copied around is untrusted input. Before `loopscale.hf` or
`loopscale.harness` hands a run to `loopscale.load` (artifacts.py) or transformers, every file
they read must be a regular file (a FIFO would block the reader forever, a link to /dev/zero
would be read until memory runs out) and the JSON files must be small enough to be what they
claim (a run's JSON files are a few kB). Every refusal is one CheckpointError line."""
from __future__ import annotations

import json
import math
import os
import stat
import struct
from pathlib import Path

import torch

from .io import CheckpointError

MAX_JSON_BYTES = 16 * 2**20  # config.json, loopscale.json, tokenizer.json of any loopscale run: far below
# the files a loader of a run reads (name -> what it is); the weights are bounded by their header checks
RUN_FILES = {"config.json": "Hugging Face config", "loopscale.json": "run record", "tokenizer.json": "tokenizer",
             "tokenizer_config.json": "tokenizer config", "special_tokens_map.json": "special tokens map",
             "generation_config.json": "generation config", "model.safetensors": "weights",
             "model.pt": "checkpoint", "eval/halting.json": "halting calibration"}
JSON_FILES = {name for name in RUN_FILES if name.endswith(".json")}
MAX_HEADER_BYTES = 100 * 2**20  # a safetensors header of a loopscale model is a few kB
FLOAT_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}
# integer and bool tensors a model may hold as buffers (the alpha readout's EMA step count,
# TaperNorm's calibration flag); a weight must be float: check_header compares each key's
# dtype with the model's own
INT_DTYPES = {"I64": torch.int64, "BOOL": torch.bool}
DTYPE_BYTES = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8, "I8": 1, "U8": 1, "BOOL": 1, "I16": 2, "U16": 2,
               "I32": 4, "U32": 4, "I64": 8, "U64": 8, "F8_E4M3": 1, "F8_E5M2": 1}


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


def read_safetensors_header(path: Path) -> dict:
    """The header of a safetensors file, read without its tensors and checked for
    consistency: bounded length, every tensor's byte range inside the file and matching
    its dtype and shape. Returns {"__metadata__": {...}, key: {"dtype", "shape", "data_offsets"}}."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path} is truncated or corrupted (no safetensors header)")
        n = struct.unpack("<Q", head)[0]
        if n > min(MAX_HEADER_BYTES, size - 8):
            raise CheckpointError(f"{path} is truncated or corrupted (header length {n} beyond the file)")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CheckpointError(f"{path} is truncated or corrupted (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} is truncated or corrupted (its header is not a JSON object)")
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CheckpointError(f"{path}: its metadata must map names to strings")
    data_bytes = size - 8 - n
    for key, info in header.items():
        if key == "__metadata__":
            continue
        if not (isinstance(info, dict) and isinstance(info.get("dtype"), str) and isinstance(info.get("shape"), list)
                and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in info["shape"])
                and isinstance(info.get("data_offsets"), list) and len(info["data_offsets"]) == 2
                and all(isinstance(o, int) and not isinstance(o, bool) for o in info["data_offsets"])):
            raise CheckpointError(f"{path}: the header entry of {key!r} is malformed")
        if info["dtype"] not in FLOAT_DTYPES and info["dtype"] not in INT_DTYPES:
            raise CheckpointError(f"{path}: {key} is {info['dtype']}, not a float tensor (loopscale weights are float)")
        begin, end = info["data_offsets"]
        if not 0 <= begin <= end <= data_bytes or end - begin != math.prod(info["shape"]) * DTYPE_BYTES[info["dtype"]]:
            raise CheckpointError(f"{path} is truncated or corrupted ({key}'s bytes do not match its shape)")
    return header
