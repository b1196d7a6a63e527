"""The chat program in pipe mode: colichat's main() with its standard streams on files (chat_here, in
this process), and as the command with stdin piped (chat) where the process is the point: one-shot,
resuming in a new process, CPython's own reading of stdin, the default model.

Contract: each input line is a user turn (a \"\"\" block spans lines), a line starting with `/` is a
command; stdout holds only the model's answers (each ends with a newline), stderr everything else;
exit 0 at the end of input, 1 after an error, 130 on interrupt.

The tiny random-weight llama answers gibberish (newlines and U+FFFD included), so what stdout must hold
is computed from the answers the session's sidecar recorded, and compared byte for byte.
Tests marked default_model run the real SmolLM2-135M-Instruct (a few seconds a run).
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys

import numpy as np
import pytest
from cli_helpers import (
    GREEDY,
    TINY_ARGS,
    TINY_LLAMA,
    answers_bytes,
    chat,
    chat_here,
    env_for,
    finish,
    lines,
    read_until,
    saved_answers,
    saved_users,
    session_files,
    session_names,
    start,
)
from conftest import REF, TINY

from colichat import __version__
from colichat.engine import load_tokenizer
from colichat.models.default import default_model_path, model_title
from colichat.terminal.commands import COMMANDS, listed
from colichat.units import count, format_size
from colichat.wrap import displayable

Q = ["Hello there.", "What is two plus two?", "And three plus three?"]


@pytest.fixture(scope="module")
def tiny_ref(tmp_path_factory):
    """The reference: one uninterrupted greedy conversation of the three questions (session `a`)."""
    home = tmp_path_factory.mktemp("ref")
    run = chat_here(home, [*TINY_ARGS, "--session", "a"], lines(*Q, "/history", "/stats")).ok()
    return home, run, saved_answers(home, "a")


def last_context(run) -> int:
    """The context length the last footer reports (the context less what it says is left)."""
    left, n_ctx = re.search(r"(\d+) of (\d+) context left", run.footers()[-1]).groups()
    return int(n_ctx) - int(left)


# ---- a conversation -----------------------------------------------------------------------------


def test_conversation_stdout_holds_only_the_answers(tiny_ref):
    home, run, answers = tiny_ref
    assert saved_users(home, "a") == Q and len(answers) == 3
    assert run.out == answers_bytes(answers)
    err = run.err.splitlines()
    assert err[0].startswith("llama (llama, 4 layers), loaded in ")  # the file's name; its path with --verbose
    footers = run.footers()
    assert len(footers) == 3 and all(f.endswith("; saved to a]") for f in footers)
    contexts = [used for used, _ in run.contexts()]
    assert contexts == sorted(contexts) and contexts[-1] < 2048
    assert [line for line in err if line.startswith("user> ")] == [f"user> {q}" for q in Q]
    assert f"context: {contexts[-1]} of 2048 tokens, 3 exchanges" in err
    assert any(line.startswith("session a: ") and line.endswith(("KiB on disk", "MiB on disk")) for line in err)
    assert run.errors() == []


def test_rewind_then_same_question_gives_the_same_answer(tiny_ref, colichat_home):
    ref = tiny_ref[2]
    run = chat_here(colichat_home, [*TINY_ARGS, "--session", "rw"], lines(Q[0], Q[1], "/rewind 1", Q[1])).ok()
    assert saved_answers(colichat_home, "rw") == ref[:2]
    assert run.out == answers_bytes([ref[0], ref[1], ref[1]])
    assert f"removed user: {Q[1]}" in run.err.splitlines()
    assert any(line.startswith("rewound 1 exchange; ") for line in run.err.splitlines())


def test_set_show_regen_stats(tiny_ref, colichat_home):
    ref = tiny_ref[2]
    args = ["--model", TINY_LLAMA, "--max-tokens", "8", "--session", "rg"]  # default temperature 0.7
    run = chat_here(colichat_home, args, lines("/set temperature 0", "/show", Q[0], "/regen", "/stats")).ok()
    err = run.err.splitlines()
    assert "temperature = 0.0" in err and "temperature    0.0" in err and "max_tokens     8" in err
    assert run.out == answers_bytes([ref[0], ref[0]])  # greedy: /regen answers the same again
    assert saved_answers(colichat_home, "rg") == [ref[0]]
    ctx = last_context(run)
    assert f"context: {ctx} of 2048 tokens, 1 exchange" in err
    assert any(line.startswith("session rg: ") for line in err)
    assert any(line.startswith("last answer: ") for line in err)
    # The settings travel with the session.
    again = chat_here(colichat_home, [*args, "--resume"], lines("/show")).ok()
    assert "temperature    0.0" in again.err.splitlines()


# ---- resume -------------------------------------------------------------------------------------


@pytest.mark.process
def test_resume_by_name_continues_byte_for_byte(tiny_ref, colichat_home):
    ref = tiny_ref[2]
    b = chat(colichat_home, [*TINY_ARGS, "--session", "b"], lines(Q[0], Q[1])).ok()
    assert b.out == answers_bytes(ref[:2])
    c = chat(colichat_home, [*TINY_ARGS, "--resume", "--session", "b"], lines(Q[2], "/history")).ok()
    assert c.out == answers_bytes(ref[2:])
    assert c.resumed() == (last_context(b), 4, "b")
    # piped, the resume shows no last exchange: the only "user> " lines are /history's
    assert [line for line in c.err.splitlines() if line.startswith("user> ")] == [f"user> {q}" for q in Q]
    assert saved_answers(colichat_home, "b") == ref


@pytest.mark.process
def test_a_seeded_sampled_conversation_resumed_goes_on_as_if_it_never_stopped(colichat_home):
    """With --seed, sampled answers after a resume are those the conversation gives in one run: the
    session keeps where its random numbers stand (a /set of another setting does not restart them)."""
    sampled = ["--model", TINY_LLAMA, "--temperature", "1", "--seed", "42", "--max-tokens", "8"]
    one_run = chat(colichat_home, [*sampled, "--session", "u"],
                   lines("alpha", "/set max_tokens 6", "beta", "/rewind", "beta", "gamma")).ok()
    runs = [chat(colichat_home, [*sampled, "--session", "v"], lines("alpha")).ok(),
            chat(colichat_home, [*sampled, "--session", "v"], lines("/set max_tokens 6", "beta", "/rewind")).ok(),
            chat(colichat_home, ["--model", TINY_LLAMA, "--session", "v"], lines("beta")).ok(),  # the saved seed
            chat(colichat_home, ["--model", TINY_LLAMA, "--session", "v"], lines("gamma")).ok()]
    assert b"".join(run.out for run in runs) == one_run.out
    assert saved_answers(colichat_home, "v") == saved_answers(colichat_home, "u")
    kv = {p.stem: p.read_bytes() for p in session_files(colichat_home) if p.suffix == ".coli_kv"}
    assert kv["v"] == kv["u"]
    greedy = chat(colichat_home, [*TINY_ARGS, "--no-save"], lines("alpha")).ok()
    assert not one_run.out.startswith(greedy.out)  # the answers were drawn


def test_resume_without_a_name_takes_the_latest(tiny_ref, colichat_home):
    ref = tiny_ref[2]
    chat_here(colichat_home, [*TINY_ARGS, "--session", "old"], lines("Something else entirely.")).ok()
    b = chat_here(colichat_home, [*TINY_ARGS, "--session", "b"], lines(Q[0], Q[1])).ok()
    # On start it says there is a saved conversation, and does not load it.
    assert 'latest saved conversation: old: 2 turns, ' in b.err
    assert b.out == answers_bytes(ref[:2])
    # Piped and one-shot runs without --session are not saved, so they never become the latest.
    unsaved = chat_here(colichat_home, TINY_ARGS, lines("Not kept.")).ok()
    assert unsaved.footers()[0].endswith("; not saved (/save NAME keeps it)]")
    one_shot = chat_here(colichat_home, [*TINY_ARGS, "-p", "Not kept either."]).ok()
    assert one_shot.footers()[0].endswith("; not saved (--session NAME keeps it)]")  # no next line for /save
    assert sorted(p.stem for p in session_files(colichat_home) if p.suffix == ".json") == ["b", "old"]
    c = chat_here(colichat_home, [*TINY_ARGS, "--resume"], lines(Q[2])).ok()
    assert c.resumed() == (last_context(b), 4, "b")
    assert c.out == answers_bytes(ref[2:])


def test_new_keeps_the_old_session_for_resume(tiny_ref, colichat_home):
    ref = tiny_ref[2]
    run = chat_here(colichat_home, [*TINY_ARGS, "--session", "first"],
               lines(Q[0], "/new", Q[0], "/sessions", "/resume first", "/history", Q[1])).ok()
    err = run.err.splitlines()
    assert "new conversation (session first is saved; /resume first reopens it)" in err
    names = session_names(run)
    assert names[0] == names[2] == "first" and names[1] != "first"
    listed = [line for line in err if line.startswith(("* ", "  ")) and " ago" in line]
    assert len(listed) == 2
    assert any(line.startswith(f"* {names[1]}: 2 turns, ") for line in listed)
    assert any(line.startswith("  first: 2 turns, ") for line in listed)
    tokens, turns, name = run.resumed()
    assert (turns, name) == (2, "first")
    # After /new the same question gets the answer of a fresh conversation; after /resume the
    # conversation goes on exactly as an uninterrupted one.
    assert run.out == answers_bytes([ref[0], ref[0], ref[1]])
    assert saved_users(colichat_home, "first") == Q[:2]
    assert saved_users(colichat_home, names[1]) == [Q[0]]


# ---- input forms and options --------------------------------------------------------------------


def test_help_and_quit(colichat_home):
    stdin = lines("/help", "/help rewind", "/help /set", "/quit", "not answered")
    run = chat_here(colichat_home, TINY_ARGS, stdin).ok()
    err = run.err.splitlines()
    for cmd in COMMANDS:
        assert any(line.startswith(cmd.name + " ") and listed(cmd) in line for line in err), cmd.name
    assert "/rewind [N]  drop the last N exchanges (default 1)" in err
    assert any(line.split() == ["temperature", "0", "=", "greedy;", "higher", "=", "more", "random"] for line in err)
    assert run.out == b"" and run.footers() == []


def test_multiline_blocks(colichat_home):
    stdin = lines('"""', "first line", "", "  third line", '"""',
                  '"""', "/not a command", "still the message", '"""',
                  '"""inline block"""')
    run = chat_here(colichat_home, [*TINY_ARGS, "--session", "ml"], stdin).ok()
    assert saved_users(colichat_home, "ml") == ["first line\n\n  third line", "/not a command\nstill the message",
                                                "inline block"]
    assert run.out == answers_bytes(saved_answers(colichat_home, "ml"))
    assert run.errors() == []


@pytest.mark.process
def test_windows_line_ends_a_byte_order_mark_and_bytes_that_are_not_utf8(colichat_home):
    """A file written on Windows (\\r\\n, a BOM) reads as the same lines; a byte that is not UTF-8 is
    U+FFFD in the conversation, its history and its export alike, with one note."""
    raw = b'\xef\xbb\xbf/help rewind\r\n"""\r\nfirst\r\nsecond\r\n"""\r\ncaf\xe9 ok?\r\ncaf\xe9 again\n'
    run = chat(colichat_home, [*TINY_ARGS, "--session", "win"], raw).ok()
    assert "/rewind [N]  drop the last N exchanges (default 1)" in run.err.splitlines()  # a command, not a message
    assert run.errors() == [] and run.err.count("not UTF-8") == 1
    assert "note: line 6 of the input is not UTF-8: its invalid bytes are read as U+FFFD" in run.err.splitlines()
    users = ["first\nsecond", "caf\ufffd ok?", "caf\ufffd again"]
    assert saved_users(colichat_home, "win") == users
    clean = chat(colichat_home, [*TINY_ARGS, "--session", "clean"], lines('"""', "first", "second", '"""', *users[1:]))
    assert run.out == clean.ok().out == answers_bytes(saved_answers(colichat_home, "win"))
    shown = chat(colichat_home, [*TINY_ARGS, "--session", "win"], lines("/history")).ok()
    assert "user> caf\ufffd ok?" in shown.err.splitlines()


@pytest.mark.process
def test_one_shot(tiny_ref, colichat_home):
    ref = tiny_ref[2]
    run = chat(colichat_home, [*TINY_ARGS, "--session", "one", "-p", Q[0]], "stdin is not read\n").ok()
    assert run.out == answers_bytes(ref[:1])
    assert saved_users(colichat_home, "one") == [Q[0]]
    slash = chat(colichat_home, [*TINY_ARGS, "-p", "/help"]).ok()  # -p TEXT is a message, whatever it starts with
    assert slash.out != b"" and "/resume [NAME]" not in slash.err and len(slash.footers()) == 1


def test_no_save_writes_nothing(tiny_ref, colichat_home):
    ref = tiny_ref[2]
    run = chat_here(colichat_home, [*TINY_ARGS, "--no-save"], lines(Q[0], Q[1], "/stats")).ok()
    assert run.out == answers_bytes(ref[:2])
    footers = run.footers()
    assert len(footers) == 2 and all(f.endswith("; not saved (--no-save)]") for f in footers)
    assert "session: saving is off (--no-save)" in run.err.splitlines()
    # Nothing in COLICHAT_HOME (also the working directory) but maybe re-creatable caches.
    assert [p for p in colichat_home.rglob("*") if p.relative_to(colichat_home).parts[0] != "cache"] == []


def test_banner_names_the_model_in_a_few_words_and_sizes_use_one_unit_style(colichat_home):
    run = chat_here(colichat_home, [*TINY_ARGS, "--session", "u"], lines(Q[0], "/stats", "/sessions")).ok()
    err = run.err.splitlines()
    assert re.fullmatch(r"llama \(llama, 4 layers\), loaded in [\d.]+ s", err[0])
    assert TINY_LLAMA not in run.err
    verbose = chat_here(colichat_home, [*TINY_ARGS, "--no-save", "--verbose"], "").ok()
    assert re.fullmatch(rf"llama \(llama, 4 layers\) from {re.escape(TINY_LLAMA)}, loaded in [\d.]+ s",
                        verbose.err.splitlines()[0])
    # binary units everywhere: the memory line, /stats, /sessions
    assert re.search(r"\d ?[kKMGT]B\b|bytes/token|\d B/token", run.err) is None, run.err
    assert re.search(r"KV [\d.]+ KiB/token x 2,048", err[1])
    assert re.search(r"^KV cache: [\d.]+ KiB/token, [\d.]+ KiB in use; saved as f32 \(COLIGQA, [\d,]+ bytes a token\)$",
                     run.err, re.M)
    assert re.search(r"^\* u: 2 turns, \d+ tokens, [\d.]+ (KiB|MiB), ", run.err, re.M)


def test_model_title():
    assert model_title("Smollm2 135M 8k Lc100K Mix1 Ep2", "/m/SmolLM2-135M-Instruct.Q4_1.gguf") == \
        "SmolLM2-135M-Instruct.Q4_1"
    assert model_title("DeepSeek-V2-Lite-Chat", "/m/x.gguf") == "DeepSeek-V2-Lite-Chat"
    assert model_title("x.gguf", "/m/x.gguf") == "x"


def test_format_size():
    assert [format_size(n) for n in (0, 1023, 1024, 46_084, 3 << 20, 5.2 * (1 << 30))] == \
        ["0 B", "1023 B", "1.0 KiB", "45.0 KiB", "3.0 MiB", "5.2 GiB"]


def test_counts_say_one_thing_or_several():
    assert [count(n, "exchange") for n in (0, 1, 2)] == ["0 exchanges", "1 exchange", "2 exchanges"]


def test_a_one_token_answer_says_1_token(colichat_home):
    run = chat_here(colichat_home, [*TINY_ARGS, "--no-save", "--max-tokens", "1"], lines("hello", "/stats")).ok()
    [footer] = run.footers()
    assert footer.startswith("[1 token, "), footer
    assert re.search(r"^last answer: 1 token at [\d.]+ tok/s; prompt: \d+ tokens read at", run.err, re.M), run.err


def test_forget_out_of_range_says_how_many_there_are(colichat_home):
    run = chat_here(colichat_home, [*TINY_ARGS, "--no-save"], lines("hello", "/forget 2", "/forget 0")).failed()
    assert run.errors() == ["colichat: /forget takes 1: the conversation has 1 exchange"] * 2


@pytest.mark.process
def test_version_and_help_options(colichat_home):
    run = chat(colichat_home, ["--version"]).ok()
    assert run.out == f"colichat {__version__}\n".encode()
    usage = chat(colichat_home, ["-h"]).ok().out.decode()
    for opt in ["--model", "--session", "--resume", "--ctx", "--temperature", "--top-k", "--top-p", "--min-p",
                "--repeat-penalty", "--seed", "--max-tokens", "--no-save", "--plain", "--prompt", "--version"]:
        assert opt in usage, opt
    assert list(colichat_home.rglob("*")) == []


# ---- interrupt ----------------------------------------------------------------------------------


def interrupt_after_first_output(home, args, stdin: str = ""):
    """Start colichat, wait until the answer streams, send SIGINT, wait for the exit."""
    p = start(home, args)
    if stdin:
        p.stdin.write(stdin.encode())
        p.stdin.flush()
    head = read_until(p.stdout)
    p.send_signal(signal.SIGINT)
    return finish(p, head)


@pytest.mark.process
def test_interrupt_while_waiting_for_input_ends_at_once(colichat_home):
    """Ctrl-C while colichat waits for the next line (an answer given, the pipe still open) ends it then
    (130), not after another line comes; the answer before it stays saved."""
    p = start(colichat_home, [*TINY_ARGS, "--session", "w"])
    p.stdin.write(b"hello\n")
    p.stdin.flush()
    err = read_until(p.stderr, b"; saved to w]")
    p.send_signal(signal.SIGINT)
    try:
        p.wait(timeout=60)  # the old behaviour: waiting on until the next line, or the end of input
    finally:
        run = finish(p, head_err=err)
    run.exits(130)
    assert saved_users(colichat_home, "w") == ["hello"]


def check_interrupted(home, run, name: str, question: str):
    """Exit 130; the partial answer was shown, saved, and the session resumes with it."""
    run.exits(130)
    [footer] = run.footers()
    assert footer.endswith(f", interrupted; saved to {name}]"), footer
    assert saved_users(home, name) == [question]
    [answer] = saved_answers(home, name)
    assert answer and run.out == answers_bytes([answer])
    return answer


LONG = ["--model", TINY_LLAMA, *GREEDY, "--ctx", "2048", "--max-tokens", "2000"]  # "hello": thousands of tokens


@pytest.mark.process
def test_interrupt_stops_the_answer_and_saves_it(colichat_home):
    run = interrupt_after_first_output(colichat_home, [*LONG, "--session", "s"], lines("hello", "not answered"))
    answer = check_interrupted(colichat_home, run, "s", "hello")
    again = chat(colichat_home, [*LONG, "--resume", "--session", "s"], lines("/history")).ok()
    assert again.resumed()[1:] == (2, "s")
    assert f"assistant> {displayable(answer)}" in again.err


@pytest.mark.process
def test_interrupt_in_one_shot_mode(colichat_home):
    run = interrupt_after_first_output(colichat_home, [*LONG, "--session", "p", "-p", "hello"])
    check_interrupted(colichat_home, run, "p", "hello")


@pytest.mark.process
def test_double_interrupt_during_an_answer_exits_130(colichat_home):
    p = start(colichat_home, [*LONG, "--session", "s"])
    p.stdin.write(lines("hello", "not answered").encode())
    p.stdin.flush()
    head = read_until(p.stdout)
    p.send_signal(signal.SIGINT)
    p.send_signal(signal.SIGINT)  # the second one stops at once, wherever the program is
    run = finish(p, head).exits(130)
    assert run.errors() == []


@pytest.mark.process
def test_double_interrupt_while_starting_exits_130(colichat_home):
    """Ctrl-C twice during the imports (most of a start): exit 130, no traceback. `-X importtime`
    reports each import as it ends, so the signals arrive while numpy is being imported."""
    p = subprocess.Popen([sys.executable, "-X", "importtime", "-m", "colichat.terminal.cli", *TINY_ARGS],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=env_for(colichat_home), cwd=str(colichat_home))
    head = read_until(p.stderr, b"numpy._core")  # a module numpy imports first
    p.send_signal(signal.SIGINT)
    p.send_signal(signal.SIGINT)
    run = finish(p, head_err=head).exits(130)
    assert run.out == b"" and "loaded in" not in run.err


# ---- the default model (SmolLM2-135M-Instruct) ----------------------------------------------------

DEFAULT_ARGS = [*GREEDY, "--ctx", "1024", "--max-tokens", "24"]
DQ = ["What is the capital of France?", "And what is the capital of Germany?", "Which river flows through it?"]


@pytest.fixture(scope="module")
def default_home(tmp_path_factory):
    """One COLICHAT_HOME for the default-model tests (other session names), so caches are made once."""
    return tmp_path_factory.mktemp("default-home")


@pytest.mark.process
@pytest.mark.default_model
def test_default_model_conversation_and_resume(default_home):
    home = default_home
    a = chat(home, [*DEFAULT_ARGS, "--session", "a"], lines(*DQ)).ok()
    ref = saved_answers(home, "a")
    # the kernels (--kernels auto) answer the first question as llama.cpp does (its greedy tokens, tests/data)
    llama_cpp = np.load(REF / "smollm2" / "chat.ref.npz")["greedy_0"][:16].tolist()
    assert len(ref) == 3 and ref[0].startswith(load_tokenizer(default_model_path()).decode(llama_cpp))
    assert a.out == answers_bytes(ref)
    assert a.err.splitlines()[0].startswith("SmolLM2-135M-Instruct.Q4_1 (llama, 30 layers)")
    assert len(a.footers()) == 3 and all(f.endswith("; saved to a]") for f in a.footers())
    # --sessions names the model as the banner does (its general.name is long: the file's name)
    listed = chat(home, ["--sessions"]).ok().out.decode().splitlines()
    assert listed[0].startswith("SmolLM2-135M-Instruct.Q4_1 (") and listed[1].startswith("  a: 6 turns, ")
    # The headline: stop after two questions, resume in a new process, the third answer is the same.
    b = chat(home, [*DEFAULT_ARGS, "--session", "b"], lines(*DQ[:2])).ok()
    assert b.out == answers_bytes(ref[:2])
    c = chat(home, [*DEFAULT_ARGS, "--resume", "--session", "b"], lines(DQ[2])).ok()
    assert c.resumed() == (last_context(b), 4, "b")
    assert c.out == answers_bytes(ref[2:])
    # That session belongs to the default model: the tiny llama refuses it and goes on.
    other = chat(home, [*TINY_ARGS, "--resume", "--session", "b"]).failed()
    [line] = other.errors()
    assert line.startswith("colichat: session b belongs to another model (")
    other = chat(home, TINY_ARGS, lines("/resume b", "hello")).failed()
    assert other.errors() == [line] and len(other.footers()) == 1


@pytest.mark.default_model
def test_draft_option_and_set_draft_change_the_speed_not_the_answer(default_home):
    """--draft 0 turns speculative decoding off and /set draft turns it on: the same answer, and the
    /stats counts drafts only where they were checked (text to repeat: prompt lookup has drafts); the
    footer leaves them to /stats."""
    text = ("Repeat exactly: the cat sat on the mat, the dog sat on the log, "
            "the cat sat on the mat, the dog sat on the log.")
    args = [*GREEDY, "--ctx", "1024", "--max-tokens", "40", "--draft", "0"]
    off = chat_here(default_home, args, lines("/show", text, "/stats")).ok()
    on = chat_here(default_home, args, lines("/set draft 6", "/show", text, "/stats")).ok()
    assert re.search(r"^draft +0$", off.err, re.M) and re.search(r"^draft +6$", on.err, re.M)
    assert on.out == off.out and b"the dog sat on the log" in on.out
    assert "drafts" not in off.err and "drafts" not in on.footers()[0]
    assert re.search(r"^drafts \(tokens guessed ahead, then checked in one pass\): [1-9]\d* of \d+ kept \(\d+%",
                     on.err, re.M), on.err


@pytest.mark.process
@pytest.mark.default_model
def test_default_model_interrupt(default_home):
    question = "Write a long story about a dragon."
    run = interrupt_after_first_output(default_home, [*GREEDY, "--ctx", "1024", "--max-tokens", "900",
                                                      "--session", "story"], lines(question))
    answer = check_interrupted(default_home, run, "story", question)
    assert int(run.footers()[0][1:].split()[0]) < 900
    again = chat(default_home, [*DEFAULT_ARGS, "--resume", "--session", "story"], lines("/history")).ok()
    assert f"assistant> {displayable(answer)}" in again.err


def test_delete_removes_another_session_but_not_the_current_one(colichat_home):
    chat_here(colichat_home, [*TINY_ARGS, "--session", "old"], lines(Q[0])).ok()
    run = chat_here(colichat_home, [*TINY_ARGS, "--session", "new"],
               lines(Q[0], "/delete new", "/delete old", "/sessions", "/resume old"))
    assert run.rc == 1  # the refused /delete and the failed /resume count as errors
    err = run.err.splitlines()
    assert any("session new is the current conversation" in line for line in err)
    assert any(line.startswith("deleted session old (") for line in err)
    listed = [line for line in err if line.startswith(("* ", "  ")) and " ago" in line]
    assert len(listed) == 1 and listed[0].startswith("* new: ")
    assert any("no session named old" in line for line in err)
    assert "Traceback" not in run.err
    assert sorted(p.name for p in session_files(colichat_home) if not p.name.endswith(".lock")) == [
        "new.coli_kv", "new.json"]


def test_options_on_the_command_line_win_over_the_saved_settings(colichat_home):
    args = ["--model", TINY_LLAMA, "--session", "opt"]
    chat_here(colichat_home, [*args, "--temperature", "0", "--max-tokens", "8", "--top-k", "5"],
         lines("/set seed 7", Q[0])).ok()
    run = chat_here(colichat_home, [*args, "--resume", "--temperature", "0.9"], lines("/show", Q[1])).ok()
    shown = dict(line.split(None, 1) for line in run.err.splitlines() if line.split(None, 1)[0] in
                 ("temperature", "max_tokens", "top_k", "seed"))
    assert shown == {"temperature": "0.9", "max_tokens": "8", "top_k": "5", "seed": "7"}, shown
    # The option given now is the session's setting from now on (saved with the answer); the others
    # stay as saved.
    again = chat_here(colichat_home, [*args, "--resume"], lines("/show")).ok()
    assert "temperature    0.9" in again.err.splitlines() and "top_k          5" in again.err.splitlines()


@pytest.mark.parametrize("word", ["/bye", "/exit", "/q", "/QUIT"])
def test_quit_aliases(word, colichat_home):
    run = chat_here(colichat_home, TINY_ARGS, lines(word, "not answered")).ok()
    assert run.out == b"" and run.footers() == []


def test_new_and_clear_start_a_new_conversation(tiny_ref, colichat_home):
    ref = tiny_ref[2]
    run = chat_here(colichat_home, [*TINY_ARGS, "--session", "n"], lines(Q[0], "/new", Q[0], "/clear", Q[0])).ok()
    assert run.out == answers_bytes([ref[0]] * 3)  # each time the answer of a fresh conversation
    names = session_names(run)
    assert len(set(names)) == 3 and names[0] == "n"
    assert sum(line.startswith("new conversation (session ") for line in run.err.splitlines()) == 2


def test_exit_or_clear_alone_is_not_sent_and_unknown_commands_suggest_the_nearest(colichat_home):
    stdin = lines("exit", "quit", "clear", "/hlep", "/sesions", Q[0])
    run = chat_here(colichat_home, [*TINY_ARGS, "--session", "x"], stdin).failed()
    assert run.errors() == [
        "colichat: 'exit' alone is not sent to the model: /quit quits, a \"\"\" block sends it",
        "colichat: 'quit' alone is not sent to the model: /quit quits, a \"\"\" block sends it",
        "colichat: 'clear' alone is not sent to the model: /clear starts a new conversation, a \"\"\" block sends it",
        "colichat: unknown command '/hlep': did you mean /help? /help lists the commands",
        "colichat: unknown command '/sesions': did you mean /sessions? /help lists the commands",
    ]
    assert saved_users(colichat_home, "x") == [Q[0]]


def test_two_slashes_send_a_message_that_starts_with_one(colichat_home):
    """`//text` sends `/text` (the REPL reads its lines through the same App.handle); a block is sent as it is."""
    stdin = lines("/etc/passwd is what file?", "//etc/passwd is what file?", '"""', "//as typed", '"""')
    run = chat_here(colichat_home, [*TINY_ARGS, "--session", "sl"], stdin).failed()
    assert run.errors() == ["colichat: unknown command '/etc/passwd': /help lists the commands "
                            "(a message that starts with / is typed with //)"]
    assert saved_users(colichat_home, "sl") == ["/etc/passwd is what file?", "//as typed"]
    assert len(run.footers()) == 2


def test_expert_cache_on_a_model_without_experts_says_it_has_no_effect(colichat_home):
    """--expert-cache bounds a MoE model's dequantized experts; given for a dense model it is said to do
    nothing (it was taken in silence), and the model answers as without it."""
    plain = chat_here(colichat_home, [*TINY_ARGS, "--no-save"], lines("hello")).ok()
    r = chat_here(colichat_home, [*TINY_ARGS, "--no-save", "--expert-cache", "64"], lines("hello")).ok()
    assert "note: --expert-cache has no effect: this model has no routed experts" in r.err.splitlines()
    assert r.out == plain.out
    moe = chat_here(colichat_home, ["--model", str(TINY / "ds-v3.gguf"), *GREEDY, "--max-tokens", "4", "--no-save",
                               "--expert-cache", "64"], lines("hello")).ok()
    assert "--expert-cache has no effect" not in moe.err


@pytest.mark.process
def test_a_moe_models_next_start_warms_the_experts_its_last_run_used_and_answers_the_same(colichat_home):
    """Each answer keeps the routed experts' use counts beside the weights cache; the next start says it
    reads the most used into the expert cache in the background, and the answer is the same."""
    args = ["--model", str(TINY / "ds-v3.gguf"), *GREEDY, "--max-tokens", "6", "--no-save", "--expert-cache", "0.2"]
    first = chat(colichat_home, args, lines("hello")).ok()
    assert "experts: reading" not in first.err
    again = chat(colichat_home, args, lines("hello")).ok()
    assert re.search(r"^experts: reading the \d+ used most in earlier runs into the cache", again.err, re.M)
    assert again.out == first.out
