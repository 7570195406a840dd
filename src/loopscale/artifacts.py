"""A trained run as a self-contained artifact, and `loopscale.load(run_dir)`.

A finished run directory holds, besides the training logs:

  model.safetensors        the weights (safetensors: no pickle, byte-reproducible); the LM head
                           is tied to the token embedding, so it is stored once, as `tok_emb.weight`.
                           Metadata: format, weights_sha256, config_fingerprint
  loopscale.json           the run record: {"config": the resolved run config, "env": provenance,
                           "data": vocabulary and tokenizer hash}
  config.json              a Hugging Face config (model_type "loopscale", architectures, auto_map,
                           the model settings, n_loops) and the hashes of the three files above
  modeling_loopscale.py    remote code for `AutoModelForCausalLM.from_pretrained(RUN, trust_remote_code=True)`
                           (a two-line shim importing loopscale.hf)
  tokenizer.json           the run's tokenizer (a copy of its data directory's)
  tokenizer_config.json    what `transformers.PreTrainedTokenizerFast.from_pretrained(RUN)`
  special_tokens_map.json  reads: pad/bos/eos/unk tokens, model_max_length (= seq_len)
  model.pt                 the torch checkpoint (training resumes and older readers use it)

Runs written before loopscale.json existed keep the run record in config.json
({"config", "env", "data"}); `load` reads both layouts, `loopscale export RUN` rewrites an
older run in the current one.

`load` trusts nothing it reads (every failure is one CheckpointError line, never a result):
the safetensors header is read first (bounded, without the tensors) and compared with the
config before a model is built; sizes beyond `LIMITS` are refused; tensors must be float and
finite; the weights hash, the config fingerprint and the tokenizer hash recorded at writing
are verified; config.json and model.pt, where present, must agree with the run record.
"""
from __future__ import annotations

import hashlib
import json
import math
import struct
from pathlib import Path
from typing import Optional

import torch
from safetensors import safe_open
from safetensors.torch import save as st_save
from tokenizers import Tokenizer

from .config import LIMITS as SIZE_LIMITS
from .config import ModelConfig, RunConfig
from .io import CheckpointError, atomic_write_bytes, atomic_write_json, atomic_write_text, weights_sha256
from .model import LoopedLM
from .ouro import OuroLM

WEIGHTS = "model.safetensors"
RECORD = "loopscale.json"  # the run record (config, env, data); config.json before this layout
HF_CONFIG = "config.json"  # the Hugging Face config
MODELING = "modeling_loopscale.py"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
HF_MODEL_TYPE = "loopscale"
HF_ARCHITECTURE = "LoopscaleForCausalLM"
# special-token roles of PreTrainedTokenizerFast and the names a tokenizer may give them
# (loopscale's own: ids 0..3 = <pad> <bos> <eos> <unk>, data.SPECIAL_TOKENS)
ROLES = {"pad_token": ("<pad>", "[PAD]", "<|pad|>"),
         "bos_token": ("<bos>", "<s>", "[BOS]", "<|startoftext|>"),
         "eos_token": ("<eos>", "</s>", "[EOS]", "<|endoftext|>"),
         "unk_token": ("<unk>", "[UNK]", "<|unk|>")}
# the largest model settings a run directory may declare (far beyond the paper's 1.4B:
# d2048, 20 layers, K=4); a hostile config.json is refused before anything is allocated
# (the model rows of config.LIMITS, the one table of limits)
LIMITS = {k: SIZE_LIMITS[k] for k in ("vocab_size", "d_model", "d_ff", "seq_len", "n_layers", "n_heads", "n_loops")}
MAX_HEADER_BYTES = 100 * 2**20  # a safetensors header of a loopscale model is a few kB
FLOAT_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}
# integer and bool tensors a model may hold as buffers (the alpha readout's EMA step count,
# TaperNorm's calibration flag); a weight must be float: check_header compares each key's
# dtype with the model's own
INT_DTYPES = {"I64": torch.int64, "BOOL": torch.bool}
DTYPE_BYTES = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8, "I8": 1, "U8": 1, "BOOL": 1, "I16": 2, "U16": 2,
               "I32": 4, "U32": 4, "I64": 8, "U64": 8, "F8_E4M3": 1, "F8_E5M2": 1}
