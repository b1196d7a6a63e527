"""Bad input to the chat program: one clear line on stderr each, never a traceback, the right exit code.

Bad model files end the program (exit 1) and a bad command line (an unknown option, a bad value,
options that contradict each other) ends it before anything is read (exit 2); bad commands in
pipe mode are named back and the program goes on with the next lines (exit 1 at the end); a session
that cannot be written is reported after each answer ("NOT saved: ...") and the conversation goes on.
"""

from __future__ import annotations

import os
import re
import resource
import select
import shutil
import signal
import subprocess
import sys
import time

import pytest
from cli_helpers import (
    CHAT,
    GREEDY,
    TINY_ARGS,
    TINY_LLAMA,
    Run,
    answers_bytes,
    chat,
    chat_here,
    copy_gguf,
    env_for,
    finish,
    lines,
    read_only,
    read_until,
    saved_answers,
    saved_turns,
    saved_users,
    session_files,
    start,
    unprivileged,
)

Q = ["Hello there.", "What is two plus two?", "And three plus three?"]


# ---- bad model files ----------------------------------------------------------------------------


def _missing(d):
    return d / "nowhere.gguf", "no such file"


def _directory(d):
    (d / "model.gguf").mkdir()
    return d / "model.gguf", "is a directory"


def _fifo(d):
    os.mkfifo(d / "pipe.gguf")  # nothing ever writes to it: reading it would wait forever
    return d / "pipe.gguf", "not a regular file; --model takes a GGUF file"


def _not_gguf(d):
    (d / "notes.gguf").write_text("hello, world\n")
    return d / "notes.gguf", "not a GGUF file"


def _empty(d):
    (d / "empty.gguf").write_bytes(b"")
    return d / "empty.gguf", "not a GGUF file"


def _truncated(n, where):
    def make(d):
        with open(TINY_LLAMA, "rb") as f:
            (d / "cut.gguf").write_bytes(f.read(n))
        return d / "cut.gguf", f"truncated GGUF file: the file ends at byte {n:,}{where} (a download cut short?)"

    return make


def _missing_key(d):
    return copy_gguf(TINY_LLAMA, d / "nokey.gguf", drop_keys=["llama.embedding_length"]), \
        "missing GGUF key 'llama.embedding_length'"


def _missing_tensor(d):
    return copy_gguf(TINY_LLAMA, d / "notensor.gguf", drop_tensors=["blk.2.ffn_up.weight"]), \
        "missing tensor 'blk.2.ffn_up.weight'"


def _zero_context(d):
    return copy_gguf(TINY_LLAMA, d / "noctx.gguf", set_keys={"llama.context_length": 0}), \
        "its metadata says llama.context_length is 0; a model needs a context of at least 16 tokens"


def _template(source, problem):
    def make(d):
        return copy_gguf(TINY_LLAMA, d / "template.gguf", set_keys={"tokenizer.chat_template": source}), \
            f"its chat template (tokenizer.chat_template) {problem}"

    return make


def _arch(name):
    def make(d):
        return copy_gguf(TINY_LLAMA, d / f"{name}.gguf", arch=name), f"architecture '{name}' is not supported"

    return make


BAD_MODELS = {
    "missing": _missing, "directory": _directory, "fifo": _fifo, "not-gguf": _not_gguf, "empty": _empty,
    "truncated-preamble": _truncated(20, ", inside its header"),
    "truncated-header": _truncated(3000, ", inside its header"),
    "truncated-data": _truncated(5_000_000, ", but tensor blk.1.ffn_down.weight's data runs to byte 5,017,888"),
    "missing-key": _missing_key, "missing-tensor": _missing_tensor, "zero-context": _zero_context,
    "template-syntax": _template("{% for m in messages %}{{ m.content }}", "has a syntax error (line 1): "),
    "template-filter": _template("{{ messages | nosuchfilter }}", "uses a filter or test that colichat's Jinja "
                                 "does not have (line 1): No filter named 'nosuchfilter'."),
    "template-fails": _template("{{ nosuch() }}", "fails on a conversation of one message: 'nosuch' is undefined"),
    "template-fails-later": _template("{% if messages | length > 1 %}{{ raise_exception('one message only') }}"
                                      "{% endif %}{{ messages[0].content }}", "fails on a second message: one "
                                      "message only"),
    "unknown-arch": _arch("mamba"), "unsupported-mla-arch": _arch("deepseek2-ocr"),
}


@pytest.mark.parametrize("kind", BAD_MODELS)
def test_bad_model_file(kind, tmp_path, colichat_home):
    path, problem = BAD_MODELS[kind](tmp_path)
    run = chat_here(colichat_home, ["--model", path, *GREEDY], lines("hello")).failed()
    assert run.out == b""
    [line] = run.err.splitlines()  # one line, nothing else
    assert line.startswith(f"colichat: {path}: ") and problem in line, line
    assert session_files(colichat_home) == []


def test_rewritten_model_loads_when_nothing_is_missing(tmp_path, colichat_home):
    """The control for the rewritten files above: an unchanged copy answers like the original."""
    copy = copy_gguf(TINY_LLAMA, tmp_path / "copy.gguf")
    mine = chat_here(colichat_home, ["--model", copy, *TINY_ARGS[2:], "--no-save"], lines(Q[0])).ok()
    orig = chat_here(colichat_home, [*TINY_ARGS, "--no-save"], lines(Q[0])).ok()
    assert mine.out == orig.out != b""


def test_a_model_that_computes_nan_is_one_line_and_nothing_is_saved(tmp_path, colichat_home):
    """A file whose weights give NaN scores (here its output norm) is refused at the first token in one line,
    greedy (where NaN would be taken as token 0) and sampled (where the draw would fail) alike."""
    nan = copy_gguf(TINY_LLAMA, tmp_path / "nan.gguf", scale={"output_norm.weight": float("nan")})
    for temperature in ("0", "0.7"):
        run = chat_here(colichat_home, ["--model", nan, "--temperature", temperature, "--session", "n"],
                   lines(Q[0])).failed()
        assert run.out == b"" and run.errors() == [
            "colichat: the model computed NaN for the next token's scores (its weights are damaged or overflow "
            "float32): the message is dropped"]
    assert [p.name for p in session_files(colichat_home)] == []  # claimed, nothing saved: no lock file


