"""Persistence through the program: a full disk at the first start, concurrent starts on one name,
damaged or planted session files named with the command that clears them, private file modes."""

from __future__ import annotations

import json
import os
import resource
import struct
import time

import pytest
from cli_helpers import (
    TINY_ARGS,
    chat,
    chat_here,
    finish,
    lines,
    read_until,
    saved_turns,
    saved_users,
    session_files,
    start,
)
from persist_helpers import snapshot


def session_dir(home):
    """The one model's session directory."""
    [directory] = {p.parent for p in session_files(home)}
    return directory


@pytest.mark.process
def test_a_full_disk_at_the_first_start_leaves_the_name_usable(colichat_home):
    """D1 through the program: a file size limit too small for a KV header (the disk is full), then
    space again: `--session s` starts and saves, and `--resume` finds it."""

    def tiny_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (20, resource.RLIM_INFINITY))

    chat(colichat_home, [*TINY_ARGS, "--no-save"]).ok()  # the weights cache, made without the limit
    full = chat(colichat_home, [*TINY_ARGS, "--session", "s"], lines("Hello there"), preexec_fn=tiny_files)
    assert "NOT saved: could not create session s: File too large" in full.failed().footers()[0]
    assert [p.name for p in session_files(colichat_home) if not p.name.endswith(".lock")] == []
    chat(colichat_home, [*TINY_ARGS, "--session", "s"], lines("Hello there")).ok()
    again = chat(colichat_home, [*TINY_ARGS, "--resume"], lines("Thanks a lot")).ok()
    assert again.resumed()[1:] == (2, "s")


@pytest.mark.process
def test_concurrent_starts_on_one_new_name(colichat_home):
    """Six colichats started at once with the same new --session: one has the name from its start;
    the five others say so and exit before any answer (they never read their input)."""
    chat(colichat_home, [*TINY_ARGS, "--no-save"]).ok()  # the weights cache, made once
    procs = [start(colichat_home, [*TINY_ARGS, "--session", "same"]) for _ in range(6)]
    try:
        deadline = time.monotonic() + 300
        while sum(p.poll() is not None for p in procs) < 5:
            assert time.monotonic() < deadline, "the losers did not exit"
            time.sleep(0.05)
        [winner] = [p for p in procs if p.poll() is None]
        for p in procs:
            if p is not winner:
                run = finish(p).failed()
                assert run.out == b"" and run.footers() == []
                assert run.errors() == [f"colichat: session same is open in another colichat (pid {winner.pid})"]
        winner.stdin.write(lines("Hello there").encode())
        run = finish(winner).ok()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert run.footers()[0].endswith("; saved to same]")
    assert saved_users(colichat_home, "same") == ["Hello there"]


def test_a_damaged_session_gets_the_same_advice_everywhere(colichat_home):
    chat_here(colichat_home, [*TINY_ARGS, "--session", "s"], lines("Hello there")).ok()
    [kv] = [p for p in session_files(colichat_home) if p.suffix == ".coli_kv"]
    kv.write_bytes(b"")
    kv.with_suffix(".json").unlink()  # (with its sidecar, its text is read again: test_read_again.py)
    line = "s: damaged (empty KV file); /delete s removes it"
    listing = chat_here(colichat_home, TINY_ARGS, lines("/sessions")).ok()
    assert f"  {line}" in listing.err.splitlines()
    for args in (["--session", "s"], ["--resume", "--session", "s"]):
        run = chat_here(colichat_home, [*TINY_ARGS, *args], lines("Hi")).failed()
        assert run.errors() == [f"colichat: session {line}"] and run.out == b""
    chat_here(colichat_home, TINY_ARGS, lines("/delete s")).ok()
    chat_here(colichat_home, [*TINY_ARGS, "--session", "s"], lines("Hello there")).ok()
    assert saved_users(colichat_home, "s") == ["Hello there"]


def test_opening_a_damaged_conversation_with_options_writes_nothing(colichat_home):
    """Loading reads only, whatever options are given, also when it reads a damaged exchange again from
    its text: the damaged last answer stays on disk (for the user to inspect or restore) until the
    conversation goes on, at start or by /resume NAME; the next answer saves it whole."""
    chat_here(colichat_home, [*TINY_ARGS, "--session", "e"], lines("Hello there", "Thanks a lot")).ok()
    directory = session_dir(colichat_home)
    kv = directory / "e.coli_kv"
    kv.write_bytes(kv.read_bytes()[:-100])  # the last answer's records cut short
    before = snapshot(directory)
    for args, inputs in (([*TINY_ARGS, "--session", "e"], ["/quit"]),
                         ([*TINY_ARGS, "--resume", "--max-tokens", "5"], ["/history"]),
                         ([*TINY_ARGS, "--seed", "3"], ["/resume e", "/history"])):
        run = chat_here(colichat_home, args, lines(*inputs)).ok()
        assert run.resumed()[1:] == (2, "e") and "warning: " in run.err  # the cut answer's exchange dropped
        assert "note: read 1 exchange again from its saved text" in run.err  # ... and read again
        assert snapshot(directory) == before, args
    # the next answer repairs it
    chat_here(colichat_home, [*TINY_ARGS, "--session", "e"], lines("Go on")).ok()
    assert saved_users(colichat_home, "e") == ["Hello there", "Thanks a lot", "Go on"]


