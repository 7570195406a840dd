"""Text generation from a trained looped LM: any depth, a KV cache, per-token halting.

  loopscale generate --run RUN --prompt "..." [--loops k] [--max-new-tokens N]
                     [--temperature T] [--top-k K] [--seed S] [--halt POLICY [--threshold τ]]

Each (loop, layer) pair has its own KV cache; the context window slides (the last seq_len/2
tokens re-encoded from position 0) when a token has no position left. A token that halts at
loop j < k has its loop-j keys and values copied to every deeper loop (exact once the loop has
converged), so every cache holds one entry per position. Details: docs/artifacts.md
("Generation").
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from .config import ConfigError
from .exits import POLICIES, confidences
from .model import KVCache, LoopedLM


@dataclass
class Halt:
    """Stop looping a token at the first loop j < k whose exit confidence is >= threshold."""
    policy: str
    threshold: float  # math.inf: never exit early


@dataclass
class Generation:
    tokens: list[int]  # the generated ids
    loops: list[int]  # loops of the pass whose exit produced each generated token
    slides: int = 0  # times the context window slid (see the module docstring)
    seconds: float = 0.0
    prompt: list[int] = field(default_factory=list)

    @property
    def mean_loops(self) -> float:
        return sum(self.loops) / max(len(self.loops), 1)


class Decoder:
    """The decoding state of one sequence: a KV cache per (loop, layer) and the next position."""

    def __init__(self, model: LoopedLM, n_loops: int, halt: Optional[Halt] = None):
        self.model, self.n_loops, self.halt = model, n_loops, halt
        self.caches = [[KVCache() for _ in model.blocks] for _ in range(n_loops)]
        self.pos = 0

    def __call__(self, ids: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Encode the new ids [1, T] after the cached ones; return the next-token logits
        (float32 [V]) and the loops they came from. The first call (the prompt) runs at full
        depth; halting applies to the single tokens fed after it."""
        model, n = self.model, self.n_loops
        may_halt = self.halt is not None and self.pos > 0 and ids.shape[1] == 1
        if not may_halt:
            return model.logits(self.states(ids)[:, -1], final=True).float()[0], n
        x = model.embed(ids, start=self.pos)
        self.pos += ids.shape[1]
        for k in range(1, n + 1):
            h = model.loop(x, self.caches[k - 1])
            if k < n:
                z = model.logits(h[:, -1], final=False, k=k).float()
                if confidences(z)[self.halt.policy].item() >= self.halt.threshold:
                    self._copy_forward(k)
                    return z[0], k
            x = model.feed(h, k)
        return model.logits(h[:, -1], final=True, k=n).float()[0], n

    def states(self, ids: torch.Tensor, every_loop: bool = False):
        """Encode the new ids [B, T] after the cached ones at full depth; return the state
        after the last loop, H_n [B, T, d] (read it out with `model.logits(h, final=True)`),
        or with `every_loop` the list [E, H_1, ..., H_n] (E: the input of loop 1)."""
        model = self.model
        x = model.embed(ids, start=self.pos)
        self.pos += ids.shape[1]
        out = [x]
        for k in range(1, self.n_loops + 1):
            h = model.loop(x, self.caches[k - 1])
            out.append(h)
            if k < self.n_loops:
                x = model.feed(h, k)
        return out if every_loop else h

    def _copy_forward(self, k: int) -> None:
        """The token that halted after loop k: its loop-k keys/values stand in at loops k+1..n."""
        for deeper in self.caches[k:]:
            for src, dst in zip(self.caches[k - 1], deeper):
                dst.append(src.k[:, :, -1:], src.v[:, :, -1:])


MIN_TEMPERATURE = 1e-4  # below it softmax(logits / T) overflows float32 for plausible logits; 0 is greedy


