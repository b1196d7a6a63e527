"""The in-process harness of the commands: an App whose status lines are kept for the test, and `run`,
which hands it one typed line and returns what it said; `script`, a model's next answers scripted
(a sampler that draws the tokens of given texts, so a test says what the model writes)."""

from __future__ import annotations

from colichat.engine import Sampler, SamplerSettings
from colichat.terminal.app import App


class Recorder(App):
    """An App whose status lines are kept for the test and whose answers are dropped (kept in
    `written`, with True for a piece of a thinking model's thinking shown)."""

    def __init__(self, conv):
        super().__init__(conv, interactive=False)
        self.lines: list[str] = []
        self.written: list[tuple[bool, str]] = []

    def say(self, line: str, hang: int = 0) -> None:
        self.lines.append(line)

    def out(self, text: str, thinking: bool = False) -> None:
        if not thinking and not self.hushed:
            self.thinking.end()
        self.written.append((thinking, text))

    def write(self, text: str) -> None:
        self.written.append((False, text))


def run(app: Recorder, line: str) -> list[str]:
    """What `app` says for one typed line (a command or a message)."""
    app.lines.clear()
    app.handle(line)
    return list(app.lines)


class Scripted(Sampler):
    """Draws the given token ids in order, then the end of the answer (`end`), whatever the logits."""

    def __init__(self, ids: list[int], end: int):
        super().__init__(SamplerSettings(temperature=0))
        self.ids, self.end = list(ids), end

    def __call__(self, logits, recent=()) -> int:
        return self.ids.pop(0) if self.ids else self.end


def script(conv, *answers: str) -> None:
    """The conversation's model writes `answers` (texts, tokenized with their special tokens), one
    an exchange; its sampler is set again by a /set, which ends the script."""
    ids = [i for text in answers for i in conv.prompt.tok.encode(text, special=True) + [conv.prompt.tok.eos_id]]
    conv.prefs.sampler = Scripted(ids, conv.prompt.tok.eos_id)
