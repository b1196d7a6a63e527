"""Choose the next token from logits: greedy, or temperature with top-k / top-p / min-p filters,
after a repetition penalty over recent tokens. Randomness comes from one seeded numpy Generator,
so the same seed and settings give the same tokens.

SamplerSettings' defaults are colichat's: the settings table (settings.py) takes its defaults from
them, so a user, a test and a benchmark that leave a value out all get the same one.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import numpy as np

from ..errors import ModelError


@dataclass(frozen=True)
class SamplerSettings:
    temperature: float = 0.7     # 0 = greedy
    top_k: int = 40              # 0 = off
    top_p: float = 0.95          # 1 = off
    min_p: float = 0.05          # 0 = off
    # 1.1 over 256 tokens: the default model stops looping on everyday prompts (models.md, benchmarks/loops.py)
    repeat_penalty: float = 1.1  # 1 = off
    repeat_last_n: int = 256     # how many recent tokens the penalty looks at
    seed: int | None = None      # None: a fresh seed per run

    def with_(self, **changes) -> SamplerSettings:
        return replace(self, **changes)

    def to_dict(self) -> dict:
        return asdict(self)

    def validate(self) -> None:
        """ValueError naming the setting for values the sampler cannot use (NaN fails every check;
        settings read back from a file may hold any JSON value: the types are checked too)."""
        for key in ("top_k", "repeat_last_n", "seed"):
            v = getattr(self, key)
            if not (isinstance(v, int) and not isinstance(v, bool)) and not (key == "seed" and v is None):
                raise ValueError(f"{key} must be a whole number, not {v!r}")
        for key in ("temperature", "top_p", "min_p", "repeat_penalty"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"{key} must be a finite number")
        if self.seed is not None and self.seed < 0:
            raise ValueError("seed must be >= 0")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0 (0 means greedy)")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0 (0 means off)")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if not 0 <= self.min_p < 1:
            raise ValueError("min_p must be in [0, 1)")
        if self.repeat_penalty <= 0:
            raise ValueError("repeat_penalty must be > 0 (1 means off)")
        if self.repeat_last_n < 0:
            raise ValueError("repeat_last_n must be >= 0")


class Sampler:
    """Draws tokens; `rng` may continue another sampler's random numbers (settings changed, seed kept)."""

    def __init__(self, settings: SamplerSettings, rng: np.random.Generator | None = None):
        settings.validate()
        self.settings = settings
        self.rng = rng or np.random.default_rng(settings.seed)

    @property
    def state(self) -> dict:
        """Where the random numbers stand, as JSON can hold it: {"seed", "pcg64": [state, inc] as hex,
        "has_uint32", "uinteger"} (numpy's PCG64 state)."""
        st = self.rng.bit_generator.state
        return {"seed": self.settings.seed, "pcg64": [hex(st["state"]["state"]), hex(st["state"]["inc"])],
                "has_uint32": st["has_uint32"], "uinteger": st["uinteger"]}

    @state.setter
    def state(self, saved: dict) -> None:
        """Go on from a `state` (ValueError if it is not one, or of another seed)."""
        try:
            if saved["seed"] != self.settings.seed or self.settings.seed is None:
                raise ValueError("the random state of another seed")
            hexes = saved["pcg64"]
            st = {"bit_generator": "PCG64", "state": {"state": int(hexes[0], 16), "inc": int(hexes[1], 16)},
                  "has_uint32": int(saved["has_uint32"]), "uinteger": int(saved["uinteger"])}
            rng = np.random.Generator(np.random.PCG64())
            rng.bit_generator.state = st
        except (KeyError, TypeError, IndexError, ValueError, OverflowError) as e:
            raise ValueError(f"not a random state: {e}") from None
        self.rng = rng

    def __call__(self, logits: np.ndarray, recent: list[int] | np.ndarray = ()) -> int:
        cand, p = self.distribution(logits, recent)
        if self.settings.temperature == 0:
            return int(cand[0])
        return int(cand[self.rng.choice(p.size, p=p)])

    def distribution(self, logits: np.ndarray, recent: list[int] | np.ndarray = ()) -> tuple[np.ndarray, np.ndarray]:
        """The distribution the next token is drawn from, after every filter: candidate ids (best
        first) and their probabilities (float64, summing to 1). Greedy: the argmax with probability 1."""
        s = self.settings
        x = np.array(logits, dtype=np.float64)  # (V,) working copy
        if np.isnan(x).any():
            raise ModelError("the model computed NaN for the next token's scores (its weights are damaged or "
                             "overflow float32): the message is dropped")
        if s.repeat_penalty != 1.0 and len(recent) and s.repeat_last_n:
            ids = np.unique(np.asarray(recent[-s.repeat_last_n :], dtype=np.int64))
            v = x[ids]
            x[ids] = np.where(v > 0, v / s.repeat_penalty, v * s.repeat_penalty)
        if s.temperature == 0:
            return np.array([int(np.argmax(x))]), np.ones(1)
        # Candidates sorted by logit, best first; filters cut the tail.
        k = x.size if s.top_k <= 0 else min(s.top_k, x.size)
        cand = np.argpartition(-x, k - 1)[:k] if k < x.size else np.arange(x.size)
        cand = cand[np.argsort(-x[cand], kind="stable")]
        with np.errstate(over="ignore"):  # a tiny temperature: every other candidate's exp is 0
            z = (x[cand] - x[cand[0]]) / s.temperature  # <= 0, the best is 0
        p = np.exp(z)
        p /= p.sum()
        keep = p.size
        if s.min_p > 0:
            keep = min(keep, int(np.sum(p >= s.min_p * p[0])))
        if s.top_p < 1:
            keep = min(keep, int(np.searchsorted(np.cumsum(p), s.top_p)) + 1)
        p = p[: max(keep, 1)]
        p /= p.sum()
        return cand[: p.size], p