# model architectures a run record may name (`arch`, default "looped": loopscale.model.LoopedLM)
ARCHS = {"looped": LoopedLM, "ouro": OuroLM}  # model.arch

MODELING_SOURCE = '''"""Remote code of a loopscale run for Hugging Face transformers.

AutoModelForCausalLM.from_pretrained(RUN, trust_remote_code=True) imports these classes; they
live in the loopscale package (pip install "loopscale[hf]"), which verifies the run's files.
"""
from loopscale.hf import LoopscaleConfig, LoopscaleForCausalLM  # noqa: F401
'''


def config_fingerprint(config: dict) -> str:
    """sha256 of a run config dict as stored (key order free): what the artifact records."""
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()


# ---------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------
def save_weights(path: str | Path, model: LoopedLM, config_fp: Optional[str] = None) -> Path:
    """The model's state dict as safetensors (atomic). Metadata: format, the weights hash
    (`io.weights_sha256`) and the run config's fingerprint; step and status are in
    summary.json and model.pt (the file stays byte-reproducible)."""
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    meta = {"format": "pt", "weights_sha256": weights_sha256(tensors)}
    if config_fp:
        meta["config_fingerprint"] = config_fp
    return atomic_write_bytes(path, _canonical(st_save(tensors, metadata=meta)))


def _canonical(blob: bytes) -> bytes:
    """safetensors bytes with the metadata keys in sorted order (the library writes them in
    hash-map order, which varies between processes): the same weights give the same file."""
    n = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8:8 + n])
    header["__metadata__"] = dict(sorted(header.get("__metadata__", {}).items()))
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the format aligns the data to 8 bytes
    return struct.pack("<Q", len(text)) + text + blob[8 + n:]


def tokenizer_metadata(tok: Tokenizer, model_max_length: int) -> tuple[dict, dict]:
    """(tokenizer_config.json, special_tokens_map.json) for a `tokenizers.Tokenizer`."""
    vocab = tok.get_vocab(with_added_tokens=True)
    roles = {role: next((n for n in names if n in vocab), None) for role, names in ROLES.items()}
    roles = {r: n for r, n in roles.items() if n is not None}
    decoder = {str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized,
                        "rstrip": t.rstrip, "single_word": t.single_word, "special": t.special}
               for i, t in sorted(tok.get_added_tokens_decoder().items())}
    # the paper's tokenizer (data.tokenization=paper) keeps its specials as plain vocabulary
    # (a literal "<unk>" in text is three pieces, as in the official code): list them too
    for name in roles.values():
        decoder.setdefault(str(vocab[name]), {"content": name, "lstrip": False, "normalized": False,
                                              "rstrip": False, "single_word": False, "special": True})
    decoder = dict(sorted(decoder.items(), key=lambda kv: int(kv[0])))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model_max_length,
              "clean_up_tokenization_spaces": False, "add_bos_token": False, "add_eos_token": False,
              **roles, "added_tokens_decoder": decoder}
    return config, dict(roles)


def parse_tokenizer(text: bytes, where: str | Path) -> Tokenizer:
    """A `tokenizers.Tokenizer` from tokenizer.json bytes, or one CheckpointError line."""
    try:
        return Tokenizer.from_str(text.decode("utf-8"))
    except UnicodeDecodeError:
        raise CheckpointError(f"{where} is not UTF-8 text: not a tokenizers JSON file") from None
    except Exception as e:  # tokenizers raises its own exception kinds for bad JSON/schema
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:120]
        raise CheckpointError(f"{where} is not a valid tokenizers JSON file ({first})") from None


def write_tokenizer(run_dir: str | Path, tokenizer_json: bytes, model_max_length: int) -> None:
    """tokenizer.json plus the PreTrainedTokenizerFast metadata files."""
    run = Path(run_dir)
    tok = parse_tokenizer(tokenizer_json, "the tokenizer")
    config, special = tokenizer_metadata(tok, model_max_length)
    atomic_write_bytes(run / "tokenizer.json", tokenizer_json)
    atomic_write_json(run / "tokenizer_config.json", config)
    atomic_write_json(run / "special_tokens_map.json", special)