def test_options_given_when_reopening_are_saved_with_the_next_answer_only(colichat_home):
    """--temperature 1.5 on a saved conversation applies at once but changes nothing of it on disk until
    an answer or a /set saves it (reopened, it is the latest used: the start-up line names it)."""
    chat_here(colichat_home, [*TINY_ARGS, "--temperature", "0.5", "--session", "st"], lines("Hello there")).ok()
    chat_here(colichat_home, [*TINY_ARGS, "--session", "other"], lines("Thanks a lot")).ok()
    directory = session_dir(colichat_home)
    before = snapshot(directory)
    for args, inputs in ((["--session", "st"], ["/show"]), ([], ["/resume st", "/show"])):
        run = chat_here(colichat_home, [*TINY_ARGS, "--temperature", "1.5", *args], lines(*inputs)).ok()
        assert "temperature    1.5" in run.err.splitlines()
        assert snapshot(directory) == before, args
    latest = chat_here(colichat_home, TINY_ARGS, lines("/quit")).ok()
    assert "latest saved conversation: st: " in latest.err

    def saved_temperature():
        return json.loads((directory / "st.json").read_text("utf-8"))["sampler"]["temperature"]

    assert saved_temperature() == 0.5
    chat_here(colichat_home, [*TINY_ARGS, "--temperature", "1.5", "--session", "st"], lines("Go on")).ok()
    assert saved_temperature() == 1.5
    chat_here(colichat_home, [*TINY_ARGS, "--session", "st"], lines("/set temperature 0.25")).ok()
    assert saved_temperature() == 0.25


@pytest.mark.process
def test_a_session_file_removed_between_answers_is_written_again(colichat_home):
    run = start(colichat_home, [*TINY_ARGS, "--session", "s"])
    try:
        run.stdin.write(lines("Hello there").encode())
        run.stdin.flush()
        head = read_until(run.stderr, b"saved to s]")
        for p in session_files(colichat_home):
            if p.suffix in (".coli_kv", ".json"):
                p.unlink()
        run.stdin.write(lines("Thanks a lot").encode())
    finally:
        done = finish(run, head_err=head).ok()
    assert "note: the KV file of session s was removed by another program: wrote the session again " \
        "from memory" in done.err
    assert saved_users(colichat_home, "s") == ["Hello there", "Thanks a lot"]
    again = chat(colichat_home, [*TINY_ARGS, "--resume"]).ok()
    assert again.resumed()[1:] == (4, "s") and "warning" not in again.err


@pytest.mark.process
def test_everything_colichat_creates_is_private_under_umask_000(tmp_path, monkeypatch):
    """COLICHAT_HOME (made by colichat), its data, state and cache directories, the weights cache,
    the sessions and the input history: directories 0700, files 0600, though the umask is 000."""
    import os
    import stat
    import subprocess

    from cli_helpers import CHAT, env_for

    home = tmp_path / "home"
    p = subprocess.run([*CHAT, *TINY_ARGS, "--session", "p"], input=b"Hello there\n", capture_output=True,
                       env=env_for(home), cwd=str(tmp_path), preexec_fn=lambda: os.umask(0), timeout=300)
    assert p.returncode == 0, p.stderr
    monkeypatch.setenv("COLICHAT_HOME", str(home))
    old = os.umask(0)
    try:  # the input history, made by the interactive prompt
        from colichat.terminal.repl import input_history

        input_history().store_string("hello")
    finally:
        os.umask(old)
    modes = {}
    for root, dirs, files in os.walk(home):
        for name in dirs + files:
            path = os.path.join(root, name)
            modes[os.path.relpath(path, home)] = stat.S_IMODE(os.lstat(path).st_mode)
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
    assert {"data", "state", "cache", "cache/weights", "state/history"} <= set(modes)
    assert any(f.endswith("weights.f32") for f in modes) and any(f.endswith("p.coli_kv") for f in modes)
    wrong = {f: oct(m) for f, m in modes.items() if m != (0o700 if (home / f).is_dir() else 0o600)}
    assert wrong == {}


