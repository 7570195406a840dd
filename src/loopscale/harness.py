"""lm-evaluation-harness support: a trained run as the lm-eval model type `loopscale`.

    loopscale-lm-eval --model loopscale --model_args run=RUN,loops=8 --tasks TASKS

Importing this module registers the model type in lm-eval's registry; `loopscale-lm-eval` is
lm-eval's command with it imported first. The model args, tokenization and scoring rules are
in docs/usage.md ("lm-evaluation-harness").
"""
from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

try:
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
    # lm-eval fills its model registry with its own types lazily, only while the registry is
    # empty: load them first, or registering `loopscale` would hide `hf` and the others
    import lm_eval.models  # noqa: F401
except ImportError as e:  # the optional extra
    raise ImportError("loopscale.harness needs lm-evaluation-harness: pip install 'loopscale[lm-eval]' "
                      f"(lm-eval==0.4.13, pinned in requirements.lock) [{e}]") from None

from .config import ConfigError
from .data import DOC_SEPARATOR
from .exits import POLICIES, confidences
from .io import CheckpointError

__all__ = ["LoopscaleLM", "main"]
log = logging.getLogger(__name__)


def _int_arg(name: str, value, minimum: int, maximum: Optional[int] = None) -> int:
    """An integer model arg in [minimum, maximum] (config.Range, the project's limits)."""
    from .config import Range
    allowed = Range(minimum, math.inf if maximum is None else maximum)
    integral = not isinstance(value, bool) and (not isinstance(value, float) or value.is_integer())
    try:
        v = int(value) if integral else None
    except (TypeError, ValueError, OverflowError):
        v = None
    if v is None:
        raise ConfigError(f"--model_args {name}: expected an integer, got {value!r}")
    if v not in allowed:
        raise ConfigError(f"--model_args {name}: must be {allowed}, got {v}")
    return v


def _float_arg(name: str, value) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"--model_args {name}: expected a number, got {value!r}") from None
    if not math.isfinite(v):
        raise ConfigError(f"--model_args {name}: must be a finite number, got {value!r}")
    return v


# the model args LoopscaleLM takes (module docstring); anything else is refused with a did-you-mean
MODEL_ARGS = ("run", "loops", "halting", "threshold", "device", "batch_size", "max_batch_size", "max_length",
              "max_gen_toks", "prefix_token_id")


def _merge_args(args: dict, additional: Optional[dict]) -> dict:
    """lm-eval's command line adds batch_size, max_batch_size and device (its own defaults
    included) beside --model_args: a key given in --model_args wins, instead of lm-eval's
    `got multiple values for keyword argument`."""
    return {**args, **{k: v for k, v in (additional or {}).items() if v is not None and k not in args}}


