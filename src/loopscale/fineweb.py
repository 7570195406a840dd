"""Appendix B's corpus: FineWeb streamed through `datasets`, cut into training chunks.

Filtered, shuffled, chunked and sharded as the official trainer of the Ouro track does it
(docs/ouro.md "Training"); `ChunkStream` can also skip exactly the chunks a rank already
consumed (step-exact resume).

The trainer that consumes it is `loopscale.train_stream` (`loopscale train-stream`); this
module is data only, so `loopscale.data` can read the held-out head of the stream without
importing the training code. Its settings are `StreamConfig`'s (`--set stream.*`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Optional

from .config import ConfigError, NonNegFloat, NonNegInt, from_mapping, merge

if TYPE_CHECKING:
    import torch


@dataclass
class StreamConfig:
    dataset: str = "HuggingFaceFW/fineweb"
    subset: str = "sample-10BT"
    split: str = "train"
    data_files: list = field(default_factory=list)  # local parquet files (FineWeb's schema) instead of the hub
    text_key: str = "text"
    shuffle_buffer: NonNegInt = 10_000  # documents; 0: stream order
    shuffle_seed: NonNegInt = 42  # official: the run's seed
    min_chars: NonNegInt = 50  # documents whose stripped text is shorter are skipped
    tokenizer: str = "ByteDance/Ouro-1.4B"  # a dir with tokenizer.json, a tokenizer.json, or a hub name
    warmup_steps: NonNegInt = 333  # optimiser steps of linear warm-up from 0
    min_lr: NonNegFloat = 3e-5  # the cosine's floor (train.lr is its peak)
    pure_bf16: bool = False  # weights, gradients and AdamW state in bf16 (official), instead of fp32 master weights
    heldout_documents: NonNegInt = 0  # the first N documents of the unshuffled stream are never trained on (evaluation)

    @classmethod
    def from_dict(cls, d: dict) -> "StreamConfig":
        s = from_mapping(cls, d, "stream")
        if not all(isinstance(f, str) for f in s.data_files):
            raise ConfigError("stream.data_files must be a list of file paths")
        return s


# the settings of StreamConfig that a pipeline experiment sets in its `stream:` block (the
# training recipe); the corpus and the tokenizer come from its `data:` (source=fineweb)
RECIPE_KEYS = ("shuffle_buffer", "warmup_steps", "min_lr", "pure_bf16")


def stream_settings(data: dict, recipe: Optional[dict] = None, seed: int = 42) -> dict:
    """The StreamConfig (as a dict, validated) of a pipeline run: corpus, tokenizer, filter and
    held-out documents from its data settings (source=fineweb), the recipe from `recipe`, the
    shuffle seeded by the run's seed (as the official trainer seeds it)."""
    recipe = dict(recipe or {})
    bad = sorted(set(recipe) - set(RECIPE_KEYS))
    if bad:
        raise ConfigError(f"unknown key 'stream.{bad[0]}'; choose one of {', '.join(RECIPE_KEYS)} (the corpus and "
                          f"the tokenizer are data settings)")
    d = {"dataset": data["stream_dataset"], "subset": data["stream_subset"], "data_files": list(data["data_files"]),
         "tokenizer": data["pretrained_tokenizer"], "min_chars": data["min_chars"],
         "heldout_documents": data["heldout_documents"], "shuffle_seed": int(seed), **recipe}
    s = StreamConfig.from_dict(merge(dataclasses.asdict(StreamConfig()), d, "stream"))
    return dataclasses.asdict(s)


# ---------------------------------------------------------------------------
# the stream
# ---------------------------------------------------------------------------
def load_tokenizer(spec: str):
    """A `tokenizers.Tokenizer` from a directory holding tokenizer.json, a tokenizer.json file,
    or the hub (e.g. ByteDance/Ouro-1.4B; needs network or the local hub cache)."""
    from tokenizers import Tokenizer
    p = Path(spec)
    if p.is_dir():
        if not (p / "tokenizer.json").is_file():
            raise FileNotFoundError(f"tokenizer directory {p} has no tokenizer.json")
        p = p / "tokenizer.json"
    if p.is_file():
        try:
            return Tokenizer.from_str(p.read_bytes().decode("utf-8"))
        except OSError:
            raise
        except Exception as e:  # not UTF-8, not JSON, not a tokenizers schema (plain Exceptions)
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:120]
            raise ConfigError(f"tokenizer {p} is not a tokenizers JSON file ({first})") from None
    try:
        return Tokenizer.from_pretrained(spec)
    except Exception as e:
        raise FileNotFoundError(f"tokenizer {spec!r}: not a local directory or file, and the hub did not "
                                f"give it ({type(e).__name__}); download it or pass a local path") from None


