"""The transcript (conversation/transcript.py), in process: an edit that fails midway puts back the
cache rows, the turns and the deferred cut together, and the disk is written only by the save that
follows an edit that completed."""

from __future__ import annotations

import json

import numpy as np
import pytest
from cli_helpers import TINY_LLAMA

from colichat.conversation.chat import Conversation, Settings
from colichat.engine import load
from colichat.errors import ChatError
from colichat.persist import Store

Q = ["Hello there", "And again", "Once more"]


@pytest.fixture(scope="module")
def model():
    return load(TINY_LLAMA, n_ctx=512)


def talked(model, store: Store, n: int) -> Conversation:
    """Session s, after the first n questions (Q), each answered and saved."""
    model.reset()
    conv = Conversation(model, Settings(temperature=0, max_tokens=6), store=store, session_name="s")
    for q in Q[:n]:
        conv.ask(q)
    return conv


def saved_users(store: Store) -> list[str]:
    [sidecar] = store.root.glob("*/s.json")
    return [t["text"] for t in json.loads(sidecar.read_text("utf-8"))["turns"] if t["role"] == "user"]


def test_a_failed_edit_puts_back_the_rows_the_turns_and_the_deferred_cut(model, tmp_path):
    store = Store(tmp_path / "s")
    conv = talked(model, store, 2)
    h, cache = conv.transcript, model.cache
    turns, length, rows = list(h.turns), cache.length, cache.records[: cache.length].copy()  # (n,) records
    with pytest.raises(ChatError, match="midway"):
        with h.restored_unless_done(turns[1].first):  # (the first row the edit touches)
            h.defer_cut(h.rebase(turns[1].first))  # the cut waits for the next save
            assert h.unsaved_cut == 1 and cache.length == turns[1].first
            cache.records[turns[1].first : length] = 0
            raise ChatError("midway")
    assert h.turns == turns and h.unsaved_cut is None and cache.length == length
    assert np.array_equal(cache.records[:length], rows)
    assert saved_users(store) == Q[:2]
    conv.close()


def test_regen_that_fails_leaves_memory_and_disk_as_they_were_and_the_next_answer_saves_both(model, tmp_path):
    store = Store(tmp_path / "s")
    conv = talked(model, store, 2)
    h = conv.transcript
    turns, length = list(h.turns), model.cache.length
    with pytest.raises(RuntimeError):
        with h.replacing_last() as user:
            assert user.text == Q[1] and h.unsaved_cut == 2 and h.turns == turns[:2]
            raise RuntimeError("the answer failed")
    assert h.turns == turns and h.unsaved_cut is None and model.cache.length == length
    assert saved_users(store) == Q[:2]  # the disk was not touched
    conv.ask(Q[2])
    assert saved_users(store) == Q
    conv.close()


def test_a_rewind_to_no_exchange_takes_the_waiting_system_prompt_and_says_it_through_history(model, tmp_path):
    store = Store(tmp_path / "s")
    conv = talked(model, store, 1)
    conv.set_option("system", "Be brief.")  # after the first answer: it waits for the next conversation
    assert conv.prefs.settings.system is None and conv.saved_name == "s"
    dropped = conv.rewind(1)
    assert [t.role for t in dropped] == ["user", "assistant"] and conv.transcript.turns == []
    assert conv.prefs.settings.system == "Be brief." and conv.saved_name is None  # off the disk until an answer
    conv.close()