def role_token_ids(tok: Optional[Tokenizer]) -> dict:
    """config.json's bos/eos/pad token ids: those of the tokens `tokenizer_metadata` gives these
    roles in the run's tokenizer (None where it has no such token: the Ouro tokenizer has an
    end-of-text token only); without a tokenizer, loopscale's own ids 1, 2, 0."""
    if tok is None:
        return {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    vocab = tok.get_vocab(with_added_tokens=True)
    roles = tokenizer_metadata(tok, 0)[1]
    return {f"{r}_token_id": vocab[roles[f"{r}_token"]] if f"{r}_token" in roles else None for r in ("bos", "eos", "pad")}


def hf_config(record: dict, weights_hash: str, tokenizer_hash: Optional[str],
              token_ids: Optional[dict] = None) -> dict:
    """config.json: a Hugging Face config of the run's model (loopscale.hf.LoopscaleConfig);
    `token_ids`: `role_token_ids` of its tokenizer (default: loopscale's own)."""
    m = record["config"]["model"]
    from . import __version__
    return {"model_type": HF_MODEL_TYPE, "architectures": [HF_ARCHITECTURE],
            "auto_map": {"AutoConfig": f"{MODELING[:-3]}.LoopscaleConfig",
                         "AutoModelForCausalLM": f"{MODELING[:-3]}.{HF_ARCHITECTURE}"},
            "arch": record.get("arch", "looped"), **m,
            **(token_ids or role_token_ids(None)), "tie_word_embeddings": True,
            "dtype": "float32",
            "loopscale": {"version": __version__, "record": RECORD,
                          "config_fingerprint": config_fingerprint(record["config"]),
                          "weights_sha256": weights_hash, "tokenizer_sha256": tokenizer_hash}}


def write_run_files(run_dir: str | Path, model: LoopedLM, record: dict, tokenizer_json: Optional[bytes]) -> None:
    """Every artifact file of a run from its model and record ({"config", "env", "data"}):
    the tokenizer files, loopscale.json, model.safetensors, modeling_loopscale.py, and
    config.json last (its presence marks a complete artifact)."""
    run = Path(run_dir)
    seq_len = record["config"]["model"]["seq_len"]
    tok_hash, token_ids = None, None
    if tokenizer_json is not None:
        write_tokenizer(run, tokenizer_json, seq_len)
        token_ids = role_token_ids(parse_tokenizer(tokenizer_json, "the tokenizer"))
        tok_hash = hashlib.sha256(tokenizer_json).hexdigest()
        record = {**record, "data": {**(record.get("data") or {}), "tokenizer_sha256": tok_hash}}
    atomic_write_json(run / RECORD, record)
    fp = config_fingerprint(record["config"])
    save_weights(run / WEIGHTS, model, fp)
    state = {k: v.detach().to("cpu") for k, v in model.state_dict().items()}
    atomic_write_text(run / MODELING, MODELING_SOURCE)
    atomic_write_json(run / HF_CONFIG, hf_config(record, weights_sha256(state), tok_hash, token_ids))


def write_artifacts(run_dir: str | Path, model: LoopedLM, cfg: RunConfig, data_dir: Optional[str | Path]) -> None:
    """End of training: the artifact files; the run record is the one training wrote
    (loopscale.json, or config.json in the older layout), else one built from `cfg`."""
    run = Path(run_dir)
    record = _existing_record(run)
    if record is None or record.get("config") != cfg.to_dict():
        record = {"config": cfg.to_dict(), "env": (record or {}).get("env") or {}, "data": (record or {}).get("data") or {}}
    tok = Path(data_dir) / "tokenizer.json" if data_dir is not None else None
    text = tok.read_bytes() if tok is not None and tok.is_file() else None
    write_run_files(run, model, record, text)


def _existing_record(run: Path) -> Optional[dict]:
    try:
        return read_record(run)[0]
    except CheckpointError:
        return None


def export_run(run_dir: str | Path, data_dir: Optional[str | Path] = None) -> list[str]:
    """Write a trained run's artifact files from its model.pt; returns the files written.

    The run record is loopscale.json, an older config.json, or else model.pt's own (config and
    data record). The tokenizer comes from `data_dir` (or the run's own tokenizer.json) and must
    match the tokenizer hash recorded; everything is checked before any file is written."""
    run = Path(run_dir)
    model_pt = run / "model.pt"
    if not model_pt.is_file():
        raise CheckpointError(f"{model_pt} not found: {run} is not a finished loopscale run")
    from .evaluate import load_model
    model, cfg, ckpt = load_model(model_pt)
    record = _existing_record(run)
    if record is not None:
        _same_model(_run_config(record["config"], run / RECORD).model, cfg.model, run / RECORD, model_pt)
    ck_data = ckpt.get("data") if isinstance(ckpt.get("data"), dict) else {}
    if record is None:
        record = {"config": cfg.to_dict(), "env": {}, "data": dict(ck_data)}
    src = Path(data_dir) / "tokenizer.json" if data_dir is not None else run / "tokenizer.json"
    if not src.is_file():
        raise FileNotFoundError(f"no tokenizer at {src}: give the run's data directory "
                                f"(loopscale export {run} --data DATA)")
    text = src.read_bytes()
    have = hashlib.sha256(text).hexdigest()
    for want, where in (((record.get("data") or {}).get("tokenizer_sha256"), "the run record"),
                        (ck_data.get("tokenizer_sha256"), "model.pt")):
        if want and have != want:
            raise CheckpointError(f"{src} is not the tokenizer {run} was trained with (sha256 differs from "
                                  f"the data.tokenizer_sha256 {where} recorded); give the run's own data directory")
    tok = parse_tokenizer(text, src)
    if tok.get_vocab_size(with_added_tokens=True) > cfg.model.vocab_size:
        raise CheckpointError(f"{src} has {tok.get_vocab_size(with_added_tokens=True)} ids but the model's "
                              f"embedding only {cfg.model.vocab_size}; give the run's own data directory")
    from .io import run_lock
    with run_lock(run, "loopscale export"):  # never beside a trainer or another writer of the run
        write_run_files(run, model, record, text)
    return [RECORD, WEIGHTS, MODELING, HF_CONFIG, *TOKENIZER_FILES]


# ---------------------------------------------------------------------------
# reading: every check is one CheckpointError line
# ---------------------------------------------------------------------------
def read_json_file(path: Path, what: str) -> object:
    """A JSON file's value; missing, unreadable, non-UTF-8 or malformed is one line."""
    if path.is_dir():
        raise CheckpointError(f"{path} is a directory, not the run's {what}")
    try:
        if path.stat().st_size > MAX_HEADER_BYTES:
            raise CheckpointError(f"{path} is {path.stat().st_size} bytes: too large for the run's {what}")
        return json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise CheckpointError(f"{path} is not UTF-8 text: not the run's {what}") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}): not the run's {what}") from None
    except RecursionError:
        raise CheckpointError(f"{path} is nested too deeply to be the run's {what}") from None
    except OSError as e:
        raise CheckpointError(f"{path} cannot be read ({type(e).__name__}): the run's {what}") from None


