"""`colichat --prune-kv DAYS`: the KV files of conversations not used for DAYS days go, their text stays,
and reopening one reads it again, whole; a conversation open elsewhere, or whose text cannot all be read
again, keeps its KV file."""

from __future__ import annotations

import json
import time

import pytest
from cli_helpers import TINY_LLAMA
from persist_helpers import Ticks

from colichat.conversation.chat import Conversation, Settings
from colichat.engine import load
from colichat.persist import Store
from colichat.persist.prune import RECENT_S, choose, prune_kv
from colichat.terminal import cli


@pytest.fixture(scope="module")
def model():
    return load(TINY_LLAMA, n_ctx=512)


def talk(model, store: Store, name: str, questions) -> list[str]:
    model.reset()
    conv = Conversation(model, Settings(temperature=0, max_tokens=6), store=store, session_name=name)
    for q in questions:
        conv.ask(q)
    texts = [t.text for t in conv.transcript.turns]
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
    lines = prune_kv(choose(store, days, now=now), days)
    assert lines[-1].startswith("freed ") and "of 1 conversation not used for" in lines[-1]
    assert not infos["old"].path.exists() and infos["old"].path.with_suffix(".json").exists()
    assert infos["new"].path.exists()
    model.reset()
    conv = Conversation(model, Settings(temperature=0, max_tokens=6), store=store)
    notes, progress = [], []
    said = conv.resume("old", on_progress=lambda done, total: progress.append((done, total)), on_note=notes.append)
    saved = json.loads(infos["old"].path.with_suffix(".json").read_text("utf-8"))["nrec"]
    assert notes == [f"old: its KV file was pruned; reading its 2 exchanges again ({saved} tokens) ..."]
    assert said == ""  # one plain line: no "resumed 0 tokens", no warning, no note after it
    assert progress[0] == (0, saved) and progress[-1][1] == conv.model.cache.length  # one count, to the tokens read
    assert [t.text for t in conv.transcript.turns] == old
    conv.close()


def test_a_kv_file_removed_by_hand_reads_again_in_one_plain_line_and_a_damaged_one_warns(model, colichat_home):
    store = Store()
    talk(model, store, "gone", ["Hello there"])
    talk(model, store, "hurt", ["Hello there"])
    infos = {i.name: i for i in store.list()}
    infos["gone"].path.unlink()
    infos["hurt"].path.write_bytes(b"not a KV file at all, longer than a header would be" * 4)
    model.reset()
    conv = Conversation(model, Settings(temperature=0, max_tokens=6), store=store)
    notes = []
    assert conv.resume("gone", on_note=notes.append) == ""
    assert notes[0].startswith("gone: its KV file is not there; reading its 1 exchange again (") and len(notes) == 1
    model.reset()
    conv.close()
    conv = Conversation(model, Settings(temperature=0, max_tokens=6), store=store)
    notes = []
    said = conv.resume("hurt", on_note=notes.append)
    assert "is damaged" in notes[0] and said.startswith("note: read 1 exchange again")
    conv.close()


def test_prune_kv_0_keeps_the_last_hours_conversations_unless_all(model, colichat_home):
    store = Store()
    talk(model, store, "recent", ["Hello there"])
    now = store.list()[0].last_used
    assert choose(store, 0, now=now) == [] and choose(store, 0, now=now + RECENT_S - 60) == []
    assert [c.info.name for c in choose(store, 0, now=now + RECENT_S + 60)] == ["recent"]
    assert [c.info.name for c in choose(store, 0, now=now, everything=True)] == ["recent"]


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
    lines = prune_kv(choose(store, 0, now=time.time() + 60, everything=True), 0)
    assert any(line.startswith("kept busy's KV file: session busy is open in another colichat") for line in lines)
    assert "kept old's KV file: its saved text cannot all be read again" in lines
    assert "of 0 conversations" in lines[-1]
    assert all(i.path.exists() for i in store.list())
    holder.close()


class Terminal:
    """stdin as a terminal where a person answers `answer`."""

    def __init__(self, answer: str):
        self.answer = answer

    def isatty(self) -> bool:
        return True

    def readline(self) -> str:
        return self.answer


def test_prune_kv_lists_what_it_frees_and_asks_on_a_terminal(model, colichat_home, capsys, monkeypatch):
    talk(model, Store(), "a", ["Hello there"])
    monkeypatch.setattr("sys.stdin", Terminal("n\n"))
    assert cli.main(["--prune-kv", "0", "--all"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("--prune-kv 0 frees ") and "\n  " in err and ": a: 2 turns" in err
    assert "Free them? [y/N] " in err and err.endswith("nothing pruned\n")
    assert list(Store().root.glob("*/a.coli_kv"))
    monkeypatch.setattr("sys.stdin", Terminal("y\n"))
    assert cli.main(["--prune-kv", "0", "--all"]) == 0
    assert "freed " in capsys.readouterr().err and not list(Store().root.glob("*/a.coli_kv"))


def test_prune_kv_0_on_a_terminal_keeps_the_last_hour_and_says_what_all_does(model, colichat_home, capsys,
                                                                              monkeypatch):
    talk(model, Store(), "a", ["Hello there"])
    monkeypatch.setattr("sys.stdin", Terminal("y\n"))
    assert cli.main(["--prune-kv", "0"]) == 0
    assert capsys.readouterr().err == ("nothing to prune: no conversation's KV file unused for the last hour "
                                       "(--all prunes those too)\n")
    assert cli.main(["--prune-kv", "0", "--all", "--yes"]) == 0  # --yes: no question
    err = capsys.readouterr().err
    assert "Free them?" not in err and "freed " in err and not list(Store().root.glob("*/a.coli_kv"))


def test_prune_kv_from_the_command_line(model, colichat_home, capsys):
    talk(model, Store(), "a", ["Hello there"])
    assert cli.main(["--prune-kv", "0", "--all"]) == 0  # stdin is no terminal here: no question
    assert "freed " in capsys.readouterr().err
    assert not list(Store().root.glob("*/a.coli_kv")) and list(Store().root.glob("*/a.json"))
    assert cli.main(["--prune-kv", "-1"]) == 2  # a usage error, in one line
    assert cli.main(["--prune-kv", "1", "--sessions"]) == 2
    assert cli.main(["--yes"]) == 2
    assert capsys.readouterr().err.splitlines() == ["colichat: --prune-kv takes a number of days, 0 or more",
                                                    "colichat: --sessions and --prune-kv each do their work and exit: "
                                                    "give one of them",
                                                    "colichat: --yes goes with --prune-kv DAYS, which it answers or "
                                                    "widens"]