def test_an_answer_cut_from_the_kv_file_is_read_again_or_takes_its_message_with_it(colichat_home):
    """A KV file cut inside the last answer: its exchange is read again from its saved text, and the
    next message follows it. Where that answer's text is damaged too (its checksum fails), the resumed
    conversation ends with the exchange before: the next message follows an answer (never two
    messages in a row), and the warning says why."""
    for name, forged in (("s", False), ("t", True)):
        chat_here(colichat_home, [*TINY_ARGS, "--session", name], lines("Hello there", "And again")).ok()
        directory = session_dir(colichat_home)
        kv, sidecar = directory / f"{name}.coli_kv", directory / f"{name}.json"
        os.truncate(kv, kv.stat().st_size - 100)
        if forged:
            doc = json.loads(sidecar.read_text("utf-8"))
            doc["turns"][3]["text"] = "FORGED"
            sidecar.write_text(json.dumps(doc), "utf-8")
        run = chat_here(colichat_home, [*TINY_ARGS, "--session", name], lines("Once more")).ok()
        assert run.resumed()[1:] == (2, name)
        assert "warning: dropped turn 3 (records " in run.err and "a message whose answer is not there" in run.err
        assert ("note: read 1 exchange again from its saved text" in run.err) is not forged
        users = ["Hello there", "Once more"] if forged else ["Hello there", "And again", "Once more"]
        assert [role for role, _ in saved_turns(colichat_home, name)] == ["user", "assistant"] * len(users)
        assert saved_users(colichat_home, name) == users


def test_a_negative_header_field_gets_the_delete_advice(colichat_home):
    chat_here(colichat_home, [*TINY_ARGS, "--session", "s"], lines("Hello there")).ok()
    [kv] = [p for p in session_files(colichat_home) if p.suffix == ".coli_kv"]
    with open(kv, "r+b") as f:
        f.seek(32)
        f.write(struct.pack("<i", -5))
    kv.with_suffix(".json").unlink()
    line = "s: damaged (a negative field in its header: nrec -5); /delete s removes it"
    assert f"  {line}" in chat_here(colichat_home, TINY_ARGS, lines("/sessions")).ok().err.splitlines()
    run = chat_here(colichat_home, [*TINY_ARGS, "--session", "s"], lines("Hi")).failed()
    assert run.errors() == [f"colichat: session {line}"]


def test_sessions_that_opening_refuses_are_listed_as_damaged_and_never_the_latest(colichat_home, tmp_path):
    """A sidecar that is not colichat's, a symlinked sidecar, a bare KV file of another model: listed
    as damaged by /sessions and --sessions, never offered at start as the conversation to resume."""
    chat_here(colichat_home, [*TINY_ARGS, "--session", "good"], lines("Hello there")).ok()
    for name in ("foreign", "linked", "bare"):
        chat_here(colichat_home, [*TINY_ARGS, "--session", name], lines("Hi")).ok()
    directory = next(p.parent for p in session_files(colichat_home) if p.name == "good.coli_kv")
    (directory / "foreign.json").write_text('{"foo": 1}')
    real = tmp_path / "linked.json"
    real.write_bytes((directory / "linked.json").read_bytes())
    (directory / "linked.json").unlink()
    (directory / "linked.json").symlink_to(real)
    (directory / "bare.json").unlink()
    with open(directory / "bare.coli_kv", "r+b") as f:  # a cache of a model with 3 layers, not 4
        f.seek(8)
        f.write(struct.pack("<i", 3))
    later = time.time() + 3600  # the damaged ones used after "good": newer, yet never the latest
    for path in directory.glob("[flb]*"):
        os.utime(path, (later, later), follow_symlinks=False)
    damaged = ["foreign: damaged (the sidecar is not a colichat sidecar); /delete foreign removes it",
               "linked: damaged (the sidecar is a symbolic link); /delete linked removes it",
               "bare: damaged (a cache of another model: n_layers 3 (model: 4)); /delete bare removes it"]
    start = chat_here(colichat_home, TINY_ARGS, lines("/sessions")).ok()
    assert "latest saved conversation: good: 2 turns" in start.err
    rows = [row.strip() for row in start.err.splitlines()]
    assert all(line in rows for line in damaged)
    rows = [row.strip() for row in chat_here(colichat_home, ["--sessions"]).ok().out.decode().splitlines()]
    assert all(line in rows for line in damaged)
    for name in ("foreign", "linked", "bare"):
        chat_here(colichat_home, [*TINY_ARGS, "--session", name], lines("Hi")).failed()


def test_a_damaged_conversation_of_another_model_is_named_not_passed_over(colichat_home):
    """--session NAME where only another model has NAME, damaged beyond reading (no sidecar, an empty KV
    file): one line naming it, not a new conversation of the default model under the same name."""
    chat_here(colichat_home, [*TINY_ARGS, "--session", "s"], lines("Hello there")).ok()
    [kv] = [p for p in session_files(colichat_home) if p.suffix == ".coli_kv"]
    kv.write_bytes(b"")
    kv.with_suffix(".json").unlink()
    run = chat_here(colichat_home, ["--session", "s"], lines("Hi")).failed()
    assert run.errors() == [f"colichat: session s of another model ({kv.parent.name}) is damaged (empty KV file); "
                            "start colichat with that model's --model PATH to see it in /sessions, or choose "
                            "another name"]
    assert sorted(p.name for p in session_files(colichat_home)) == ["s.coli_kv", "s.lock"]  # no new "s"