def check_sampling(temperature: float, top_k: Optional[int]) -> None:
    """One line for a temperature or top-k that would sample nonsense (or silently not sample)."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not math.isfinite(temperature) \
            or not (temperature == 0 or temperature >= MIN_TEMPERATURE):
        raise ConfigError(f"--temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE:g}, "
                          f"got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ConfigError(f"--top-k must be an integer >= 1 (or left out: every id), got {top_k!r}")


def check_new_tokens(n, flag: str = "--max-new-tokens", least: int = 0) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < least:
        raise ConfigError(f"{flag} must be an integer >= {least}, got {n!r}")


def sample(logits: torch.Tensor, temperature: float, top_k: Optional[int],
           generator: Optional[torch.Generator], vocab: Optional[int] = None) -> int:
    """Greedy at temperature 0, else a draw from softmax(logits / T) over the top-k ids.
    `vocab`: only ids below it (the ones the tokenizer has) are ever drawn."""
    if vocab is not None and vocab < logits.numel():
        logits = logits.clone()
        logits[vocab:] = -math.inf
    if temperature <= 0:
        return int(logits.argmax())
    z = logits / temperature
    if top_k:
        kth = torch.topk(z, min(top_k, z.numel())).values[-1]
        z = z.masked_fill(z < kth, -math.inf)
    return int(torch.multinomial(torch.softmax(z, -1).cpu(), 1, generator=generator))


@torch.inference_mode()
def generate(model: LoopedLM, prompt: list[int], max_new_tokens: int, n_loops: Optional[int] = None,
             temperature: float = 0.0, top_k: Optional[int] = None, seed: int = 0,
             halt: Optional[Halt] = None, use_cache: bool = True, vocab: Optional[int] = None) -> Generation:
    """Continue `prompt` (token ids) by `max_new_tokens` tokens at depth n_loops (default K).
    `vocab`: draw only ids below it (the tokenizer's size; the embedding may be larger)."""
    from .artifacts import LIMITS
    n = model.cfg.n_loops if n_loops is None else n_loops
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= LIMITS["n_loops"]:
        raise ConfigError(f"--loops must be an integer in [1, {LIMITS['n_loops']}], got {n!r}")
    check_new_tokens(max_new_tokens)
    check_sampling(temperature, top_k)
    if not prompt:
        raise ConfigError("the prompt encodes to no tokens; give some text")
    if halt is not None and (isinstance(halt.threshold, bool) or not isinstance(halt.threshold, (int, float))
                             or math.isnan(halt.threshold)):
        raise ConfigError(f"--threshold must be a number, got {halt.threshold!r}")
    if halt is not None and not use_cache:
        raise ConfigError("halting needs the KV cache (use_cache=True)")
    if halt is not None and halt.policy not in POLICIES:
        raise ConfigError(f"--halt: unknown policy {halt.policy!r}; choose one of {', '.join(POLICIES)}")
    model.eval()
    dev = model.head_weight.device
    seq = model.cfg.seq_len
    g = torch.Generator().manual_seed(seed)
    ids = list(prompt)
    start = max(0, len(ids) - seq)  # a prompt longer than the window keeps its last seq_len tokens
    out = Generation(tokens=[], loops=[], prompt=list(prompt))

    def encode_window():
        window = torch.tensor([ids[start:]], device=dev)
        if not use_cache:  # re-run the whole window, read the last position after loop n
            return None, (model.logits(model(window, n_loops=n)[-1][:, -1], final=True).float()[0], n)
        dec = Decoder(model, n, halt)
        return dec, dec(window)

    t0 = time.perf_counter()
    dec, (logits, loops) = encode_window()
    for i in range(max_new_tokens):
        nxt = sample(logits, temperature, top_k, g, vocab)
        ids.append(nxt)
        out.tokens.append(nxt)
        out.loops.append(loops)
        if i == max_new_tokens - 1:
            break
        if len(ids) - start > seq:  # the new token has no position left: slide the window
            start = len(ids) - max(1, seq // 2)  # (a seq_len-1 model keeps the new token)
            out.slides += 1
            dec, (logits, loops) = encode_window()
        elif use_cache:
            logits, loops = dec(torch.tensor([[nxt]], device=dev))
        else:  # uncached: every token re-encodes the window
            dec, (logits, loops) = encode_window()
    out.seconds = time.perf_counter() - t0
    return out


# ---------------------------------------------------------------------------
# calibrated thresholds of a run
# ---------------------------------------------------------------------------
def run_threshold(run_dir: str | Path, policy: str, cfg=None) -> float:
    """The per-token threshold `loopscale eval halting` calibrated for this run and policy
    (`cfg`: the run's config; the file must be this run's). Malformed contents: one line."""
    if policy not in POLICIES:
        raise ConfigError(f"--halt: unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
    path = Path(run_dir) / "eval" / "halting.json"
    calibrate = f"loopscale eval halting --model {Path(run_dir) / 'model.pt'} --data DATA --out {path}"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: run `{calibrate}` first, or give --threshold")
    rerun = f"rerun `{calibrate}`"
    try:
        result = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not UTF-8 text; {rerun}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON ({e.msg}); {rerun}") from None
    pols = result.get("policies") if isinstance(result, dict) else None
    pol = pols.get(f"{policy}/token") if isinstance(pols, dict) else None
    if not isinstance(pol, dict):
        raise ConfigError(f"{path} has no calibrated {policy}/token policy; {rerun}")
    if cfg is not None:
        _same_run(result, cfg, path, rerun)
    tau = pol.get("threshold")
    if tau is None:
        return math.inf  # calibration never exits early
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not math.isfinite(tau):
        raise ConfigError(f"{path}: policies[{policy}/token].threshold must be a finite number or null, "
                          f"got {tau!r}; {rerun}")
    return float(tau)


def _same_run(result: dict, cfg, path: Path, rerun: str) -> None:
    """halting.json was calibrated on this run: its condition, depth and seed are the run's."""
    m, o = cfg.model, cfg.objective
    want = {"readout": m.readout, "loss": o.loss, "regularizer": o.regularizer, "recurrence": m.recurrence,
            "n_loops": m.n_loops, "d_model": m.d_model, "n_layers": m.n_layers}
    have = result.get("condition")
    if not isinstance(have, dict):
        raise ConfigError(f"{path} names no condition: not a `loopscale eval halting` result; {rerun}")
    ours = {"k_train": m.n_loops, "seed": cfg.train.seed}  # top-level keys of the result
    diff = next((k for k, v in want.items() if k in have and have[k] != v), None) or \
        next((k for k, v in ours.items() if k in result and result[k] != v), None)
    if diff is not None:
        raise ConfigError(f"{path} was calibrated on another run ({diff} differs from this run's); {rerun}")


# ---------------------------------------------------------------------------
# speed (used by `loopscale bench --generate RUN`)
# ---------------------------------------------------------------------------
def bench_generation(model: LoopedLM, run_dir: Optional[str | Path] = None, new_tokens: int = 32,
                     prompt_len: int = 16, seed: int = 0, cfg=None) -> dict:
    """Generation tokens/s (greedy, KV cache, batch 1) at every depth k = 1..K, and with each
    policy's calibrated per-token halting when the run has RUN/eval/halting.json."""
    check_new_tokens(new_tokens, "--new-tokens", 1)
    K, V, seq = model.cfg.n_loops, model.cfg.vocab_size, model.cfg.seq_len
    prompt_len = max(1, min(prompt_len, seq // 2))
    prompt = torch.randint(min(4, V - 1), V, (prompt_len,), generator=torch.Generator().manual_seed(seed)).tolist()
    # no window slide inside the timing: the last new token needs no position of its own
    new_tokens = min(new_tokens, seq - prompt_len + 1)
    generate(model, prompt, 2)  # warm-up
    rows = []
    variants = [(f"k={k}", k, None) for k in range(1, K + 1)]
    if run_dir is not None and (Path(run_dir) / "eval" / "halting.json").is_file():
        variants += [(f"halt {p}", K, Halt(p, run_threshold(run_dir, p, cfg))) for p in POLICIES]
    for name, k, halt in variants:
        g = generate(model, prompt, new_tokens, n_loops=k, halt=halt)
        rows.append({"name": name, "loops": k, "policy": halt.policy if halt else None,
                     "threshold": None if halt is None or not math.isfinite(halt.threshold) else halt.threshold,
                     "tokens": len(g.tokens), "seconds": g.seconds, "tok_per_s": len(g.tokens) / g.seconds,
                     "mean_loops": g.mean_loops})
    return {"prompt_tokens": prompt_len, "new_tokens": new_tokens, "batch_size": 1, "rows": rows}


def bench_generation_of_run(run_dir: str | Path, new_tokens: int, device: str = "cpu",
                            threads: Optional[int] = None) -> dict:
    """`loopscale bench --generate RUN`: bench_generation of the run's model on `device`
    (with `threads` torch CPU threads), with the run, device and thread count recorded."""
    from .artifacts import load
    from .runtime import resolve_device
    check_new_tokens(new_tokens, "--new-tokens", 1)
    resolve_device(device)  # one line for a device this machine lacks
    if threads:
        torch.set_num_threads(threads)
    model, _, cfg = load(run_dir, device=device)
    return {"run": str(run_dir), "device": device, "threads": torch.get_num_threads(),
            **bench_generation(model, run_dir, new_tokens=new_tokens, cfg=cfg)}


def generate_from_run(run, prompt: str, max_new_tokens: int = 40, loops: Optional[int] = None,
                      temperature: float = 0.0, top_k: Optional[int] = None, seed: int = 0,
                      halt_policy: Optional[str] = None, threshold: Optional[float] = None, device: str = "cpu",
                      threads: int = 0) -> tuple[str, str]:
    """`prompt` continued by the run's model: (the prompt + the decoded new tokens, a one-line
    note of the depth, halting, loops/token, speed and window slides). Every argument is
    checked (one line each) before the run is loaded."""
    from .artifacts import load
    from .runtime import resolve_device
    check_new_tokens(max_new_tokens)
    check_sampling(temperature, top_k)
    if threshold is not None and not halt_policy:
        raise ConfigError("--threshold needs --halt POLICY")
    if threshold is not None and not math.isfinite(threshold):
        raise ConfigError(f"--threshold must be a finite number, got {threshold!r}")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError("--prompt is not valid UTF-8 text") from None
    resolve_device(device)  # one line for a device this machine lacks
    if threads:
        torch.set_num_threads(threads)
    model, tok, cfg = load(run, device=device)
    halt = None
    if halt_policy:
        tau = threshold if threshold is not None else run_threshold(run, halt_policy, cfg)
        halt = Halt(halt_policy, tau)
    ids = tok.encode(prompt, add_special_tokens=False).ids
    g = generate(model, ids, max_new_tokens, n_loops=loops, temperature=temperature, top_k=top_k, seed=seed,
                 halt=halt, vocab=tok.get_vocab_size(with_added_tokens=True))
    k = loops or cfg.model.n_loops
    note = f"; window slid {g.slides}x (seq_len {cfg.model.seq_len})" if g.slides else ""
    how = f", halting {halt.policy} τ={halt.threshold:.4g}" if halt else ""
    return (prompt + tok.decode(g.tokens, skip_special_tokens=False),
            f"[{len(g.tokens)} tokens at k={k} (K_train={cfg.model.n_loops}){how}: mean loops/token "
            f"{g.mean_loops:.2f}, {len(g.tokens) / max(g.seconds, 1e-9):.1f} tok/s{note}]")
