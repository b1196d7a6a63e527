"""The GGUF stays mapped for the whole run: a file cut short, rewritten, replaced or deleted under it
costs at most the answer under way, never a saved turn (Tensors.whole, checked before every pass)."""

from __future__ import annotations

import os
import shutil
import signal

import numpy as np
import pytest
from app_helpers import Recorder, run
from cli_helpers import TINY_ARGS, TINY_LLAMA, chat, finish, lines, read_until, saved_turns, start
from conftest import TINY

from colichat.conversation.chat import Conversation
from colichat.conversation.settings import Settings
from colichat.engine import load
from colichat.errors import ModelError
from colichat.persist import Store

IDS = [5, 17, 200, 33]


@pytest.fixture
def copied(tmp_path):
    """A copy of the tiny llama, loaded: (its path, the model)."""
    path = tmp_path / "llama.gguf"
    shutil.copy(TINY / "llama.gguf", path)
    return path, load(str(path), n_ctx=64)


def test_a_model_file_cut_short_refuses_the_next_pass_before_it_reads(copied):
    path, model = copied
    model.prefill(IDS)
    size = path.stat().st_size
    os.truncate(path, size // 2)
    with pytest.raises(ModelError) as e:
        model.decode(9)
    assert str(e.value) == (f"the model file {path} was cut short while colichat ran ({size // 2:,} bytes, was "
                            f"{size:,}): restart colichat with a whole file")
    assert model.cache.length == len(IDS)  # the rows before stay; the pass refused added none
    with pytest.raises(ModelError, match="cut short"):  # refused again, every time
        model.prefill(IDS)


def test_a_model_file_rewritten_in_place_is_refused(copied):
    path, model = copied
    model.prefill(IDS)
    with open(path, "r+b") as f:  # the same bytes at the same inode, as `cp` over it leaves them
        data = f.read()
        f.seek(0)
        f.write(data)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(ModelError, match=rf"^the model file {path} was rewritten while colichat ran: restart"):
        model.decode(9)


@pytest.mark.parametrize("how", ["replaced", "deleted"])
def test_a_replaced_or_deleted_model_file_goes_on_with_its_map_and_says_so_once(copied, tmp_path, how):
    path, model = copied
    before = model.prefill(IDS)
    if how == "replaced":
        other = tmp_path / "other.gguf"
        other.write_bytes(b"GGUF" + b"\0" * 100)  # a new file at the path (a download renamed into place)
        os.replace(other, path)
    else:
        path.unlink()
    model.reset()
    assert np.array_equal(model.prefill(IDS), before)  # the map still holds the file as it was loaded
    assert model.file_note == (f"note: the model file {path} was {how} while colichat ran; this run goes on "
                               "with the file as it was loaded")
    assert model.tensors.whole() is None  # said once


def test_the_message_after_a_cut_is_refused_in_one_line_and_the_saved_exchange_stays(copied, tmp_path):
    path, model = copied
    conv = Conversation(model, Settings(temperature=0, max_tokens=4), session_name="m", store=Store(tmp_path / "s"))
    app = Recorder(conv)
    run(app, "Hello.")
    turns = list(conv.transcript.turns)
    os.truncate(path, path.stat().st_size - 1)
    said = run(app, "Again?")
    assert said == [f"colichat: the model file {path} was cut short while colichat ran "
                    f"({path.stat().st_size:,} bytes, was {path.stat().st_size + 1:,}): restart colichat with a "
                    "whole file"]
    assert conv.transcript.turns == turns and model.cache.length == turns[-1].last and app.errors == 1
    conv.close()


def test_a_replaced_model_file_is_said_after_the_next_answer(copied, tmp_path):
    path, model = copied
    conv = Conversation(model, Settings(temperature=0, max_tokens=4), save=False)
    app = Recorder(conv)
    run(app, "Hello.")
    os.replace(shutil.copy(path, tmp_path / "new.gguf"), path)
    said = run(app, "Again?")
    assert f"note: the model file {path} was replaced while colichat ran; this run goes on with the file as it " \
           "was loaded" in said
    assert not any("note: the model file" in line for line in run(app, "More?"))
    conv.close()


@pytest.mark.process
def test_a_model_file_cut_between_two_answers_costs_no_saved_turn(colichat_home, tmp_path):
    """The issue's test: colichat on a copy of the tiny model answers, the copy is truncated, the next
    message is refused in one line (exit 1, as after any error in line mode), the first exchange stays
    saved, and the next start on the cut file says it is truncated."""
    path = tmp_path / "llama.gguf"
    shutil.copy(TINY_LLAMA, path)
    args = ["--model", path, *TINY_ARGS[2:], "--session", "cut"]
    p = start(colichat_home, args)
    p.stdin.write(b"Hello.\n")
    p.stdin.flush()
    head_err = read_until(p.stderr, b"saved to cut]")  # the first answer's footer: saved
    size = path.stat().st_size
    os.truncate(path, size // 2)
    p.stdin.write(b"Again?\n")  # (finish closes stdin: the end of input)
    r = finish(p, head_err=head_err).failed()
    assert r.errors() == [f"colichat: the model file {path} was cut short while colichat ran ({size // 2:,} "
                          f"bytes, was {size:,}): restart colichat with a whole file"]
    assert [role for role, _ in saved_turns(colichat_home, "cut")] == ["user", "assistant"]
    exported = chat(colichat_home, ["--export", "cut"]).ok().out.decode()
    assert "Hello." in exported and "Again?" not in exported
    again = chat(colichat_home, args, lines("Hello?")).failed()
    assert len(again.errors()) == 1 and "truncated GGUF file" in again.errors()[0]


@pytest.mark.process
def test_a_model_file_cut_during_an_answer_loses_only_that_answer(colichat_home, tmp_path):
    """A cut while an answer streams: the next pass refuses it in one line (exit 1), or, when the cut
    falls inside a pass, colichat dies of SIGBUS; either way only that answer is lost."""
    path = tmp_path / "llama.gguf"
    shutil.copy(TINY_LLAMA, path)
    p = start(colichat_home, ["--model", path, *TINY_ARGS[2:], "--session", "cut"])
    p.stdin.write(b"Hello.\n")
    p.stdin.flush()
    head_err = read_until(p.stderr, b"saved to cut]")
    first = saved_turns(colichat_home, "cut")
    p.stdin.write(b"/set max_tokens 1500\nTell me more.\n")  # (the tiny model's answer: hundreds of tokens)
    p.stdin.flush()
    head_out = read_until(p.stdout, b"\n")  # the first answer's line...
    head_out += read_until(p.stdout)  # ...and some of the second, streaming
    os.truncate(path, path.stat().st_size // 2)
    r = finish(p, head_out, head_err)
    assert "Traceback" not in r.err and r.rc in (1, -signal.SIGBUS), r
    if r.rc == 1:
        assert len(r.errors()) == 1 and "was cut short while colichat ran" in r.errors()[0]
    assert saved_turns(colichat_home, "cut") == first
    exported = chat(colichat_home, ["--export", "cut"]).ok().out.decode()
    assert "Hello." in exported and "Tell me more." not in exported