@register_model("loopscale")
class LoopscaleLM(LM):
    """A loopscale run directory as an lm-eval LM (loglikelihood, rolling, generate_until)."""

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: Optional[dict] = None):
        from lm_eval.utils import simple_parse_args_string
        return cls(**_merge_args(simple_parse_args_string(arg_string), additional_config))

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: Optional[dict] = None):
        return cls(**_merge_args(dict(arg_dict), additional_config))

    def __init__(self, run: Optional[str] = None, loops=None, halting: Optional[str] = None,
                 threshold=None, device: str = "cpu", batch_size=8, max_batch_size=None, max_length=None,
                 max_gen_toks=256, prefix_token_id=None, **unknown):
        super().__init__()
        from .artifacts import LIMITS, load
        from .generate import run_threshold
        from .runfiles import check_run_dir
        if unknown:
            import difflib
            key = sorted(unknown)[0]
            near = difflib.get_close_matches(key, MODEL_ARGS, n=1)
            hint = f" (did you mean {near[0]}?)" if near else ""
            raise ConfigError(f"--model_args {key}: unknown model arg of the loopscale model type{hint}; "
                              f"it takes {', '.join(MODEL_ARGS)}")
        if not run:
            raise ConfigError("--model_args run=RUN is required (a trained run directory)")
        self.run = Path(run)
        # every argument first (one line each), then the run
        self.loops = None if loops in (None, "") else _int_arg("loops", loops, 1, LIMITS["n_loops"])
        if halting in ("", "none", "None"):
            halting = None
        if halting is not None and halting not in POLICIES:
            raise ConfigError(f"--model_args halting: unknown policy {halting!r}; choose one of {', '.join(POLICIES)}")
        if threshold not in (None, "") and halting is None:
            raise ConfigError("--model_args threshold needs halting=POLICY")
        threshold = None if threshold in (None, "") else _float_arg("threshold", threshold)
        bs = str(batch_size).split(":")[0] if batch_size not in (None, "") else "auto"
        self.batch_size = 8 if bs == "auto" else _int_arg("batch_size", bs, 1)
        self.max_gen_toks = _int_arg("max_gen_toks", max_gen_toks, 1)
        device = device or "cpu"
        if str(device).startswith("cuda") and not torch.cuda.is_available():
            log.warning("device %s requested but CUDA is not available: using cpu", device)
            device = "cpu"  # lm_eval's command line defaults to cuda, as its `hf` model falls back
        if self.run.is_dir():
            check_run_dir(self.run)
        self.model, self.tokenizer, self.cfg = load(self.run, device=device)
        self._device = torch.device(device)
        if self.loops is None:
            self.loops = self.cfg.model.n_loops
        self.halting = halting
        self.threshold = None
        if halting is not None:
            self.threshold = threshold if threshold is not None else run_threshold(self.run, halting, self.cfg)
        seq = self.cfg.model.seq_len
        self.max_length = seq if max_length in (None, "") else _int_arg("max_length", max_length, 1)
        if self.max_length > seq:
            raise ConfigError(f"--model_args max_length: {self.max_length} exceeds the model's seq_len {seq}")
        vocab = self.tokenizer.get_vocab(with_added_tokens=True)
        # a document starts after the token the training stream puts between rows/documents: the
        # separator's one token (in the paper's stream the row boundary is <unk>, so that), else <eos>
        sep = self.tok_encode(DOC_SEPARATOR)
        self.prefix_id = sep[0] if len(sep) == 1 else vocab.get("<eos>", 0)
        if prefix_token_id not in (None, ""):  # as lm-eval's `hf` model: e.g. the tokenizer's <bos>
            self.prefix_id = _int_arg("prefix_token_id", prefix_token_id, 0, self.cfg.model.vocab_size - 1)

    # -- tokens ------------------------------------------------------------------
    @property
    def prefix_token_id(self) -> int:
        return self.prefix_id

    def tok_encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def tok_decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """(context ids, continuation ids) as lm-eval's HFLM splits them (see the module doc)."""
        n_space = len(context) - len(context.rstrip())
        if n_space:
            context, continuation = context[:-n_space], context[-n_space:] + continuation
        whole = self.tok_encode(context + continuation)
        ctx = self.tok_encode(context)
        return ctx, whole[len(ctx):]

    # -- scoring -------------------------------------------------------------------
    @torch.inference_mode()
    def token_logprobs(self, idx: torch.Tensor) -> torch.Tensor:
        """log p(· | prefix) at every position of idx [B, T]: float32 [B, T, V], read after
        `loops` loops, or at each token's first confident exit under `halting`."""
        model, n = self.model, self.loops
        states = model(idx, n_loops=n)
        out = F.log_softmax(model.logits(states[-1], final=True).float(), dim=-1)
        if self.halting is None:
            return out
        done = torch.zeros(idx.shape, dtype=torch.bool, device=idx.device)
        for h in states[:-1]:
            z = model.logits(h, final=False).float()
            conf = confidences(z.reshape(-1, z.shape[-1]))[self.halting].view(idx.shape)
            take = (conf >= self.threshold) & ~done
            out = torch.where(take[..., None], F.log_softmax(z, dim=-1), out)
            done |= take
        return out

    def score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(sum of log p(continuation | context), whether greedy decoding gives it) per pair."""
        results = []
        for b in range(0, len(pairs), self.batch_size):
            chunk = pairs[b:b + self.batch_size]
            rows = []
            for ctx, cont in chunk:
                if not cont:
                    raise ConfigError("a request's continuation encodes to no tokens")
                if len(cont) > self.max_length:
                    raise ConfigError(f"a request's continuation has {len(cont)} tokens, more than the "
                                      f"context window (max_length {self.max_length})")
                ctx = ctx or [self.prefix_id]
                whole = (ctx + cont)[-(self.max_length + 1):]
                rows.append((whole[:-1], len(cont)))
            T = max(len(r) for r, _ in rows)
            idx = torch.zeros((len(rows), T), dtype=torch.long, device=self._device)
            for i, (r, _) in enumerate(rows):  # right padding: a causal model's positions < len(r) ignore it
                idx[i, :len(r)] = torch.tensor(r)
            logp = self.token_logprobs(idx)
            for i, ((r, m), (_, cont)) in enumerate(zip(rows, chunk)):
                lp = logp[i, len(r) - m:len(r)]
                target = torch.tensor(cont, device=self._device)
                ll = float(lp.gather(1, target[:, None]).sum().double())
                results.append((ll, bool((lp.argmax(-1) == target).all())))
        return results

    # -- the lm-eval interface -----------------------------------------------------------
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = [self.encode_pair(*req.args) for req in requests]
        out = self.score(pairs)
        for req, r in zip(requests, out):
            self.cache_hook.add_partial("loglikelihood", req.args, r)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        out = []
        for req in requests:
            (text,) = req.args
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_id,
                max_seq_len=self.max_length, context_len=1)]
            ll = sum(x for x, _ in self.score(windows)) if windows else 0.0
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), ll)
            out.append(ll)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from .generate import Halt, generate
        halt = Halt(self.halting, self.threshold) if self.halting else None
        out = []
        for req in requests:
            context, kwargs = req.args
            kwargs = dict(kwargs or {})
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = _int_arg("max_gen_toks", kwargs.pop("max_gen_toks", self.max_gen_toks), 1)
            temperature = float(kwargs.pop("temperature", 0.0) or 0.0)
            if not kwargs.pop("do_sample", temperature > 0):
                temperature = 0.0
            prompt = self.tok_encode(context) or [self.prefix_id]
            g = generate(self.model, prompt, max_new, n_loops=self.loops, temperature=temperature,
                         top_k=kwargs.pop("top_k", None), seed=int(kwargs.pop("seed", 0) or 0), halt=halt)
            text = self.tok_decode(g.tokens)
            for stop in until:
                if stop and stop in text:
                    text = text[:text.index(stop)]
            self.cache_hook.add_partial("generate_until", (context, req.args[1]), text)
            out.append(text)
        return out

    def get_model_info(self) -> dict:
        return {"run": str(self.run), "loops": self.loops, "n_loops_train": self.cfg.model.n_loops,
                "halting": self.halting, "threshold": None if self.threshold is None or math.isinf(self.threshold)
                else self.threshold}


def parse_depths(text: str) -> list[int]:
    """`--loops 1,2,3,4`: distinct depths, each in [1, LIMITS n_loops] (one line otherwise)."""
    from .artifacts import LIMITS
    parts = [p.strip() for p in str(text).split(",")]
    if not parts or any(not p for p in parts):
        raise ConfigError(f"--loops: expected a comma-separated list of depths such as 1,2,3,4, got {text!r}")
    depths = [_int_arg("loops", p, 1, LIMITS["n_loops"]) for p in parts]
    if len(set(depths)) != len(depths):
        raise ConfigError(f"--loops: {text!r} names a depth twice")
    return depths


# the per-task keys of lm-eval's results dict that are renamed per depth (one table, one file)
_TASK_KEYED = ("results", "groups", "group_subtasks", "configs", "versions", "n-shot", "higher_is_better",
               "n-samples", "samples")


def over_depths(evaluate, depths: list[int]):
    """`simple_evaluate` run once per depth: the model arg `loops=k` (`n_loops=k` for lm-eval's
    `hf` model type on a run directory) set in turn, the results merged under task names
    "TASK@k=K" so that lm-eval prints one table and writes one results file."""
    def run(*args, model="hf", model_args=None, **kwargs):
        key = "loops" if model == "loopscale" else "n_loops"
        merged = None
        for k in depths:
            if isinstance(model_args, dict) or model_args is None:
                margs = {**(model_args or {}), key: k}
            else:
                kept = [a for a in str(model_args).split(",") if a and a.split("=", 1)[0].strip() != key]
                margs = ",".join(kept + [f"{key}={k}"])
            res = evaluate(*args, model=model, model_args=margs, **kwargs)
            if res is None:  # a non-zero rank of a distributed run
                return None
            rename = lambda name, k=k: f"{name}@k={k}"  # noqa: E731
            for field in _TASK_KEYED:
                if isinstance(res.get(field), dict):
                    res[field] = {rename(t): ([rename(x) for x in v] if field == "group_subtasks" else v)
                                  for t, v in res[field].items()}
            for field in ("results", "groups"):  # the names lm-eval's table prints
                for t, v in (res.get(field) or {}).items():
                    if isinstance(v, dict):
                        v["alias"] = rename(v["alias"]) if isinstance(v.get("alias"), str) else t
            if merged is None:
                merged = res
                continue
            for field in _TASK_KEYED:
                if isinstance(res.get(field), dict):
                    merged.setdefault(field, {}).update(res[field])
        merged.setdefault("config", {})["loops"] = list(depths)
        return merged
    return run


def main(argv: Optional[list[str]] = None) -> None:
    """`loopscale-lm-eval`: lm-eval's command line with the `loopscale` model type registered,
    and `--loops 1,2,3,4`: evaluate each depth in turn into one table (and one results file)."""
    import sys

    import lm_eval
    from lm_eval.__main__ import cli_evaluate
    saved_argv, saved_evaluate = sys.argv, lm_eval.simple_evaluate
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    try:
        args = sys.argv[1:]
        for i, a in enumerate(args):
            if a == "--loops" or a.startswith("--loops="):
                value = a.split("=", 1)[1] if "=" in a else (args[i + 1] if i + 1 < len(args) else "")
                del args[i:i + (1 if "=" in a else 2)]
                sys.argv = [sys.argv[0], *args]
                lm_eval.simple_evaluate = over_depths(saved_evaluate, parse_depths(value))
                break
        cli_evaluate()
    except (ConfigError, CheckpointError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    finally:
        sys.argv, lm_eval.simple_evaluate = saved_argv, saved_evaluate


if __name__ == "__main__":
    main()