# ---- bad options --------------------------------------------------------------------------------

BAD_OPTIONS = {  # a command line no run could carry out: exit 2, in one line
    "negative-temperature": (["--temperature", "-1"], "temperature must be >= 0"),
    "nan-temperature": (["--temperature", "nan"], "temperature must be a finite number"),
    "top-p": (["--top-p", "1.5"], "--top-p must be in (0, 1]"),
    "negative-seed": (["--seed", "-1"], "seed must be >= 0"),
    "max-tokens": (["--max-tokens", "0"], "--max-tokens must be at least 1"),
    "tiny-ctx": (["--ctx", "8"], "--ctx must be at least 16 (tokens of context), not 8"),
    "negative-ctx": (["--ctx", "-5"], "--ctx must be at least 16 (tokens of context), not -5"),
    "word-ctx": (["--ctx", "abc"], "argument --ctx: invalid int value: 'abc' (colichat --help lists the options)"),
    "unknown-option": (["--bogus"], "unrecognized arguments: --bogus (colichat --help lists the options)"),
    "empty-model": (["--model", ""], "--model needs a path"),
    "nan-expert-cache": (["--expert-cache", "nan"], "--expert-cache must be a number of MiB, 0 or more"),
    "negative-expert-cache": (["--expert-cache", "-5"], "--expert-cache must be a number of MiB, 0 or more"),
    "infinite-expert-cache": (["--expert-cache", "inf"], "--expert-cache must be a number of MiB, 0 or more"),
    "empty-prompt": (["-p", " "], "-p/--prompt needs a message"),
    "bad-session-name": (["--session", "../up"], "invalid session name '../up'"),
    "empty-session-name": (["--session", ""], "invalid session name ''"),
}
REFUSED_WHEN_RUN = {  # options that only the model or the saved conversations make impossible: exit 1
    "huge-ctx": (["--ctx", "99999999"], "context size 99,999,999 is above the 2,048 tokens this model was "
                 "trained for; use at most 2,048"),
    "resume-nothing": (["--resume"], "no saved conversation for this model yet"),
    "resume-unknown": (["--resume", "--session", "nosuch"], "no session named nosuch"),
    "resume-nothing-without-saving": (["--resume", "--no-save"], "no saved conversation for this model yet"),
}


@pytest.mark.parametrize("kind", BAD_OPTIONS)
def test_a_bad_command_line_is_one_line_and_exits_2(kind, colichat_home):
    args, problem = BAD_OPTIONS[kind]
    run = chat_here(colichat_home, [*TINY_ARGS, *args], lines("hello")).exits(2)
    [line] = run.err.splitlines()  # nothing before it: no model read
    assert run.out == b"" and line.startswith("colichat: ") and problem in line, line
    assert session_files(colichat_home) == []


@pytest.mark.process
def test_refusals_end_the_command_with_their_exit_status(tmp_path, colichat_home):
    """The tables above run colichat's main() in this process; the command itself, once per kind of
    refusal: argparse's (exit 2 through SystemExit), a bad value (2), a bad model file (1), a saved
    conversation that is not there (1), each one line and no traceback."""
    for args, rc, problem in ((["--bogus"], 2, "unrecognized arguments: --bogus"),
                              (["--temperature", "-1"], 2, "temperature must be >= 0"),
                              (["--model", tmp_path / "nowhere.gguf"], 1, "no such file"),
                              (["--resume"], 1, "no saved conversation for this model yet")):
        run = chat(colichat_home, [*TINY_ARGS, *args], lines("hello")).exits(rc)
        assert run.out == b"" and problem in run.errors()[-1], run.err
        assert len(run.errors()) == 1
    assert session_files(colichat_home) == []


@pytest.mark.parametrize("kind", REFUSED_WHEN_RUN)
def test_an_option_the_model_or_the_sessions_refuse_exits_1(kind, colichat_home):
    args, problem = REFUSED_WHEN_RUN[kind]
    run = chat_here(colichat_home, [*TINY_ARGS, *args], lines("hello")).failed()
    assert run.out == b""
    [line] = run.errors()
    assert problem in line, line
    assert session_files(colichat_home) == []


CONTRADICTIONS = {
    "sessions-and-p": (["--sessions", "-p", "hi"], "--sessions lists every model's saved conversations and "
                       "exits: -p cannot be used with it"),
    "sessions-and-export": (["--sessions", "--export", "foo"], "--sessions and --export each do their work and "
                            "exit: give one of them"),
    "prune-and-p": (["--prune-kv", "3", "-p", "hi"], "--prune-kv frees disk space and exits: -p cannot be used "
                    "with it"),
    "sessions-and-model": (["--sessions", "--model", TINY_LLAMA], "--sessions lists every model's saved "
                           "conversations and exits: --model cannot be used with it"),
    "models-and-model": (["--models", "--model", TINY_LLAMA, "-p", "hi"], "--models lists the models and exits: "
                         "--model, -p cannot be used with it"),
    "models-and-sessions": (["--models", "--sessions"], "--sessions and --models each do their work and exit: "
                            "give one of them"),
    "export-and-chat": (["--export", "s", "-p", "hi", "--resume", "--temperature", "0"], "--export prints a saved "
                        "conversation and exits: -p, --resume cannot be used with it"),
    "export-and-session": (["--export", "s", "--session", "t", "--ctx", "64"], "--export prints a saved "
                           "conversation and exits: --session cannot be used with it"),
}


@pytest.mark.parametrize("kind", CONTRADICTIONS)
def test_options_that_contradict_each_other_are_refused_not_ignored(kind, colichat_home):
    chat_here(colichat_home, [*TINY_ARGS, "--session", "s"], lines(Q[0])).ok()
    args, problem = CONTRADICTIONS[kind]
    run = chat_here(colichat_home, args).exits(2)
    assert run.out == b"" and run.err.splitlines() == [f"colichat: {problem}"]


def test_settings_that_only_shape_a_chat_are_no_contradiction(colichat_home):
    """An alias such as `colichat --temperature 0.3 --plain` still lists and exports."""
    chat_here(colichat_home, [*TINY_ARGS, "--session", "s"], lines(Q[0])).ok()
    shaping = ["--temperature", "0.3", "--ctx", "64", "--plain", "--verbose", "--no-save"]
    assert "  s: 2 turns" in chat_here(colichat_home, ["--sessions", *shaping]).ok().out.decode()
    assert Q[0] in chat_here(colichat_home, ["--export", "s", *shaping]).ok().out.decode()


