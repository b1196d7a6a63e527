"""A context about to fill up, in pipe mode: the footer says what is left, a message that does not
fit is refused before anything is answered with what helps, and /forget continues without the
oldest exchanges."""

from __future__ import annotations

import re

from cli_helpers import TINY_LLAMA, chat_here, lines, saved_turns, saved_users, session_names

FULL = ["--model", TINY_LLAMA, "--temperature", "0", "--max-tokens", "8"]  # the model's whole context (2048)
LONG = [" ".join(f"topic{k}-word{i}" for i in range(45)) for k in range(4)]  # ~590 tokens each


def test_a_message_that_does_not_fit_is_refused_with_what_helps(colichat_home):
    run = chat_here(colichat_home, [*FULL, "--session", "full"], lines(*LONG, "/forget", LONG[3], "/sessions")).failed()
    contexts = [int(m) for m in re.findall(r"(\d+) of 2048 context left", run.err)]
    assert len(contexts) == 4
    [refusal] = run.errors()
    assert re.fullmatch(r"colichat: the message needs \d+ tokens but only \d+ of the context of 2048 are left; "
                        r"it was not sent: /forget goes on in a new conversation without the oldest exchanges "
                        r"\(--auto-forget does so by itself\); /rewind N drops the last N exchanges; /new starts a new "
                        r"conversation", refusal), refusal
    assert "--ctx" not in run.err  # the model's whole context is in use already
    # /forget: a new conversation from the exchanges that fill at most half the context, then the message.
    assert saved_users(colichat_home, "full") == LONG[:3]
    new = session_names(run)[-1]
    assert new == "full-cont" and saved_users(colichat_home, new) == LONG[2:4]  # named after where it came from
    assert saved_turns(colichat_home, new)[:2] == saved_turns(colichat_home, "full")[4:]
    [said] = [line for line in run.err.splitlines() if line.startswith("new conversation without")]
    assert said.startswith("new conversation without the 2 oldest exchanges of full (still saved as it was): "
                           "1 exchange, ") and said.endswith(f" tokens read again; saved as {new}")
    assert 2048 - contexts[-1] < 1024 + 700


def test_a_note_before_an_answer_that_may_be_cut(colichat_home):
    run = chat_here(colichat_home, ["--model", TINY_LLAMA, "--temperature", "0", "--ctx", "300", "--max-tokens", "250",
                               "--no-save"], lines(LONG[0][:120])).ok()
    err = run.err.splitlines()
    [note] = [i for i, line in enumerate(err) if line.startswith("note: ") and "left for the answer" in line]
    assert err[note].endswith("left for the answer, which may be cut (a larger --ctx at the next start (this model "
                              "takes up to 2048))")  # a first message: no exchange to drop
    assert note < err.index(run.footers()[0])


def test_forgetting_every_exchange_is_a_new_empty_conversation(colichat_home):
    run = chat_here(colichat_home, [*FULL, "--session", "one"], lines("hello", "/forget", "/history", "again")).ok()
    assert "new empty conversation: its one exchange forgotten (one is still saved as it was)" in run.err.splitlines()
    assert "the conversation is empty" in run.err.splitlines()
    assert saved_users(colichat_home, "one") == ["hello"]


def test_a_conversation_that_filled_its_context_reopens_full_and_goes_on_after_a_rewind(colichat_home):
    """Come back to a conversation whose last answer filled the whole context: it reopens as it was (it
    was refused, a dead end at the model's largest context, where no --ctx makes room), the resume says
    the context is full and what helps, and after /rewind it goes on."""
    args = ["--model", TINY_LLAMA, "--temperature", "0", "--ctx", "64", "--max-tokens", "100"]
    first = chat_here(colichat_home, [*args, "--session", "f"], lines("hello")).ok()
    [footer] = first.footers()
    assert "context full; saved to f]" in footer, footer
    run = chat_here(colichat_home, [*args, "--session", "f"], lines("/history", "/rewind", "hi")).ok()
    used = int(re.search(r"^resumed (\d+) tokens, 2 turns from f in", run.err, re.M).group(1))
    assert used >= 63
    assert (f"note: the context is full ({used} of 64 tokens): /rewind 1 drops the last exchange; /new starts a "
            "new conversation; a larger --ctx at the next start (this model takes up to 2048)") in run.err.splitlines()
    assert "user> hello" in run.err.splitlines()  # /history: the conversation as it was saved
    assert saved_users(colichat_home, "f") == ["hi"]


def test_the_cut_answer_and_the_next_refusal_give_the_same_ways_on_each_where_it_applies(colichat_home):
    args = ["--model", TINY_LLAMA, "--temperature", "0", "--ctx", "64", "--max-tokens", "100", "--no-save"]
    run = chat_here(colichat_home, args, lines("hello", "and what else can you say about it")).failed()
    [cut] = [line for line in run.err.splitlines() if line.startswith("note: the answer was cut: the context is full")]
    [refusal] = run.errors()
    ways = cut.split("the context is full: ", 1)[1]
    assert refusal.endswith(f"it was not sent: {ways}")
    assert ways == ("/rewind 1 drops the last exchange; /new starts a new conversation; a larger --ctx at the next "
                    "start (this model takes up to 2048)")  # one exchange: no /forget
