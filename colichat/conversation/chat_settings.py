"""The settings a conversation runs with: the values (settings.Settings), the ones given on the
command line (a resumed session keeps those), a system prompt or a thinking switch waiting for the
next conversation, the sampler built from them, and how a new conversation keeps its cache (--kv, /set
kv). Writing them into the session is the conversation's call."""

from __future__ import annotations

import contextlib

from ..engine import Sampler
from ..errors import ChatError
from .settings import BY_NAME, Settings, saved_values
from .system_prompt import refusal
from .thinking import thinks


class ChatSettings:
    def __init__(self, settings: Settings, pinned=frozenset(), kv: str | None = None):
        self.settings = settings
        self.kv = kv or "f32"  # how a new conversation's rows are stored (--kv); a saved one keeps its own
        self.kv_from = "--kv" if kv else None  # who chose it (--kv, /set kv); None: the default, chosen by no one
        self.pinned = frozenset(pinned)  # settings given on the command line: a resumed session keeps them
        self.sampler = Sampler(settings.sampler())
        self.pending_system: str | None | bool = False  # a /set system waiting for the next conversation
        self.pending_think: str | None = None  # a /set think across on and off, waiting for the next conversation
        self.opens = {True: False, False: False}  # whether the template opens <think> before each answer, by
        # thinks(think) (thinking.opens_thinking; Conversation renders it)

    @property
    def thinks(self) -> bool:
        """Whether the chat template is asked to let the model think (its `enable_thinking`)."""
        return thinks(self.settings.think)

    @property
    def opens_thinking(self) -> bool:
        """Whether this conversation's answers begin inside the thinking (the template opened it)."""
        return self.opens[self.thinks]

    def options(self) -> dict:
        """Every setting's value (and the system prompt waiting for the next conversation)."""
        return {**self.settings.to_dict(),
                **({"system (next)": self.pending_system} if self.pending_system is not False else {}),
                **({"think (next)": self.pending_think} if self.pending_think is not None else {})}

    def set(self, key: str, value, started: bool) -> tuple[str, bool]:
        """Change one setting (a name of settings.TABLE; SettingError for a value it cannot take).
        Returns what to tell the user, and whether the settings in use changed (a new system prompt
        for a conversation that has `started` waits for the next one)."""
        row = BY_NAME[key]
        row.validate(value)
        if key == "system" and started and value == self.settings.system:  # the one in use: nothing waits
            dropped = self.pending_system is not False
            self.pending_system = False
            return f"system = {row.show(value)}" + (" (the one that waited for the next conversation is dropped)"
                                                    if dropped else ""), False
        if key == "system" and started:  # the conversation so far was read with the old one
            self.pending_system = value
            return "system prompt set for the next conversation (/new starts one)", False
        if key == "think":
            self.pending_think = None
            if started and thinks(value) != self.thinks:  # its prompts were made with the other switch
                self.pending_think = value
                return (f"think = {value} from the next conversation (/new starts one): this one was "
                        f"{'made without' if value != 'off' else 'made with'} thinking"), False
        self._use(self.settings.with_(**{key: value}))
        return f"{key} = {row.show(value)}", True

    def set_kv(self, codec: str, cache, fresh: bool) -> str:
        """/set kv CODEC: how new conversations keep their cache (--kv); an empty one (`fresh`: no turn,
        nothing saved) takes it now."""
        problem = cache.codec_problem(codec)
        if problem:
            raise ChatError(problem)
        self.kv, self.kv_from = codec, "/set kv"
        if fresh:
            cache.set_codec(codec)
        if cache.codec == codec:
            return f"kv = {codec}"
        return f"kv = {codec} (for new conversations: this one stays {cache.codec}, as it was saved)"

    def saved(self) -> dict:
        """What a session keeps: the settings, with a seed where its random numbers stand (so a
        resumed conversation draws what it would have drawn had it never stopped), and whether its
        answers begin inside the thinking (`colichat --export`, which reads no model, marks it so)."""
        random = {"random": self.sampler.state} if self.settings.seed is not None else {}
        opens = {"opens_thinking": True} if self.opens_thinking else {}
        return {**self.settings.to_dict(), **random, **opens}

    def apply_saved(self, d, started: bool) -> None:
        """Take a resumed session's saved settings, except those given on the command line, and its
        random numbers where the seed is the one they were drawn with."""
        saved = saved_values(d)
        given = self.settings.think
        if "think" in self.pinned and started and thinks(saved.get("think", given)) != thinks(given):
            # --think across on and off on a resumed conversation: it was made with the saved one's switch
            self.pending_think, self.settings = given, self.settings.with_(think=saved["think"])
        if "system" in self.pinned and started and saved.get("system") != self.settings.system:
            # --system on a resumed conversation: it was read with the saved one; the new one waits
            self.pending_system = self.settings.system
            self.settings = self.settings.with_(system=saved.get("system"))
        self._use(self.settings.with_(**{k: v for k, v in saved.items() if k not in self.pinned}))
        random = d.get("random") if isinstance(d, dict) else None
        if random is not None:
            with contextlib.suppress(ValueError):  # another seed's, or damaged: the seed's first numbers instead
                self.sampler.state = random

    def check_saved_system(self, tokenizer) -> list[str]:
        """A reopened conversation's system prompt that the chat template refuses cannot be what its
        cache was read with (the template is part of the model's fingerprint): it is dropped, saying
        so, else every message would fail. (One that leaves no room for a message cannot be reopened:
        a saved conversation has an exchange, and its tokens must fit the context.)"""
        system = self.settings.system
        why = None if system is None else refusal(tokenizer, system)
        if why is None:
            return []
        self.settings = self.settings.with_(system=None)
        return [f"warning: the saved system prompt is not used: this model's chat template takes no system "
                f"prompt ({why})"]

    def next_conversation(self) -> bool:
        """A new conversation takes the system prompt and thinking switch that waited for it; True when one did."""
        waited = self.pending_system is not False or self.pending_think is not None
        if self.pending_system is not False:
            self.settings, self.pending_system = self.settings.with_(system=self.pending_system), False
        if self.pending_think is not None:
            self.settings, self.pending_think = self.settings.with_(think=self.pending_think), None
        return waited

    def _use(self, settings: Settings) -> None:
        """Sample with `settings`; the random numbers go on where they were unless the seed changed."""
        same_seed = settings.seed == self.settings.seed
        self.settings = settings
        self.sampler = Sampler(settings.sampler(), rng=self.sampler.rng if same_seed else None)