def test_export_takes_model_to_choose_whose_conversation(tmp_path, colichat_home):
    """--model with --export is not a contradiction: it says whose NAME when two models have one."""
    other = copy_gguf(TINY_LLAMA, tmp_path / "other.gguf", scale={"blk.0.ffn_up.weight": 1.5})
    chat_here(colichat_home, ["--model", other, *TINY_ARGS[2:], "--session", "s"], lines(Q[1])).ok()
    chat_here(colichat_home, [*TINY_ARGS, "--session", "s"], lines(Q[0])).ok()
    mine = chat_here(colichat_home, ["--export", "s", "--model", other]).ok().out.decode()
    assert Q[1] in mine and Q[0] not in mine
    third = copy_gguf(TINY_LLAMA, tmp_path / "third.gguf", scale={"blk.0.ffn_up.weight": 0.5})
    none = chat_here(colichat_home, ["--export", "s", "--model", third])  # none of its own: not another's
    assert none.rc == 1 and none.out == b"" and f"no session named s for {third}" in none.err


def test_context_beyond_the_memory_available_is_refused_with_the_numbers(monkeypatch):
    from colichat import engine
    from colichat.engine import ModelError, load
    from colichat.engine.model import working_bytes

    record = 4 + 4 * 4 * 2 * 64  # the tiny llama's KV record: token id + 4 layers x (K, V) x 64 floats
    model = load(TINY_LLAMA, n_ctx=16)
    have = engine.dense_f32_bytes(model.tensors) + working_bytes(model.cfg) + 100 * record  # 100 tokens fit
    monkeypatch.setattr(engine, "available_memory", lambda: have)
    with pytest.raises(ModelError) as e:
        load(TINY_LLAMA, n_ctx=2048)
    msg = str(e.value)
    held = have - 100 * record
    assert msg == (f"context size 2,048 needs 4 MiB for its KV cache, but only {have / 2**20:.0f} MiB of memory is "
                   f"available and the weights and buffers take {held / 2**20:.0f} MiB; use at most 100 tokens")
    fits = int(msg.rsplit("use at most ", 1)[1].split()[0])
    assert load(TINY_LLAMA, n_ctx=fits).n_ctx == fits  # the number it gives does load


def test_resume_without_a_model_and_nothing_saved_does_not_speak_of_this_model(tmp_path, colichat_home):
    """--resume alone takes the newest conversation of any model: with none, there is no "this model";
    with --model there is, and with another model's conversation saved, "for this model" is the point."""
    run = chat_here(colichat_home, ["--resume", *GREEDY], lines(Q[0])).failed()
    assert run.err.splitlines() == ["colichat: no saved conversation yet"]
    run = chat_here(colichat_home, [*TINY_ARGS, "--resume"], lines(Q[0])).failed()
    assert run.err.splitlines() == ["colichat: no saved conversation for this model yet"]
    other = copy_gguf(TINY_LLAMA, tmp_path / "other.gguf", scale={"blk.0.ffn_up.weight": 1.5})
    chat_here(colichat_home, ["--model", other, *TINY_ARGS[2:], "--session", "theirs"], lines(Q[0])).ok()
    run = chat_here(colichat_home, [*TINY_ARGS, "--resume"], lines(Q[0])).failed()
    assert run.err.splitlines() == ["colichat: no saved conversation for this model yet"]


def test_a_session_name_that_cannot_exist_is_refused_before_the_model_loads(colichat_home):
    for args, problem, rc in ((["--session", "../up"], "invalid session name '../up'", 2),
                              (["--resume", "--session", "nosuch"],
                               "no session named nosuch for this model (colichat --sessions lists them)", 1),
                              (["--resume"], "no saved conversation for this model yet", 1)):
        run = chat_here(colichat_home, [*TINY_ARGS, *args], lines(Q[0])).exits(rc)
        [line] = run.err.splitlines()  # no model load line before it
        assert line.startswith("colichat: ") and problem in line, line


# ---- bad commands in pipe mode ------------------------------------------------------------------


def test_bad_commands_are_named_back_and_the_input_goes_on(colichat_home):
    stdin = lines("/frobnicate now", "/rewind", Q[0], "/rewind 2", "/rewind two", "/resume nosuch",
                  "/resume ../etc", "/set colour blue", "/set temperature hot", "/help frob", Q[1], "/history")
    run = chat_here(colichat_home, [*TINY_ARGS, "--session", "s"], stdin).failed()
    expected = [
        "colichat: unknown command '/frobnicate': /help lists the commands",
        "colichat: nothing to rewind: the conversation is empty",
        "colichat: /rewind takes 1: the conversation has 1 exchange (/reset empties it)",
        "colichat: /rewind takes a whole number, not 'two'",
        "colichat: no session named nosuch for this model (/sessions lists them)",
        "colichat: invalid session name '../etc'",
        "colichat: cannot set 'colour'",
        "colichat: temperature takes a number, not 'hot'",
        "colichat: unknown command '/frob'",
    ]
    errors = run.errors()
    assert len(errors) == len(expected), errors
    for line, start_ in zip(errors, expected, strict=True):
        assert line.startswith(start_), (line, start_)
    # ... and the conversation went on: both questions answered, saved, listed by /history.
    assert saved_users(colichat_home, "s") == Q[:2]
    assert run.out == answers_bytes(saved_answers(colichat_home, "s"))
    assert [line for line in run.err.splitlines() if line.startswith("user> ")] == [f"user> {q}" for q in Q[:2]]


@pytest.mark.parametrize("text", ["/frobnicate", "/rewind"])
def test_one_shot_text_that_looks_like_a_command_is_a_message(text, colichat_home):
    run = chat_here(colichat_home, [*TINY_ARGS, "-p", text]).ok()
    assert run.out != b"" and run.errors() == [] and len(run.footers()) == 1