def read_record(run_dir: str | Path) -> tuple[dict, Path]:
    """(the run record {"config", "env", "data"}, the file it came from): loopscale.json, or
    config.json in the older layout. Raises CheckpointError when there is none or it is malformed."""
    run = Path(run_dir)
    for path in (run / RECORD, run / HF_CONFIG):
        if not path.exists():
            continue
        rec = read_json_file(path, "run record")
        if path.name == HF_CONFIG and isinstance(rec, dict) and "config" not in rec:
            continue  # a Hugging Face config: the record is in loopscale.json
        if not isinstance(rec, dict) or not isinstance(rec.get("config"), dict):
            raise CheckpointError(f"{path} holds no run config (a JSON object with a 'config' object)")
        if not isinstance(rec.get("data", {}), (dict, type(None))):
            raise CheckpointError(f"{path}: 'data' must be an object")
        return rec, path
    raise CheckpointError(f"{run} has no {RECORD} (nor an older-layout {HF_CONFIG}): it holds the run's config")


def _run_config(d: dict, where: Path) -> RunConfig:
    model = d.get("model")
    if isinstance(model, dict):  # bounds first: a hostile size never reaches a constructor
        check_limits(model, where)
    try:
        return RunConfig.from_checkpoint(d)  # drops the `eval` of older runs
    except Exception as e:
        raise CheckpointError(f"{where} carries an invalid config: {str(e).splitlines()[0][:200]}") from None