def _raw_documents(s: StreamConfig):
    from datasets import load_dataset
    if s.data_files:
        missing = [f for f in s.data_files if not Path(f).is_file()]
        if missing:
            raise FileNotFoundError(f"stream.data_files: {missing[0]} not found")
        for f in s.data_files:
            check_parquet(f, s.text_key)
        return load_dataset("parquet", data_files=list(s.data_files), split="train", streaming=True)
    return load_dataset(s.dataset, name=s.subset or None, split=s.split, streaming=True)


def check_parquet(path: str | Path, key: str) -> None:
    """A data file of the stream must be parquet with a string column `key` (an empty, truncated
    or CSV file, or a column of numbers or lists, is one ConfigError line naming the file)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    try:
        schema = pq.ParquetFile(str(path)).schema_arrow
    except (pa.ArrowException, OSError, ValueError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:120]
        raise ConfigError(f"stream.data_files: {path} is not a readable parquet file ({first})") from None
    if key not in schema.names:
        raise ConfigError(f"stream.data_files: {path} has no column {key!r} (stream.text_key); it has "
                          f"{', '.join(schema.names[:6]) or 'none'}")
    kind = schema.field(key).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_null(kind)):
        raise ConfigError(f"stream.data_files: {path}'s column {key!r} holds {kind}, not text")


def head_documents(s: StreamConfig, n: int) -> list[str]:
    """The texts of the first n documents of the stream in file order (before shuffling and
    filtering): the held-out documents (`heldout_documents`)."""
    import itertools
    return [doc.get(s.text_key) or "" for doc in itertools.islice(_raw_documents(s), n)]


def text_key(text: str) -> str:
    import hashlib
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def open_documents(s: StreamConfig, rank: int = 0, world: int = 1) -> tuple[Iterable[dict], bool]:
    """(the document stream of this rank, whether it is already sharded by rank). With
    heldout_documents N, every document whose text is one of the first N documents' (held
    out for evaluation) is left out, wherever the shuffle and the sharding put it."""
    ds = _raw_documents(s)
    if s.heldout_documents:
        held = {text_key(t) for t in head_documents(s, s.heldout_documents)}
        ds = ds.filter(lambda doc: text_key(doc.get(s.text_key) or "") not in held)
    if s.shuffle_buffer > 0:
        ds = ds.shuffle(seed=s.shuffle_seed, buffer_size=s.shuffle_buffer)
    if world > 1 and getattr(ds, "num_shards", 1) >= world:
        return ds.shard(num_shards=world, index=rank), True
    return ds, False


def chunks(docs: Iterable[dict], encode: Callable[[str], list[int]], seq_len: int, min_chars: int = 50,
           text_key: str = "text", rank: int = 0, world: int = 1) -> Iterator[list[int]]:
    """The official chunking: documents with fewer than `min_chars` characters once stripped are
    skipped, the others' tokens concatenated and cut into seq_len+1 chunks overlapping by one
    token; with world > 1 this rank keeps chunks rank, rank+world, ..."""
    buf: list[int] = []
    i = 0
    for doc in docs:
        text = doc.get(text_key) or ""
        if len(text.strip()) < min_chars:
            continue
        buf.extend(encode(text))
        while len(buf) >= seq_len + 1:
            chunk, buf = buf[:seq_len + 1], buf[seq_len:]
            if i % world == rank:
                yield chunk
            i += 1


class ChunkStream:
    """This rank's chunks of the stream, counting what it handed out (`consumed`), so a resumed
    run reopens the stream and skips exactly that many. The stream restarts at its end."""

    def __init__(self, s: StreamConfig, tokenizer, seq_len: int, rank: int = 0, world: int = 1,
                 consumed: int = 0):
        self.s, self.seq_len, self.rank, self.world = s, seq_len, rank, world
        self.encode = lambda text: tokenizer.encode(text, add_special_tokens=False).ids
        self.consumed, self.passes = 0, 0
        self._it = self._open()
        for _ in range(consumed):
            self._next()

    def _open(self) -> Iterator[list[int]]:
        docs, sharded = open_documents(self.s, self.rank, self.world)
        r, w = (0, 1) if sharded else (self.rank, self.world)
        return chunks(docs, self.encode, self.seq_len, self.s.min_chars, self.s.text_key, r, w)

    def _next(self) -> list[int]:
        c = next(self._it, None)  # chunks are lists, never None
        if c is None:
            self.passes += 1
            self._it = self._open()
            c = next(self._it, None)
            if c is None:
                raise ConfigError(f"the stream gives no chunk of seq_len+1 = {self.seq_len + 1} tokens "
                                  f"(documents too short, or all filtered)")
        self.consumed += 1
        return c

    def batch(self, n: int) -> "torch.Tensor":
        """The next n chunks, [n, seq_len+1] (int64)."""
        import torch
        return torch.tensor([self._next() for _ in range(n)], dtype=torch.long)