def test_message_too_long_for_the_context(colichat_home):
    run = chat_here(colichat_home, [*TINY_ARGS, "--ctx", "16", "--no-save"],
               lines("a message far too long for a context of sixteen tokens", "hi")).failed()
    [line] = run.errors()
    assert line.startswith("colichat: the message needs ") and line.endswith(
        " tokens, more than the whole context of 16: shorten it or restart with a larger --ctx (this model takes "
        "up to 2048)")
    assert len(run.footers()) == 1 and run.out.endswith(b"\n")


def test_a_system_prompt_too_long_for_the_context_is_named_as_the_cause(colichat_home):
    """The system prompt, not the message, is what does not fit: the line says so and how to shorten it;
    a message that takes most of the context beside a short system prompt is still the message's fault."""
    short = [*TINY_ARGS, "--ctx", "64", "--no-save"]
    run = chat_here(colichat_home, [*short, "--system", "You are helpful. " * 30, "-p", "Hi"]).failed()
    assert run.errors() == [  # refused at start (tests/test_system_prompt.py)
        "colichat: the system prompt needs 449 tokens, more than the whole context of 64: give a shorter --system "
        "or a larger --ctx (this model takes up to 2048)"]
    run = chat_here(colichat_home, [*short, "--system", "You are helpful. " * 3, "-p", "Hi there, how are you?"])
    run.failed()
    [line] = run.errors()
    assert line.startswith("colichat: the message needs ") and ", 44 of them the system prompt's, more than the " \
        "whole context of 64: shorten it or the system prompt (--system, /set system TEXT)" in line, line
    run = chat_here(colichat_home, [*short, "--system", "Be brief.", "-p", "Hi there, how are you? " * 3]).failed()
    [line] = run.errors()
    assert "system" not in line and "more than the whole context of 64: shorten it or" in line, line


def test_session_of_another_model_is_refused(tmp_path, colichat_home):
    # Same file name, same shapes, other weights (a "fine-tune"): its sessions are not ours.
    (tmp_path / "ft").mkdir()
    finetune = copy_gguf(TINY_LLAMA, tmp_path / "ft" / "llama.gguf", scale={"blk.0.ffn_up.weight": 1.5})
    ft_args = ["--model", finetune, *TINY_ARGS[2:]]
    chat_here(colichat_home, [*TINY_ARGS, "--session", "mine"], lines(Q[0])).ok()
    run = chat_here(colichat_home, [*ft_args, "--resume", "--session", "mine"], lines(Q[1])).failed()
    assert run.out == b""
    [line] = run.errors()
    tiny = os.path.abspath(TINY_LLAMA)  # the command that reopens it
    assert line == (f"colichat: session mine belongs to another model (llama.gguf, last run from {tiny}); "
                    f"colichat --model {tiny} --session mine reopens it"), line
    run = chat_here(colichat_home, ft_args, lines("/resume mine", Q[1], "/sessions")).failed()
    assert run.errors() == [line] and len(run.footers()) == 1
    assert not any(row.strip().startswith("mine:") for row in run.err.splitlines())
    # The session is intact for its own model.
    mine = chat_here(colichat_home, [*TINY_ARGS, "--resume", "--session", "mine"]).ok()
    assert mine.resumed()[1:] == (2, "mine")


def test_deeply_nested_sidecar_is_reported_as_damage(colichat_home):
    chat_here(colichat_home, [*TINY_ARGS, "--session", "s"], lines(Q[0])).ok()
    [side] = [p for p in session_files(colichat_home) if p.suffix == ".json"]
    side.write_text("[" * 100_000 + "]" * 100_000)  # valid JSON, nested past Python's recursion limit
    start = chat_here(colichat_home, TINY_ARGS, lines("/sessions")).ok()  # listed as damaged, never the latest
    assert "  s: damaged (the sidecar is not a colichat sidecar); /delete s removes it" in start.err.splitlines()
    assert "latest saved conversation" not in start.err
    run = chat_here(colichat_home, [*TINY_ARGS, "--resume", "--session", "s"], lines(Q[1])).failed()
    assert run.errors() == [f"colichat: sidecar {side} is damaged (not a colichat sidecar); move {side} aside "
                            "to load the cache as one imported turn"]


BAD_SETTINGS = {
    "seed": (1.5, "seed must be a whole number, not 1.5"),
    "top_k": (2.5, "top_k must be a whole number, not 2.5"),
    "repeat_last_n": (1.5, "repeat_last_n must be a whole number, not 1.5"),
    "temperature": ("hot", "temperature must be a finite number"),
    "repeat_penalty": (True, "repeat_penalty must be a finite number"),
    "min_p": (7, "min_p must be in [0, 1)"),
    "max_tokens": (0, "max_tokens must be a whole number >= 1, not 0"),
    "system": (["a", "list"], "system must be text"),
}


@pytest.mark.parametrize("key", BAD_SETTINGS)
def test_bad_saved_setting_is_reported_as_damage_and_not_used(key, colichat_home):
    import json

    from colichat.persist.sidecar import doc_check

    value, problem = BAD_SETTINGS[key]
    first = chat_here(colichat_home, [*TINY_ARGS, "--session", "s"], lines(Q[0], Q[1])).ok()
    [side] = [p for p in session_files(colichat_home) if p.suffix == ".json"]
    doc = json.loads(side.read_text())
    doc["sampler"][key] = value
    doc["turns"] = doc["turns"][:2]  # the second exchange again, with the settings now in force
    doc["check"] = doc_check(doc)  # a bad value under a valid checksum (as a buggy writer would leave)
    side.write_text(json.dumps(doc))
    run = chat_here(colichat_home, [*TINY_ARGS, "--resume", "--session", "s"], lines(Q[1], "/show")).ok()
    assert f"warning: the session's saved settings are damaged ({key} {value!r}); kept the current values " \
        "of those" in run.err.splitlines(), problem
    assert run.out == first.out.split(b"\n", 1)[1]  # greedy (from the command line): the same answer