def check_limits(model: dict, where) -> None:
    """Refuse model sizes beyond `LIMITS` (one line) before anything is built."""
    for key, hi in LIMITS.items():
        v = model.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and (not math.isfinite(v) or v > hi):
            raise CheckpointError(f"{where}: model.{key}={v!r} is beyond what loopscale loads (at most {hi})")


def _same_model(a: ModelConfig, b: ModelConfig, where_a, where_b) -> None:
    for key in ModelConfig.__dataclass_fields__:
        va, vb = getattr(a, key), getattr(b, key)
        if va != vb:
            raise CheckpointError(f"{where_a} says model.{key}={va!r} but {where_b} holds {vb!r}: "
                                  f"the run's files disagree (edited or mixed); re-export the run")


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


def expected_shapes(m: ModelConfig) -> dict[str, tuple]:
    """Every tensor of LoopedLM(m) with its shape, from a meta-device model (no memory)."""
    return {k: shape for k, (shape, _) in expected_tensors(m).items()}


def expected_tensors(m: ModelConfig) -> dict[str, tuple]:
    """Every tensor of LoopedLM(m): (shape, dtype), from a meta-device model (no memory)."""
    with torch.device("meta"):
        model = ARCHS[m.arch](m)
    return {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}


def check_header(header: dict, m: ModelConfig, path: Path, cfg_path: Path) -> None:
    """The safetensors header against the config, before the model is built: the sizes
    visible in the weights first (cheap), then every key and shape."""
    shapes = {k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"}
    visible = {"vocab_size": ("tok_emb.weight", 0), "d_model": ("tok_emb.weight", 1),
               "seq_len": ("pos_emb.weight", 0), "d_ff": ("blocks.0.mlp.down.weight", 1)}
    blocks = "blocks."
    if m.arch == "ouro":  # the published Ouro names (loopscale.ouro); no position table
        visible = {"vocab_size": ("model.embed_tokens.weight", 0), "d_model": ("model.embed_tokens.weight", 1),
                   "d_ff": ("model.layers.0.mlp.down_proj.weight", 1)}
        blocks = "model.layers."
    for key, (name, axis) in visible.items():
        if name not in shapes or len(shapes[name]) != 2:
            raise CheckpointError(f"{path} has no 2-d {name}: not the weights of a loopscale model")
        if shapes[name][axis] != getattr(m, key):
            raise CheckpointError(f"{cfg_path} says model.{key}={getattr(m, key)} but {path} holds "
                                  f"{name} of shape {list(shapes[name])}")
    depth = blocks.count(".")  # the index of the layer number in a tensor name
    layers = {int(k.split(".")[depth]) for k in shapes
              if k.startswith(blocks) and k.split(".")[depth].isdigit()}
    if len(layers) != m.n_layers:
        raise CheckpointError(f"{cfg_path} says model.n_layers={m.n_layers} but {path} holds {len(layers)} layers")
    tensors = expected_tensors(m)
    want = {k: shape for k, (shape, _) in tensors.items()}
    for key in sorted(set(want) | set(shapes)):
        if key not in shapes:
            raise CheckpointError(f"{path} lacks {key}, which config {cfg_path} (readout {m.readout}, "
                                  f"recurrence {m.recurrence}) needs")
        if key not in want:
            raise CheckpointError(f"{path} holds {key}, which config {cfg_path} (readout {m.readout}, "
                                  f"recurrence {m.recurrence}) has no place for")
        if shapes[key] != want[key]:
            raise CheckpointError(f"{path}: {key} has shape {list(shapes[key])} but {cfg_path}'s model needs "
                                  f"{list(want[key])}")
        dtype, model_dtype = header[key]["dtype"], tensors[key][1]
        if model_dtype.is_floating_point != (dtype in FLOAT_DTYPES) or \
                (not model_dtype.is_floating_point and INT_DTYPES.get(dtype) != model_dtype):
            if model_dtype.is_floating_point:
                raise CheckpointError(f"{path}: {key} is {dtype}, not a float tensor (loopscale weights are float)")
            raise CheckpointError(f"{path}: {key} is {dtype}, but the model holds it as {model_dtype}")


def read_weights(path: Path, header: dict) -> dict[str, torch.Tensor]:
    """The tensors, one at a time from the memory-mapped file; each must be finite."""
    state = {}
    try:
        with safe_open(str(path), framework="pt") as f:
            for key in sorted(k for k in header if k != "__metadata__"):
                t = f.get_tensor(key)
                if not torch.isfinite(t).all():
                    raise CheckpointError(f"{path}: {key} holds non-finite values (NaN or inf): corrupted weights")
                state[key] = t
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"{path} is truncated or corrupted ({type(e).__name__})") from None
    return state


