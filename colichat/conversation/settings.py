"""The chat settings: one table (name, type, default, help, rule) that the command-line options,
/set, /show, the session's sidecar and the help texts all read.

    s = Settings(temperature=0)             # the others take their defaults
    s.max_tokens, s.sampler()               # a value; the engine's SamplerSettings
    row = BY_NAME["seed"]; row.parse("none")   # None; SettingError with one line for bad text
    row.show(value)                         # the value as a user types it (/show, then /set KEY VALUE)
    s.to_dict() / saved_values(d)           # the sidecar's "sampler" object, and back (bad keys skipped)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..engine import SamplerSettings
from ..engine.sampler import broken_rule
from ..engine.speculative import MAX_DRAFT
from ..errors import SettingError
from .thinking import MODES


def unquoted(text: str) -> str:
    """`text` without one pair of enclosing quotes ('...' or "..."), as a shell would read one word."""
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text


def printable(text: str, limit: int = 60) -> str:
    """`text` for an error line: control and line-break characters escaped, long text cut."""
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def rule(check: Callable[[object], bool], text: str) -> Callable[[object], str | None]:
    """A setting's rule: `text` ("must be >= 0") for a value that fails `check`, else None."""
    return lambda value: None if check(value) else text


def sampling_rule(name: str) -> Callable[[object], str | None]:
    """A sampling setting's rule, as the sampler states it (engine/sampler.py: broken_rule)."""
    return lambda value: broken_rule(name, value)


@dataclass(frozen=True)
class Setting:
    name: str
    kind: type  # int, float or str
    default: object
    help: str
    broken: Callable[[object], str | None] = lambda v: None  # the rule a value breaks ("must be >= 0"), or None
    optional: bool = False  # `none` unsets it (the value None)
    metavar: str = "N"
    choices: tuple[str, ...] = ()  # a word setting's values (typed in any case)

    @property
    def option(self) -> str:
        """The command-line option, e.g. --top-k."""
        return "--" + self.name.replace("_", "-")

    def parse(self, text: str, label: str | None = None):
        """The value for what the user typed: numbers as Python reads them, `none` for an optional
        setting, text as is (one pair of enclosing quotes removed). `label` names it in errors."""
        label = label or self.name
        t = text.strip()
        if self.kind is str and self.choices:
            t = unquoted(t).strip().lower()
            self.validate(t, label)
            return t
        if self.kind is str:
            t = unquoted(t)
            return None if self.optional and (not t or t.lower() == "none") else t
        if self.optional and t.lower() == "none":
            return None
        if not t:
            raise SettingError(f"{label} needs a value")
        try:
            value = self.kind(t)
        except ValueError:
            what = "a whole number" if self.kind is int else "a number"
            raise SettingError(f"{label} takes {what}{' or none' if self.optional else ''}, "
                               f"not '{printable(t)}'") from None
        self.validate(value, label)
        return value

    def validate(self, value, label: str | None = None) -> None:
        if value is None and self.optional:
            return
        broken = self.broken(value)
        if broken:
            raise SettingError(f"{label or self.name} {broken}")

    def show(self, value) -> str:
        """The value as the user would type it: `none`, a number, the text itself."""
        return "none" if value is None else str(value) if self.kind is str else repr(value)


SAMPLING = SamplerSettings()  # the sampling settings' defaults are the sampler's (one source: engine/sampler.py)

