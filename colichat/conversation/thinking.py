"""Thinking models' answers: the reasoning that DeepSeek-R1, V3.1 (thinking), GLM-4.5 to 5.x and
Kimi-K2-Thinking write between <think> and </think> before their answer.

A turn keeps the model's text as it was generated (the cache holds those tokens, and the chat
template decides what of an earlier answer the model reads again: R1's, V3.1's and GLM's drop the
thinking). This module only sorts that text into thinking and answer, for what the user sees:

    opens_thinking(prompt)           # the template's generation prompt ends with <think> (R1, GLM-4.7/5.x)
    split(text, opened)              # (thinking or None, answer) of a saved answer
    s = Splitter(opened); s.feed(piece) -> [(thinking?, text), ...]; s.end()   # an answer as it streams
    LiveThinking(app)                # how the thinking shows while it streams: /set think show|fold|hide|off

`opened`: the answer starts inside the thinking, with no opening tag (R1, V3.1 asked to think,
GLM-4.7/5.x); otherwise an answer thinks first when it starts with <think> (GLM-4.5 and 4.6 write the
tag themselves). Thinking without a </think> was cut short (Ctrl-C, max_tokens): all of it is thinking.

`think off` asks the model not to think where its chat template has the switch (V3.1, GLM-4.5 to 5.x,
Qwen3: `enable_thinking` false, as llama.cpp's `--reasoning-budget 0`); the other modes ask it to think
(the templates' own default, but V3.1's). A model that thinks whatever it is asked (R1) shows as fold.
"""

from __future__ import annotations

from ..units import count
from ..wrap import dimmed

OPEN, CLOSE = "<think>", "</think>"
MODES = ("show", "fold", "hide", "off")  # the values of the `think` setting


def thinks(mode: str) -> bool:
    """Whether a chat template is asked to let the model think (its `enable_thinking`) in this mode."""
    return mode != "off"


def shown_as(mode: str) -> str:
    """How thinking shows in this mode: show, fold or hide (off: fold, for a model that thinks anyway)."""
    return "fold" if mode == "off" else mode
START, THINKING, AFTER, ANSWER = range(4)  # Splitter states: AFTER skips the blank lines after </think>


def opens_thinking(prompt: str) -> bool:
    """Whether a rendered prompt leaves the model inside its thinking (R1's `<think>\\n`, GLM's `<think>`)."""
    return prompt.rstrip().endswith(OPEN)


def split(text: str, opened: bool) -> tuple[str | None, str]:
    """(the thinking, the answer) of an answer's text, both without the tags and the blank lines
    around them: (None, text) when it does not think, (None, answer) when it thinks nothing
    (`<think></think>`), (thinking, "") when it was cut short before its `</think>`."""
    rest = text
    if not opened:
        rest = text.lstrip()
        if not rest.startswith(OPEN):
            return None, text
        rest = rest[len(OPEN):]
    thinking, _, answer = rest.partition(CLOSE)
    return thinking.strip() or None, answer.lstrip()


def _tag_start(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (what may be a tag arriving in pieces)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class Splitter:
    """An answer's text as it arrives, sorted as split() sorts it whole: feed(piece) returns
    [(True, thinking text) or (False, answer text)]. Text that may begin a tag, and whitespace at
    the thinking's end, are held until the next piece tells what they are; end() gives them back."""

    def __init__(self, opened: bool):
        self.state = THINKING if opened else START
        self.held = ""
        self.begun = False  # thinking text given out (its leading blank lines are not)

    @property
    def thinking(self) -> bool:
        return self.state == THINKING

    def feed(self, piece: str) -> list[tuple[bool, str]]:
        text, self.held, out = self.held + piece, "", []
        while text:
            if self.state == START:
                lead = text.lstrip()
                if not lead or (OPEN.startswith(lead) and lead != OPEN):
                    self.held = text  # blank, or perhaps the opening tag: the next piece tells
                    break
                if lead.startswith(OPEN):
                    self.state, text = THINKING, lead[len(OPEN):]
                else:
                    self.state = ANSWER
            elif self.state == THINKING:
                end = text.find(CLOSE)
                if end >= 0:
                    self._think(text[:end].rstrip(), out)
                    self.state, text = AFTER, text[end + len(CLOSE):]
                    continue
                body = text[: len(text) - _tag_start(text, CLOSE)]
                self._think(body.rstrip(), out)
                self.held = text[len(body.rstrip()):]
                break
            elif self.state == AFTER:
                text = text.lstrip()
                if text:
                    self.state = ANSWER
            else:
                out.append((False, text))
                break
        return out

    def _think(self, text: str, out: list) -> None:
        if not self.begun:
            text = text.lstrip()
        if text:
            self.begun = True
            out.append((True, text))

    def end(self) -> list[tuple[bool, str]]:
        """What was held back, at the end of the answer (a cut one may end inside a tag)."""
        held, self.held = self.held, ""
        if self.state == START and held:
            return [(False, held)]
        out: list = []
        if self.state == THINKING:
            self._think(held.rstrip(), out)
        return out


def head(tokens: int) -> str:
    """The one line that stands for an answer's thinking (folded), or ends it (shown)."""
    return f"thinking ({count(tokens, 'token')})"


class LiveThinking:
    """How an answer's thinking shows while it streams, as the `think` setting says (app: app.App).

    fold: on a terminal, a status line counting its tokens as they come (`thinking ... 312 tokens`),
          then `thinking (312 tokens)` stays, dim, above the answer;
    show: its text as it comes, dim, then that line (piped: between <think> and </think> lines, so
          that a script can tell it from the answer);
    hide: on a terminal a status line `thinking ...` while it lasts, then nothing.
    The footer counts the thinking tokens in every mode."""

    def __init__(self, app):
        self.app = app
        self.tokens = 0
        self.shown = False  # thinking under way, shown as its mode says

    def piece(self, text: str, tokens: int) -> None:
        """A piece of the thinking (perhaps "": the count goes on), after `tokens` thinking tokens."""
        app, mode = self.app, shown_as(self.app.conv.prefs.settings.think)
        self.tokens, first = tokens, not self.shown
        self.shown = True
        if app.hushed or app.output_closed:
            return
        if mode == "show":
            if not app.screen and first:
                text = OPEN + "\n" + text
            if text:
                app.out(text, thinking=True)
            return
        if app.screen:
            app.write(app.screen.follow())
        app.status.show(f"thinking ... {count(tokens, 'token')}" if mode == "fold" else "thinking ...")

    def end(self) -> None:
        """The thinking is over (the answer begins, or ends inside it): what stays of it is shown."""
        if not self.shown:
            return
        app, mode = self.app, shown_as(self.app.conv.prefs.settings.think)
        self.shown = False
        app.status.clear()
        if mode == "hide":
            return
        if app.screen:  # the shown thinking (or a ^C) ends its row
            app.write(app.screen.end_answer())
        elif mode == "show" and not app.hushed:
            app.write(f"\n{CLOSE}\n\n")
        line = head(self.tokens)
        app.say(dimmed(line) if app.dim else line)