def _model_pt_record(path: Path) -> tuple[Optional[dict], Optional[str]]:
    """(config, weights_sha256) of model.pt, read memory-mapped (its tensors stay on disk)."""
    try:
        ck = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        raise CheckpointError(f"{path} is truncated or corrupted ({type(e).__name__}): it cannot vouch for "
                              f"the run's other files; delete it or re-export the run") from None
    if not isinstance(ck, dict) or not isinstance(ck.get("config"), dict):
        raise CheckpointError(f"{path} is not a loopscale checkpoint (missing config)")
    h = ck.get("weights_sha256")
    return ck["config"], h if isinstance(h, str) else None


def load(run_dir: str | Path, device: str | torch.device = "cpu") -> tuple[LoopedLM, Tokenizer, RunConfig]:
    """(model, tokenizer, config) of a run directory, the model in eval mode on `device`.

    Weights from model.safetensors (else model.pt), the run config from loopscale.json (or an
    older run's config.json, else the checkpoint's), tokenizer from tokenizer.json. Everything
    is verified first (module docstring); a failure is one CheckpointError line."""
    run = Path(run_dir)
    if not run.is_dir():
        raise FileNotFoundError(f"run directory {run} not found")
    weights = run / WEIGHTS
    from . import ouro
    if ouro.is_hf_checkpoint(run):  # a published Hugging Face Ouro checkpoint (ByteDance/Ouro-1.4B, ...)
        model, cfg = ouro.from_pretrained(run, device=device)
        tok_path = run / "tokenizer.json"
        if not tok_path.is_file():
            raise FileNotFoundError(f"{tok_path} not found: the checkpoint directory needs its tokenizer")
        return model, Tokenizer.from_file(str(tok_path)), cfg
    if not weights.is_file():
        from .evaluate import load_model
        model, cfg, ckpt = load_model(run / "model.pt", device=device)
        data = ckpt.get("data") if isinstance(ckpt.get("data"), dict) else {}
        return model, load_tokenizer(run, [(data.get("tokenizer_sha256"), run / "model.pt")]), cfg
    record, rec_path = read_record(run)
    cfg = _run_config(record["config"], rec_path)
    m = cfg.model
    arch = record.get("arch", m.arch)
    if arch not in ARCHS:
        raise CheckpointError(f"{rec_path}: unknown arch {arch!r}; this loopscale loads {', '.join(ARCHS)}")
    fp = config_fingerprint(record["config"])
    hashes = []  # (recorded weights hash, where)
    tok_hashes = [((record.get("data") or {}).get("tokenizer_sha256"), rec_path)]
    hf_path = run / HF_CONFIG
    if rec_path.name == RECORD and hf_path.exists():
        hf = read_json_file(hf_path, "Hugging Face config")
        hashes.append(check_hf_config(hf, m, fp, hf_path, rec_path))
        tok_hashes.append((((hf.get("loopscale") or {}).get("tokenizer_sha256")), hf_path))
    header = read_safetensors_header(weights)
    meta = header.get("__metadata__", {})
    if meta.get("config_fingerprint") and meta["config_fingerprint"] != fp:
        raise CheckpointError(f"{rec_path}'s config is not the one {weights} was written with "
                              f"(config_fingerprint differs): edited or mixed files; re-export the run")
    hashes.append((meta.get("weights_sha256"), weights))
    check_header(header, m, weights, rec_path)
    if (run / "model.pt").is_file():
        pt_config, pt_hash = _model_pt_record(run / "model.pt")
        _same_model(m, _run_config(pt_config, run / "model.pt").model, rec_path, run / "model.pt")
        hashes.append((pt_hash, run / "model.pt"))
    state = read_weights(weights, header)
    if any(h for h, _ in hashes):
        have = weights_sha256(state)
        for want, where in hashes:
            if want and want != have:
                raise CheckpointError(f"{weights}'s tensors differ from the weights hash {where} recorded: "
                                      f"corrupted or replaced weights; re-export the run")
    state = {k: v.float() for k, v in state.items()}
    with torch.device("meta"):
        model = ARCHS[arch](m)
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as e:
        raise CheckpointError(f"{weights} does not match {rec_path}'s model shape: "
                              f"{str(e).splitlines()[0][:200]}") from None
    tok = load_tokenizer(run, tok_hashes)
    if tok.get_vocab_size(with_added_tokens=True) > m.vocab_size:
        raise CheckpointError(f"{run / 'tokenizer.json'} has {tok.get_vocab_size(with_added_tokens=True)} ids "
                              f"but the model's embedding only {m.vocab_size}: not this run's tokenizer")
    return model.to(device).eval(), tok, cfg