TABLE: tuple[Setting, ...] = (
    Setting("temperature", float, SAMPLING.temperature, "0 = greedy; higher = more random",
            sampling_rule("temperature"), metavar="T"),
    Setting("top_k", int, SAMPLING.top_k, "keep the K most likely tokens (0 = off)",
            sampling_rule("top_k"), metavar="K"),
    Setting("top_p", float, SAMPLING.top_p,
            "keep the smallest set of tokens with this total probability (1 = off)",
            sampling_rule("top_p"), metavar="P"),
    Setting("min_p", float, SAMPLING.min_p,
            "drop tokens below this fraction of the best one's probability (0 = off)",
            sampling_rule("min_p"), metavar="P"),
    Setting("repeat_penalty", float, SAMPLING.repeat_penalty, "penalize the tokens of the repeat window (1 = off)",
            sampling_rule("repeat_penalty"), metavar="R"),
    Setting("repeat_last_n", int, SAMPLING.repeat_last_n,
            "the repeat window: how many recent tokens repeat_penalty looks at",
            sampling_rule("repeat_last_n")),
    Setting("seed", int, SAMPLING.seed, "random seed: the same seed gives the same answers (none = a fresh one)",
            sampling_rule("seed"), optional=True),
    Setting("max_tokens", int, 512, "the longest answer, in tokens",
            rule(lambda v: v >= 1, "must be at least 1")),
    # speculative decoding: the largest number of drafts per pass, by default the most a pass checks exactly
    # (speculative.MAX_DRAFT, 15; BENCHMARKS.md: 15 did best on the echo tasks, none slowed chat beyond the noise)
    Setting("draft", int, MAX_DRAFT, "speculative decoding: at most this many tokens guessed from the conversation "
            "(or by the model's MTP block) are checked per step (0 = off; the same answer, greedy or with a seed)",
            rule(lambda v: 0 <= v <= MAX_DRAFT, f"must be between 0 (off) and {MAX_DRAFT}")),
    Setting("system", str, None, "the system prompt (none = no system prompt); a new one applies from "
            "the next conversation when this one has started", optional=True, metavar="TEXT"),
    Setting("think", str, "fold", "a thinking model's reasoning (<think>...</think>): fold = one dim line "
            "counting its tokens, show = its text, dim, hide = nothing; answers and /history show it so, "
            "/export always keeps it; off = ask the model not to think (models with the switch: V3.1, GLM, "
            "Qwen3), from the next conversation when this one has started",
            rule(lambda v: v in MODES, "must be show, fold, hide or off"), metavar="MODE", choices=MODES),
)
BY_NAME = {row.name: row for row in TABLE}
SAMPLER_KEYS = tuple(SamplerSettings.__dataclass_fields__)


def key_of(text: str) -> str:
    """A setting's name as typed (`top-k`, `Top_K`) -> its table name, or SettingError."""
    key = text.strip().lower().replace("-", "_")
    if key not in BY_NAME:
        raise SettingError(f"cannot set '{printable(text.strip())}': one of {', '.join(BY_NAME)}")
    return key


class Settings:
    """A value for every setting of TABLE (the default for those not given). Immutable: `with_`
    returns a changed copy, checked row by row."""

    __slots__ = ("_values",)

    def __init__(self, **values):
        unknown = set(values) - set(BY_NAME)
        if unknown:
            raise TypeError(f"unknown settings {sorted(unknown)}")  # a caller bug
        for key, value in values.items():
            if BY_NAME[key].kind is float and isinstance(value, int) and not isinstance(value, bool):
                values[key] = value = float(value)
            BY_NAME[key].validate(value)
        object.__setattr__(self, "_values", {row.name: values.get(row.name, row.default) for row in TABLE})

    def __getattr__(self, name: str):
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name, value):
        raise AttributeError("Settings are immutable: use with_()")

    def __eq__(self, other) -> bool:
        return isinstance(other, Settings) and self._values == other._values

    def __repr__(self) -> str:
        return "Settings(" + ", ".join(f"{k}={v!r}" for k, v in self._values.items()) + ")"

    def with_(self, **changes) -> Settings:
        return Settings(**{**self._values, **changes})

    def to_dict(self) -> dict:
        return dict(self._values)

    def sampler(self) -> SamplerSettings:
        return SamplerSettings(**{k: self._values[k] for k in SAMPLER_KEYS})


def damaged_settings(d) -> list[str]:
    """One line naming the settings of a sidecar's "sampler" object that `saved_values` skips (a wrong
    type or a value out of range: a damaged session), or none."""
    good = saved_values(d)
    bad = [f"{k} {v!r}" for k, v in (d.items() if isinstance(d, dict) else ()) if k in BY_NAME and k not in good]
    return [f"the session's saved settings are damaged ({', '.join(bad)}); kept the current values of those"] \
        if bad else []


def saved_values(d) -> dict:
    """The usable settings of a sidecar's "sampler" object; a damaged or unknown entry is skipped."""
    out = {}
    for key, value in (d.items() if isinstance(d, dict) else ()):
        row = BY_NAME.get(key)
        if row is None or isinstance(value, bool):
            continue
        if row.kind is float and isinstance(value, int):
            value = float(value)
        if not (isinstance(value, row.kind) or (value is None and row.optional)):
            continue
        try:
            row.validate(value)
        except SettingError:
            continue
        out[key] = value
    return out
