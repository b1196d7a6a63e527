"""Choose the next token from logits: greedy, or temperature with top-k / top-p / min-p filters,
after a repetition penalty over recent tokens. Randomness comes from one seeded numpy Generator,
so the same seed and settings give the same tokens.

SamplerSettings' defaults are colichat's: the settings table (settings.py) takes its defaults from
them, so a user, a test and a benchmark that leave a value out all get the same one; it takes the
rules a value must meet from here too (`broken_rule`), so they are written once.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace

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
        """ValueError naming the setting for values the sampler cannot use (broken_rule)."""
        for field in fields(self):
            broken = broken_rule(field.name, getattr(self, field.name))
            if broken:
                raise ValueError(f"{field.name} {broken}")


# What each sampling setting must be, said after its name when it is not ("top_p must be in (0, 1]").
RANGES = {
    "temperature": (lambda v: v >= 0, "must be >= 0 (0 means greedy)"),
    "top_k": (lambda v: v >= 0, "must be >= 0 (0 means off)"),
    "top_p": (lambda v: 0 < v <= 1, "must be in (0, 1]"),
    "min_p": (lambda v: 0 <= v < 1, "must be in [0, 1)"),
    "repeat_penalty": (lambda v: v > 0, "must be > 0 (1 means off)"),
    "repeat_last_n": (lambda v: v >= 0, "must be >= 0"),
    "seed": (lambda v: v >= 0, "must be >= 0"),
}
WHOLE = ("top_k", "repeat_last_n", "seed")  # the others are numbers, whole or not


def broken_rule(key: str, value) -> str | None:
    """The rule of sampling setting `key` that `value` breaks ("must be >= 0"), or None: a whole number
    for WHOLE (seed may be None: a fresh seed), a finite number for the others, then its RANGES entry.
    Settings read back from a file may hold any JSON value: the type is checked first."""
    if key in WHOLE:
        if value is None and key == "seed":
            return None
        if not isinstance(value, int) or isinstance(value, bool):
            return f"must be a whole number, not {value!r}"
    elif isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return "must be a finite number"
    check, rule = RANGES[key]
    return None if check(value) else rule


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