def check_hf_config(hf, m: ModelConfig, fp: str, hf_path: Path, rec_path: Path) -> tuple[Optional[str], Path]:
    """config.json (Hugging Face) against the run record: model type, every model setting,
    the config fingerprint. Returns (the weights hash it recorded, its path)."""
    if not isinstance(hf, dict) or hf.get("model_type") != HF_MODEL_TYPE:
        raise CheckpointError(f"{hf_path} is not a loopscale Hugging Face config (model_type "
                              f"{hf.get('model_type') if isinstance(hf, dict) else None!r})")
    for key in ModelConfig.__dataclass_fields__:
        if key in hf and hf[key] != getattr(m, key):
            raise CheckpointError(f"{hf_path} says {key}={hf[key]!r} but {rec_path} holds model.{key}="
                                  f"{getattr(m, key)!r}: edited or mixed files; re-export the run")
    ls = hf.get("loopscale") if isinstance(hf.get("loopscale"), dict) else {}
    if ls.get("config_fingerprint") and ls["config_fingerprint"] != fp:
        raise CheckpointError(f"{rec_path}'s config is not the one {hf_path} was written for "
                              f"(config_fingerprint differs): edited or mixed files; re-export the run")
    return ls.get("weights_sha256"), hf_path


def load_tokenizer(run: Path, recorded: list[tuple[Optional[str], Path]]) -> Tokenizer:
    """tokenizer.json, verified against every tokenizer hash the run recorded."""
    path = run / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: run `loopscale export {run} --data DATA` first")
    text = path.read_bytes()
    have = hashlib.sha256(text).hexdigest()
    for want, where in recorded:
        if isinstance(want, str) and want and want != have:
            raise CheckpointError(f"{path} is not the tokenizer this run was trained with (sha256 differs from "
                                  f"the data.tokenizer_sha256 {where} recorded); copy back the run's own")
    return parse_tokenizer(text, path)


# ---------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------
def cmd_export(args) -> int:
    files = export_run(args.run, args.data)
    print(f"wrote {', '.join(files)} in {args.run}")
    return 0


def add_cli(subparsers) -> None:
    p = subparsers.add_parser("export", help="write a trained run's model.safetensors, Hugging Face config "
                                             "and tokenizer files")
    p.add_argument("run", help="run directory (with model.pt)")
    p.add_argument("--data", help="the run's data directory (for tokenizer.json); default: the run's own copy")
    p.set_defaults(func=cmd_export)