@pytest.mark.process
def test_second_colichat_on_the_same_session_is_refused(colichat_home):
    chat(colichat_home, [*TINY_ARGS, "--session", "s"], lines(Q[0])).ok()
    first = start(colichat_home, [*TINY_ARGS, "--resume", "--session", "s"])  # waits on stdin
    head_err = b""
    try:
        head_err = read_until(first.stderr, b"no re-prefill")
        msg = f"colichat: session s is open in another colichat (pid {first.pid})"
        second = chat(colichat_home, [*TINY_ARGS, "--resume", "--session", "s"], lines(Q[1])).failed()
        assert second.errors() == [msg] and second.out == b""
        third = chat(colichat_home, TINY_ARGS, lines("/resume s", Q[1])).failed()
        assert third.errors() == [msg] and len(third.footers()) == 1
        fourth = chat(colichat_home, [*TINY_ARGS, "--session", "s"], lines(Q[1])).failed()
        assert fourth.errors() == [msg]
        first.stdin.write(lines(Q[1]).encode())
    finally:
        run = finish(first, head_err=head_err)
    run.ok()
    assert saved_users(colichat_home, "s") == Q[:2]
    chat(colichat_home, [*TINY_ARGS, "--resume", "--session", "s"]).ok()  # free again


@pytest.mark.process
def test_a_conversation_open_in_another_colichat_is_refused_before_the_model_loads(colichat_home):
    """A second colichat on a conversation another one has open (saved and reopened, or a new name
    taken at start) is refused from the lock file alone, before the model loads (which can take
    minutes), with the line opening it would give; --no-save still opens it."""
    chat(colichat_home, [*TINY_ARGS, "--session", "s"], lines(Q[0])).ok()
    for first_args, name, shown in ((["--resume", "--session", "s"], "s", b"no re-prefill"),
                                    (["--session", "new"], "new", b"latest saved conversation: s")):
        first = start(colichat_home, [*TINY_ARGS, *first_args])  # waits on stdin, holding the session
        head_err = b""
        try:
            head_err = read_until(first.stderr, shown)
            msg = f"colichat: session {name} is open in another colichat (pid {first.pid})"
            again = [["--session", name]] + ([["--resume", "--session", name], ["--resume"]] if name == "s" else [])
            for args in again:
                second = chat(colichat_home, [*TINY_ARGS, *args], lines(Q[1])).failed()
                assert second.err == msg + "\n", args  # nothing else: the model did not load
            if name == "s":
                assert chat(colichat_home, [*TINY_ARGS, "--no-save", "--session", "s"], "").ok().resumed()[1:] \
                    == (2, "s")
        finally:
            finish(first, head_err=head_err).ok()  # (its stdin ends: it quits)
    assert [p.name for p in session_files(colichat_home) if p.suffix != ".lock"] == ["s.coli_kv", "s.json"]
    chat(colichat_home, [*TINY_ARGS, "--resume", "--session", "s"]).ok()  # free again


# ---- saving fails -------------------------------------------------------------------------------


@pytest.mark.process
def test_write_failure_reports_not_saved_and_goes_on(tmp_path, colichat_home):
    (tmp_path / "clean").mkdir()
    clean = chat(tmp_path / "clean", [*TINY_ARGS, "--session", "c"], lines(*Q)).ok()
    ref = saved_answers(tmp_path / "clean", "c")
    # A file size limit (RLIMIT_FSIZE: writes past it fail with EFBIG; root ignores permissions) halfway
    # between the cache file's size after the first answer and after the second.
    [kv] = [p for p in session_files(tmp_path / "clean") if p.suffix == ".coli_kv"]
    ctx = [used for used, _ in clean.contexts()]
    limit = kv.stat().st_size * (ctx[0] + ctx[1]) // (2 * ctx[2])

    def limit_file_size():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    chat(colichat_home, [*TINY_ARGS, "--no-save"]).ok()  # any cache the model start makes, made without the limit
    run = chat(colichat_home, [*TINY_ARGS, "--session", "s"], lines(*Q), preexec_fn=limit_file_size).failed()
    assert run.out == clean.out == answers_bytes(ref)  # the conversation went on in memory, unchanged
    f = run.footers()
    assert len(f) == 3 and f[0].endswith("; saved to s]"), f
    assert all("NOT saved: could not save session s: File too large" in x for x in f[1:]), f
    assert run.errors() == []  # the footers said it; no extra lines
    # On disk: the session loads to the last turn that was saved, and goes on from there.
    again = chat(colichat_home, [*TINY_ARGS, "--resume", "--session", "s"], lines(Q[1])).ok()
    assert again.resumed()[1:] == (2, "s")
    assert again.out == answers_bytes(ref[1:2])
    assert saved_answers(colichat_home, "s") == ref[:2]


def test_session_directory_blocked_by_a_file_is_refused_at_start(colichat_home):
    (colichat_home / "data").mkdir()
    (colichat_home / "data" / "sessions").write_text("in the way\n")
    run = chat_here(colichat_home, [*TINY_ARGS, "--session", "s"], lines(Q[0], Q[1], "/sessions")).failed()
    assert run.out == b"" and run.footers() == []  # nothing answered: said before the first question
    sessions = colichat_home / "data" / "sessions"
    assert run.errors() == [f"colichat: cannot save conversations in {sessions} ({sessions} is not a directory); "
                            "fix that, set COLICHAT_HOME to a writable directory, or use --no-save"]
    assert sessions.read_text() == "in the way\n"
    chat_here(colichat_home, [*TINY_ARGS, "--no-save"], lines(Q[0])).ok()  # the way out it names


@pytest.mark.parametrize("args", [["--sessions"], ["--export", "s"]])
def test_listing_a_sessions_directory_blocked_by_a_file_says_so(args, colichat_home):
    """Not "no saved conversations": the conversations cannot be seen, and the line says why."""
    (colichat_home / "data").mkdir()
    sessions = colichat_home / "data" / "sessions"
    sessions.write_text("in the way\n")
    run = chat_here(colichat_home, args).failed()
    assert run.out == b"" and run.err.splitlines() == [
        f"colichat: cannot read the saved conversations in {sessions} ({sessions} is not a directory); fix that, "
        "or set COLICHAT_HOME to the directory that holds them"]


@pytest.mark.process
def test_colichat_home_that_is_a_file_is_refused_at_start(tmp_path):
    home = tmp_path / "home"
    home.write_text("not a directory\n")
    run = chat(tmp_path, [*TINY_ARGS, "--session", "s"], lines(Q[0]), env_extra={"COLICHAT_HOME": str(home)}).failed()
    assert run.out == b"" and run.footers() == []
    [line] = run.errors()
    assert line.startswith(f"colichat: cannot save conversations in {home}/data/sessions ({home} is not a "
                           "directory)"), line
    assert home.read_text() == "not a directory\n"


