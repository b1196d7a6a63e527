"""`colichat --prune-kv DAYS`: the KV files of conversations not used for DAYS days go, their text stays,
and reopening one reads it again, whole; a conversation open elsewhere, or whose text cannot all be read
again, keeps its KV file."""

from __future__ import annotations

import json
import time

import pytest
from cli_helpers import TINY_LLAMA
from persist_helpers import Ticks

from colichat import cli
from colichat.chat import Conversation, Settings
from colichat.engine import load
from colichat.persist import Store
from colichat.prune import prune_kv


@pytest.fixture(scope="module")
def model():
    return load(TINY_LLAMA, n_ctx=512)


def talk(model, store: Store, name: str, questions) -> list[str]:
    model.reset()
    conv = Conversation(model, Settings(temperature=0, max_tokens=6), store=store, session_name=name)
    for q in questions:
        conv.ask(q)
    texts = [t.text for t in conv.turns]
    conv.close()
    return texts


def test_old_conversations_lose_their_kv_file_and_reopen_whole_from_their_text(model, colichat_home):
    clock = Ticks()
    store = Store(clock=clock)
    old = talk(model, store, "old", ["Hello there", "And again"])
    clock.wait(3600)
    talk(model, store, "new", ["Something else"])
    infos = {i.name: i for i in store.list()}
    now = infos["new"].last_used
    days = (now - (infos["old"].last_used + infos["new"].last_used) / 2) / 86400  # between the two
    lines = prune_kv(store, days, now=now)
    assert lines[-1].startswith("freed ") and "of 1 conversation not used for" in lines[-1]
    assert not infos["old"].path.exists() and infos["old"].path.with_suffix(".json").exists()
    assert infos["new"].path.exists()
    model.reset()
    conv = Conversation(model, Settings(temperature=0, max_tokens=6), store=store)
    said = conv.resume("old")
    assert "read 2 exchanges again from their saved text" in said
    assert [t.text for t in conv.turns] == old
    conv.close()


def test_a_conversation_open_elsewhere_or_not_readable_again_keeps_its_kv_file(model, colichat_home):
    store = Store()
    talk(model, store, "busy", ["Hello there"])
    talk(model, store, "old", ["Hello there"])
    [sidecar] = store.root.glob("*/old.json")
    doc = json.loads(sidecar.read_text("utf-8"))
    doc["format"] = 1  # an older colichat's sidecar: its texts carry no checksum
    sidecar.write_text(json.dumps(doc))
    model.reset()
    holder = Conversation(model, Settings(temperature=0, max_tokens=6), store=store)
    holder.resume("busy")  # open in this (another) colichat
    lines = prune_kv(store, 0, now=time.time() + 60)
    assert any(line.startswith("kept busy's KV file: session busy is open in another colichat") for line in lines)
    assert "kept old's KV file: its saved text cannot all be read again" in lines
    assert "of 0 conversations" in lines[-1]
    assert all(i.path.exists() for i in store.list())
    holder.close()


def test_prune_kv_from_the_command_line(model, colichat_home, capsys):
    talk(model, Store(), "a", ["Hello there"])
    assert cli.main(["--prune-kv", "0"]) == 0
    assert "freed " in capsys.readouterr().err
    assert not list(Store().root.glob("*/a.coli_kv")) and list(Store().root.glob("*/a.json"))
    assert cli.main(["--prune-kv", "-1"]) == 2  # a usage error, in one line
    assert cli.main(["--prune-kv", "1", "--sessions"]) == 2
    assert capsys.readouterr().err.splitlines() == ["colichat: --prune-kv takes a number of days, 0 or more",
                                                    "colichat: --sessions and --prune-kv each do their work and exit: "
                                                    "give one of them"]
