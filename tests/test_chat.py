"""Conversation-level behaviour that the pipe-mode tests cannot time reliably."""

from __future__ import annotations

import pytest
from conftest import TINY

from colichat.chat import ChatError, Conversation, Settings
from colichat.engine import SamplerSettings, load


@pytest.fixture(scope="module")
def model():
    return load(str(TINY / "llama.gguf"), n_ctx=2048)


def test_stop_during_a_long_prompt_drops_the_message(model):
    model.reset()
    conv = Conversation(model, Settings(SamplerSettings(temperature=0), max_tokens=4), save=False)
    conv.ask("hello")
    before = (model.cache.length, list(conv.turns))

    def stop_at_first_step(done, total):
        conv.stop_requested = True  # what Ctrl-C does

    with pytest.raises(ChatError, match="not sent"):
        conv.ask("x y " * 500, on_progress=stop_at_first_step)
    assert (model.cache.length, conv.turns) == before
    answer, _ = conv.ask("hello again")  # and the conversation goes on
    assert conv.exchanges() == 2


def test_stop_during_the_answer_keeps_what_was_said(model):
    model.reset()
    conv = Conversation(model, Settings(SamplerSettings(temperature=0), max_tokens=50), save=False)
    pieces = []

    def on_text(piece):
        pieces.append(piece)
        if len(pieces) == 3:
            conv.stop_requested = True

    answer, stats = conv.ask("tell me", on_text=on_text)
    assert stats.stopped == "interrupt" and answer == "".join(pieces)
    assert conv.turns[-1].last == model.cache.length and stats.generated >= 3