@pytest.mark.process
@pytest.mark.parametrize("mode", [0o500, 0o000], ids=["unwritable", "unreadable"])
def test_sessions_directory_without_permission_is_refused_at_start(mode, colichat_home):
    prefix = unprivileged()
    chat(colichat_home, [*TINY_ARGS, "--session", "s"], lines(Q[0])).ok()
    sessions = colichat_home / "data" / "sessions"
    sessions.chmod(mode)
    try:
        for args in (["--session", "t"],) if mode else (["--resume"], ["--session", "t"]):
            run = chat(colichat_home, [*TINY_ARGS, *args], lines(Q[1], "/sessions"), prefix=prefix).failed()
            assert run.out == b"" and run.footers() == [], run.err
            [line] = run.errors()
            assert line.startswith(f"colichat: cannot save conversations in {sessions} ({sessions}: "
                                   "Permission denied); "), line
        if mode:  # readable: --resume opens it read-only, as on a read-only file system
            run = chat(colichat_home, [*TINY_ARGS, "--resume"], lines(Q[1]), prefix=prefix).ok()
            assert run.err.startswith(f"note: {sessions}: Permission denied: the conversation opens read-only")
            assert run.footers()[0].endswith("; not saved (read-only)]")
    finally:
        sessions.chmod(0o700)
    assert saved_users(colichat_home, "s") == [Q[0]]


@pytest.mark.process
def test_a_model_sessions_directory_without_permission_is_refused_at_start(colichat_home):
    """The model's own directory under sessions/ (chmod 500): refused before the model loads, naming
    that directory, as for the sessions directory itself (it was found only by the first answer's save,
    naming a file); --resume opens its conversation read-only."""
    prefix = unprivileged()
    chat(colichat_home, [*TINY_ARGS, "--session", "s"], lines(Q[0])).ok()
    [model_dir] = (colichat_home / "data" / "sessions").iterdir()
    model_dir.chmod(0o500)
    try:
        run = chat(colichat_home, [*TINY_ARGS, "--session", "t"], lines(Q[1]), prefix=prefix).failed()
        assert run.out == b"" and run.footers() == [], run.err
        [line] = run.errors()
        assert line.startswith(f"colichat: cannot save conversations in {model_dir.parent} ({model_dir}: "
                               "Permission denied); "), line
        run = chat(colichat_home, [*TINY_ARGS, "--resume"], lines(Q[1]), prefix=prefix).ok()
        assert run.err.startswith(f"note: {model_dir}: Permission denied: the conversation opens read-only")
    finally:
        model_dir.chmod(0o700)
    assert saved_users(colichat_home, "s") == [Q[0]]


@pytest.mark.process
@pytest.mark.parametrize("mode", [0o000, 0o500], ids=["unreadable", "unwritable"])
def test_a_cache_directory_without_permission_is_a_note_and_a_start_without_it(mode, colichat_home):
    """chmod 000 cache (as after one `sudo colichat`), or an unwritable one: a MoE model (whose experts' use
    counts are looked up in the weights cache) starts, says it cannot keep the weights, and answers the same;
    on the kernel path it also says the kernels it compiled cannot be kept (colichat's own kernel cache here,
    not the tests' shared one)."""
    from conftest import TINY

    prefix = unprivileged()
    args = ["--model", str(TINY / "ds-v2-lite.gguf"), *GREEDY, "--max-tokens", "4", "--no-save"]
    q8 = ["--model", str(TINY / "ds-v3.q8_0.gguf"), *GREEDY, "--max-tokens", "4", "--no-save", "--kernels"]
    own = {"NUMBA_CACHE_DIR": ""}  # (colichat's own kernel cache, in the cache directory: never made here)
    cache = colichat_home / "cache"
    first = chat(colichat_home, args, lines(Q[0])).ok()
    kept = chat(colichat_home, [*q8, "numba"], lines(Q[0])).ok()  # (the tests' shared kernel cache: no compile)
    if mode:  # nothing kept, and nothing can be
        shutil.rmtree(cache / "weights")
    cache.chmod(mode)
    try:
        run = chat(colichat_home, args, lines(Q[0]), prefix=prefix).ok()
        again = chat(colichat_home, [*q8, "numba"], lines(Q[0]), prefix=prefix, env_extra=own).ok()
    finally:
        cache.chmod(0o700)
    assert run.out == first.out and again.out == kept.out
    weights = (f"note: cannot write the weights cache in {cache / 'weights'} (Permission denied); each start "
               "dequantizes instead")
    assert [line for line in run.err.splitlines() if line.startswith("note: ")] == [weights]
    notes = [line for line in again.err.splitlines() if line.startswith("note: ")]
    assert re.fullmatch(rf"note: cannot keep the compiled kernels in {re.escape(str(cache / 'kernels'))} \(not "
                        r"writable\); each start compiles them \([0-9.]+ s\)", notes[0]), notes
    assert notes[1:] in ([], [weights]), notes


@pytest.mark.process
def test_saved_conversation_on_a_read_only_file_system_opens_read_only(colichat_home):
    first = chat(colichat_home, [*TINY_ARGS, "--session", "s"], lines(Q[0])).ok()
    before = {p: p.read_bytes() for p in session_files(colichat_home)}
    ro = read_only(colichat_home)
    run = chat(colichat_home, [*TINY_ARGS, "--resume", "--session", "s"], lines(Q[1], "/rewind", Q[2], "/history"),
               prefix=ro).ok()
    edits = lines("/rename r", "/save c", "/delete s")
    refused = chat(colichat_home, [*TINY_ARGS, "--resume", "--session", "s"], edits, prefix=ro).failed()
    # said up front, not tried (it failed with the OS's error)
    assert refused.errors() == [f"colichat: the conversations are on a read-only file system: {what}"
                                for what in ("nothing is renamed", "nothing can be saved", "no session is deleted")]
    sessions = colichat_home / "data" / "sessions"
    assert run.err.startswith(f"note: {sessions}: Read-only file system: the conversation opens read-only (you "
                              "can read and continue it; nothing is saved)\n"), run.err
    assert run.resumed()[1:] == (2, "s")
    assert f"user> {Q[0]}" in run.err and f"user> {Q[2]}" in run.err
    assert len(run.footers()) == 2 and all(f.endswith("; not saved (read-only)]") for f in run.footers())
    assert run.errors() == []
    # a new conversation there is refused at start, saying how to read the saved ones
    new = chat(colichat_home, [*TINY_ARGS, "--session", "t"], lines(Q[0]), prefix=ro).failed()
    assert new.errors() == [f"colichat: cannot save conversations in {sessions} ({sessions}: Read-only file "
                            "system); fix that, set COLICHAT_HOME to a writable directory, or use --no-save; "
                            "--resume opens a saved one read-only"]
    assert {p: p.read_bytes() for p in session_files(colichat_home)} == before
    # and the same conversation, writable again, answers the same
    again = chat(colichat_home, [*TINY_ARGS, "--resume", "--session", "s"], lines(Q[1])).ok()
    assert again.out == run.out.split(b"\n")[0] + b"\n" and first.out


# ---- the output side ----------------------------------------------------------------------------


@pytest.mark.process
def test_closed_stdout_stops_quietly_and_keeps_the_answer(colichat_home):
    p = start(colichat_home, ["--model", TINY_LLAMA, *GREEDY, "--ctx", "2048", "--max-tokens", "2000",
                              "--session", "s"])
    p.stdin.write(lines("hello", "not answered").encode())
    p.stdin.close()
    read_until(p.stdout)
    p.stdout.close()  # like `colichat | head -c 1`
    err = p.stderr.read().decode()
    p.wait(timeout=120)
    assert "Traceback" not in err and p.returncode == 1, err
    assert "colichat: the output was closed; stopping" in err
    assert ", interrupted; saved to s]" in err
    assert saved_users(colichat_home, "s") == ["hello"] and saved_answers(colichat_home, "s")[0]


@pytest.mark.process
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_shutdown_or_a_closed_terminal_keeps_the_answer_so_far(sig, colichat_home):
    """SIGTERM (a shutdown, `kill`) or SIGHUP (the terminal closed) during an answer: it ends after the
    current token, what was generated is saved, no further input is read; exit 128 + the signal."""
    p = start(colichat_home, ["--model", TINY_LLAMA, *GREEDY, "--ctx", "2048", "--max-tokens", "2000",
                              "--session", "s"])
    p.stdin.write(lines("hello", "not answered").encode())
    p.stdin.flush()
    head = read_until(p.stdout)  # the answer has begun
    p.send_signal(sig)
    run = finish(p, head)
    run.exits(128 + sig)
    assert run.errors() == [f"colichat: ended by {sig.name}"], run.err
    assert ", interrupted; saved to s]" in run.err
    assert saved_users(colichat_home, "s") == ["hello"]
    assert run.out.decode().startswith(saved_answers(colichat_home, "s")[0])  # all it showed, and saved


def _answer_seconds(err: str) -> float:
    """How long the answer took by its footer (its tokens over its tok/s)."""
    tokens, tps = re.search(r"^\[(\d+) tokens, ([\d.]+) tok/s", err, re.M).groups()
    return int(tokens) / float(tps)


@pytest.mark.process
def test_the_time_colichat_was_stopped_does_not_count_in_the_answer_speed(colichat_home):
    """Stopped mid-answer (Ctrl-Z) and continued later (`fg`: SIGCONT): the footer's tok/s is the
    model's speed, not one that counts the pause."""
    args = ["--model", TINY_LLAMA, *GREEDY, "--max-tokens", "600"]
    plain = chat(colichat_home, args, lines("hello")).ok()
    pause = 3 * _answer_seconds(plain.err) + 1  # longer than the answer takes, even on a busy machine
    p = start(colichat_home, args)
    p.stdin.write(lines("hello").encode())
    p.stdin.flush()
    head = read_until(p.stdout)  # the answer has begun
    began = time.monotonic()
    p.send_signal(signal.SIGSTOP)  # as Ctrl-Z stops it (SIGTSTP, which a process group without a shell may not get)
    time.sleep(pause)  # (the pause is what is measured)
    while select.select([p.stdout], [], [], 0)[0] and (chunk := os.read(p.stdout.fileno(), 65536)):
        head += chunk  # what it wrote before it stopped
    p.send_signal(signal.SIGCONT)
    run = finish(p, head)
    after_it_began = time.monotonic() - began  # the pause and the rest of the answer
    run.ok()
    assert len(run.out) > len(head), "the answer had ended before the stop"
    assert run.out == plain.out
    # Counted with the pause, the answer's time would exceed `after_it_began`; without it, it is short
    # of it by about the pause (less the answer's first token, which came before `began`). Both sides
    # slow down together on a busy machine.
    assert _answer_seconds(run.err) < after_it_began - pause / 2, (run.err, after_it_began, pause)


def _run(home, args, shell: str = "", program=CHAT, **popen) -> Run:
    """colichat with its standard streams set up by `shell` (e.g. `>&-`, `2>/dev/full`) and `popen`."""
    p = subprocess.run(["sh", "-c", f'exec "$@" {shell}', "sh", *program, *map(str, args)], input=b"",
                       env=env_for(home), cwd=str(home), timeout=300,
                       **{"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **popen})
    return Run(p.returncode, p.stdout or b"", (p.stderr or b"").decode("utf-8", "replace"))


@pytest.mark.process
def test_an_answer_that_cannot_be_written_stops_in_one_line_and_is_kept(colichat_home):
    """stdout a file on a full disk (/dev/full): one line, exit 1, and what was generated is saved."""
    with open("/dev/full", "wb") as full:
        run = _run(colichat_home, [*TINY_ARGS, "--session", "s", "-p", Q[0]], stdout=full)
    run.failed()
    assert run.errors() == ["colichat: cannot write the answer (No space left on device); stopping"], run.err
    assert ", interrupted; saved to s]" in run.err
    assert saved_users(colichat_home, "s") == [Q[0]] and len(saved_answers(colichat_home, "s")) == 1


@pytest.mark.process
def test_listing_and_export_that_cannot_be_written_say_so_in_one_line(colichat_home):
    chat_here(colichat_home, [*TINY_ARGS, "--session", "s"], lines(Q[0])).ok()
    for args in (["--sessions"], ["--export", "s"]):
        with open("/dev/full", "wb") as full:
            run = _run(colichat_home, args, stdout=full)
        run.failed()
        assert run.errors() == ["colichat: cannot write to standard output: No space left on device"], run.err
        r, w = os.pipe()
        os.close(r)  # a reader that has stopped reading (`| head -1`): it has what it wanted
        try:
            run = _run(colichat_home, args, stdout=w)
        finally:
            os.close(w)
        run.ok()
        assert run.err == ""


@pytest.mark.process
def test_closed_or_full_standard_streams_lose_only_what_went_to_them(colichat_home):
    """A closed stream is as if it were /dev/null, never a file colichat opens: the answers and the
    saved session are those of an ordinary run. A full stderr loses the status lines, not the answer."""
    args = [*TINY_ARGS, "-p", Q[0]]
    plain = chat_here(colichat_home, [*args, "--session", "plain"]).ok()
    no_out = _run(colichat_home, [*args, "--session", "no-out"], ">&-").ok()
    assert no_out.out == b"" and "saved to no-out]" in no_out.err
    no_err = _run(colichat_home, [*args, "--session", "no-err"], "2>&-").ok()
    full_err = _run(colichat_home, [*args, "--session", "full-err"], "2>/dev/full").ok()
    assert no_err.out == full_err.out == plain.out and no_err.err == full_err.err == ""
    names = ("no-out", "no-err", "full-err")
    assert all(saved_turns(colichat_home, name) == saved_turns(colichat_home, "plain") for name in names)
    go_on = [chat_here(colichat_home, [*TINY_ARGS, "--resume", "--session", name], lines(Q[1])).ok()
             for name in ("plain", *names)]  # the caches on disk: the next answer is the same from each
    assert [r.resumed()[2] for r in go_on] == ["plain", *names] and len({r.out for r in go_on}) == 1
    no_in = _run(colichat_home, TINY_ARGS, "<&-").ok()
    assert no_in.out == b"" and not no_in.errors()
    launched = _run(colichat_home, args, "2>&-", program=[sys.executable, "-m", "colichat.terminal.launch"]).ok()
    assert launched.out == plain.out  # the command itself (its "starting" line), not only colichat.terminal.cli


@pytest.mark.process
def test_unencodable_answer_text_is_replaced_not_fatal(colichat_home):
    run = chat(colichat_home, [*TINY_ARGS, "--session", "s"], lines(*Q[:2]),
               env_extra={"PYTHONIOENCODING": "ascii"}).ok()
    answers = saved_answers(colichat_home, "s")
    assert any(ord(c) > 127 for a in answers for c in a)  # the tiny model's gibberish is not ASCII
    assert run.out == b"".join(a.encode("ascii", "replace") + b"\n" for a in answers)


def test_bad_model_does_not_touch_sessions(tmp_path, colichat_home):
    chat_here(colichat_home, [*TINY_ARGS, "--session", "s"], lines(Q[0])).ok()
    before = {p: p.read_bytes() for p in session_files(colichat_home)}
    cut = tmp_path / "llama.gguf"
    shutil.copyfile(TINY_LLAMA, cut)
    with open(cut, "r+b") as f:
        f.truncate(1_000_000)
    chat_here(colichat_home, ["--model", cut, "--resume", "--session", "s"]).failed()
    assert {p: p.read_bytes() for p in session_files(colichat_home)} == before


def test_failure_inside_an_answer_leaves_cache_and_turns_consistent(colichat_home):
    """In-process: an exception while the answer streams (here from the output callback) drops the
    whole exchange from the cache, so the next message and the saved session stay consistent."""
    from colichat.conversation.chat import Conversation, Settings
    from colichat.engine import load

    model = load(TINY_LLAMA)
    conv = Conversation(model, Settings(temperature=0, max_tokens=8), session_name="s")
    try:
        conv.ask(Q[0])
        before = conv.model.cache.length

        def broken(piece):
            raise RuntimeError("output failed")

        with pytest.raises(RuntimeError):
            conv.ask(Q[1], on_text=broken)
        assert conv.model.cache.length == before == conv.transcript.turns[-1].last
        answer, stats = conv.ask(Q[1])
        assert stats.saved and conv.model.cache.length == conv.transcript.turns[-1].last
    finally:
        conv.close()
    ref = chat_here(colichat_home, [*TINY_ARGS, "--session", "r"], lines(*Q[:2])).ok()
    assert saved_answers(colichat_home, "s") == saved_answers(colichat_home, "r")
    assert ref.out.endswith(answers_bytes([answer]))


def test_control_characters_from_files_are_shown_not_sent_to_the_terminal(colichat_home, tmp_path):
    """A model's general.name and a saved message with escape sequences (colour, window title, bell):
    the first line, the latest-conversation line, /sessions and --sessions show them in caret
    notation, as /history does, so they cannot act on the terminal."""
    from cli_helpers import copy_gguf

    path = copy_gguf(TINY_LLAMA, tmp_path / "odd.gguf", set_keys={"general.name": "evil\x1b[31mred\x07"})
    chat_here(colichat_home, ["--model", path, *GREEDY, "--max-tokens", "4", "--session", "e"],
         lines("\x1b[31mRED\x1b]0;TITLE\x07 msg")).ok()
    run = chat_here(colichat_home, ["--model", path, *GREEDY, "--max-tokens", "4"], lines("/sessions")).ok()
    shown = run.err + chat_here(colichat_home, ["--sessions"]).ok().out.decode()
    assert "\x1b" not in shown and "\x07" not in shown, shown
    assert run.err.startswith("evil^[[31mred^G (llama, ")
    assert 'latest saved conversation: e: 2 turns, ' in run.err and '"^[[31mRED^[]0;TITLE^G msg"' in run.err


def test_weights_that_overflow_show_no_numpy_warnings(colichat_home, tmp_path):
    """A model whose output head overflows float32: one line from colichat (it computed NaN or not),
    no numpy RuntimeWarning with its source line."""
    import numpy as np
    from cli_helpers import copy_gguf

    with np.errstate(over="ignore"):  # (weights beyond float32: inf)
        path = copy_gguf(TINY_LLAMA, tmp_path / "huge.gguf", scale={"output.weight": 1e39})
    run = chat_here(colichat_home, ["--model", path, *GREEDY, "--max-tokens", "2", "-p", "hi"])
    assert "RuntimeWarning" not in run.err and "computed NaN" in run.err, run.err
