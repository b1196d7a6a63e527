"""The same faults as test_persist_inject.py, injected by the kernel's side: strace makes the k-th
system call of one kind fail (openat, write, pwrite64, fsync, fchmod, ftruncate, rename, unlink,
flock) in a child that creates a session, appends to it and rewinds it, retrying a step once after
an error. The session must then load exactly as if no error had happened.

strace attaches once the child has imported everything, so the calls counted are the session's own.
Where strace is missing or may not trace (no ptrace), the test is skipped with that reason, which
`make test` prints (pytest -rs); the in-process injection covers the same steps everywhere.
"""

from __future__ import annotations

import collections
import os
import shutil
import subprocess
import sys

import pytest
from persist_helpers import IDENT, TESTS, build, layout_of, make_cache

from colichat.persist import Store

pytestmark = pytest.mark.process  # every test here starts a process or a terminal

SYSCALLS = {"openat": "EACCES", "write": "ENOSPC", "pwrite64": "ENOSPC", "fsync": "EIO", "fchmod": "EPERM",
            "ftruncate": "EIO", "rename": "ENOSPC", "unlink": "EIO", "flock": "ENOLCK"}
MAX_K = 4  # the first MAX_K calls of each kind (all of them for most kinds)

CHILD = """
import os, sys
sys.path.insert(0, {tests!r})
from persist_helpers import IDENT, build, layout_of, make_cache
from colichat.persist import SessionError, Store

cache = make_cache()
turns = build(cache, 3)
store = Store()
sys.stdout.write(f"{{os.getpid()}}\\n")
sys.stdout.flush()
sys.stdin.readline()  # the tracer is attached from here on
errors, sess = [], None

def step(name):
    global sess
    if name == "create":
        sess = store.create(IDENT, layout_of(cache), name="s")
    elif name == "append":
        sess.append(cache, turns)
    else:
        sess.truncate(1)

for name in ("create", "append", "truncate"):
    try:
        step(name)
    except SessionError as e:
        errors.append(f"{{name}}: {{e}}")
        step(name)  # once more: the error was one call
sess.close()
sys.stderr.write("\\n".join(errors))
sys.exit(10 if errors else 0)
"""


def strace_problem() -> str | None:
    if shutil.which("strace") is None:
        return "strace is not installed"
    probe = subprocess.run(["strace", "-o", "/dev/null", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"strace cannot trace here: {probe.stderr.strip().splitlines()[-1:]}"
    return None


def run_traced(home, strace_args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLICHAT_HOME": str(home)}
    child = subprocess.Popen([sys.executable, "-c", CHILD.format(tests=str(TESTS))], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    tracer = None
    try:
        pid = int(child.stdout.readline())
        tracer = subprocess.Popen(["strace", "-p", str(pid), *strace_args], stderr=subprocess.PIPE, text=True)
        line = tracer.stderr.readline()  # "strace: Process N attached"
        assert "attached" in line, line
        child.stdin.write(b"go\n")
        child.stdin.flush()
        out, err = child.communicate(timeout=120)
        tracer.wait(timeout=60)
    finally:
        for p in (child, tracer):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    return subprocess.CompletedProcess(child.args, child.returncode, out, err.decode("utf-8", "replace"))


def test_an_error_at_each_system_call_of_create_append_truncate(tmp_path):
    problem = strace_problem()
    if problem:
        pytest.skip(f"{problem}: the kernel-side injection needs strace (Debian: apt install strace; make "
                    "test installs it) and ptrace allowed; test_persist_inject.py injects the same faults in-process")
    log = tmp_path / "calls"
    clean = run_traced(tmp_path / "count", ["-e", f"trace={','.join(SYSCALLS)}", "-o", str(log)])
    assert clean.returncode == 0, clean.stderr
    calls = [line for line in log.read_text().splitlines() if "(" in line and not line.startswith("write(2,")]
    counts = collections.Counter(line.split("(")[0] for line in calls)  # (the child's report goes last)
    assert {"openat", "pwrite64", "fsync", "rename", "flock"} <= set(counts), counts
    cache = make_cache()
    turns = build(cache, 3)
    trials = errors = 0
    for call, err in SYSCALLS.items():
        for k in range(1, min(counts[call], MAX_K) + 1):
            home = tmp_path / f"{call}-{k}"
            r = run_traced(home, ["-e", f"trace={call}", "-e", f"inject={call}:error={err}:when={k}",
                                  "-o", "/dev/null"])
            trials += 1
            assert r.returncode in (0, 10) and "Traceback" not in r.stderr, (call, k, r.stderr)
            if r.returncode == 10:
                errors += 1
                assert all(line.split(": ", 1)[1].startswith(("could not", "cannot"))
                           for line in r.stderr.splitlines()), (call, k, r.stderr)
            directory = Store(home / "data" / "sessions").model_dir(IDENT)
            assert not [p for p in os.listdir(directory) if p.endswith(".tmp")], (call, k)
            with Store(home / "data" / "sessions").open(IDENT, "s", layout_of(cache)) as sess:
                res = sess.load(loaded := make_cache())
            assert res.turns == turns[:1] and res.warnings == [], (call, k, res.warnings)
            assert loaded.raw(0, res.tokens).tobytes() == cache.raw(0, res.tokens).tobytes()
    assert trials >= 20 and errors >= trials // 2, (trials, errors)


def test_a_save_as_killed_at_any_rename_leaves_no_session_or_the_whole_copy(colichat_home):
    """`/save NAME` killed (SIGKILL, by strace) at its k-th rename, for every k: NAME is either not a
    session (not listed, and `/save NAME` takes it) or the whole copy, never an empty session."""
    problem = strace_problem()
    if problem:
        pytest.skip(f"{problem}: killing a save at its k-th rename needs strace (Debian: apt install strace; "
                    "make test installs it) and ptrace allowed")
    from cli_helpers import CHAT, TINY_ARGS, chat, env_for, lines, saved_turns

    chat(colichat_home, [*TINY_ARGS, "--session", "kr"], lines("Hello there", "And again")).ok()
    whole = saved_turns(colichat_home, "kr")
    for k in range(1, 20):
        killed = subprocess.run(["strace", "-f", "-qq", "-o", "/dev/null", "-e", "trace=rename", "-e",
                                 f"inject=rename:signal=SIGKILL:when={k}", *CHAT, *TINY_ARGS, "--session", "kr"],
                                input=b"/save copy\n", capture_output=True, env=env_for(colichat_home),
                                cwd=str(colichat_home), timeout=300)
        listed = chat(colichat_home, ["--sessions"]).ok().out.decode()
        if killed.returncode == 0:  # the save was done before the k-th rename
            assert saved_turns(colichat_home, "copy") == whole
            break
        assert killed.returncode in (-9, 137), killed.stderr.decode()
        if "copy:" in listed:
            assert "  copy: 4 turns" in listed.splitlines(), (k, listed)
            assert saved_turns(colichat_home, "copy") == whole
        else:
            chat(colichat_home, [*TINY_ARGS, "--session", "kr"], lines("/save copy")).ok()
            assert saved_turns(colichat_home, "copy") == whole
        chat(colichat_home, [*TINY_ARGS, "--session", "kr"], lines("/delete copy")).ok()
    else:
        raise AssertionError("the save never finished")


@pytest.mark.parametrize("inject", ["fsync:error=EIO:when=1", "rename:error=ENOSPC:when=1"])
def test_a_failed_rewind_save_is_said_and_the_next_answer_saves_the_rewound_conversation(colichat_home, inject):
    """The second attack's reproduction: `/rewind` then a message, the rewind's save failing once. The
    rewind is said to wait for the next save, the answer is not lost (it crashed with 'truncate first'),
    and the conversation saved is the rewound one with the new exchange."""
    problem = strace_problem()
    if problem:
        pytest.skip(f"{problem}: a kernel-side fault needs strace (make test installs it); "
                    "tests/test_chat_faults.py injects the same faults in-process")
    from cli_helpers import CHAT, TINY_ARGS, chat, env_for, lines, saved_users

    chat(colichat_home, [*TINY_ARGS, "--session", "a"], lines("one", "two")).ok()
    call = inject.split(":")[0]
    [sidecar] = colichat_home.glob("data/sessions/*/a.json")  # -P: only the calls on its files count
    run = subprocess.run(["strace", "-f", "-qq", "-o", "/dev/null", "-P", str(sidecar), "-P", f"{sidecar}.tmp",
                          "-e", f"trace={call}", "-e", f"inject={inject}",
                          *CHAT, *TINY_ARGS, "--session", "a"], input=lines("/rewind", "extra msg").encode(),
                         capture_output=True, env=env_for(colichat_home), cwd=str(colichat_home), timeout=300)
    err = run.stderr.decode()
    assert run.returncode == 0 and "Traceback" not in err, err
    assert "warning: could not save session a" in err and "saved to a]" in err, err
    assert saved_users(colichat_home, "a") == ["one", "extra msg"]


def test_a_kill_at_the_rewind_s_sidecar_rename_never_brings_the_rewound_text_back(colichat_home):
    """SIGKILL at each rename of `/rewind` (its sidecar's is the commit): the conversation reopens as it
    was before the rewind or as rewound, and what the rewind removed is never read again from its text."""
    problem = strace_problem()
    if problem:
        pytest.skip(f"{problem}: killing a rewind at its k-th rename needs strace (make test installs it)")
    from cli_helpers import CHAT, TINY_ARGS, chat, env_for, lines, saved_users

    for k in range(1, 4):
        chat(colichat_home, [*TINY_ARGS, "--session", f"k{k}"], lines("one", "secret")).ok()
        subprocess.run(["strace", "-f", "-qq", "-o", "/dev/null", "-e", "trace=rename", "-e",
                        f"inject=rename:signal=SIGKILL:when={k}", *CHAT, *TINY_ARGS, "--session", f"k{k}"],
                       input=lines("/rewind").encode(), capture_output=True, env=env_for(colichat_home),
                       cwd=str(colichat_home), timeout=300)
        shown = chat(colichat_home, [*TINY_ARGS, "--session", f"k{k}"], lines("/history")).ok().err
        users = saved_users(colichat_home, f"k{k}")
        assert users in (["one"], ["one", "secret"]), (k, users)
        assert "again from" not in shown and "warning" not in shown, (k, shown)  # (no record dropped, no text read)
        if users == ["one"]:
            assert "secret" not in shown, (k, shown)


def test_a_regen_killed_at_any_write_keeps_the_message_and_one_of_its_answers(colichat_home):
    """The third attack's N1: `/regen`'s save killed (SIGKILL, by strace) at each pwrite64, fsync, rename and
    ftruncate on the session's files. Afterwards the conversation (as --export reads it) holds the message
    and the old answer or the new one, never less, with no warning; the old code lost the message."""
    problem = strace_problem()
    if problem:
        pytest.skip(f"{problem}: killing a /regen at its k-th write needs strace (make test installs it)")
    from cli_helpers import CHAT, TINY_LLAMA, chat, env_for, lines, saved_turns

    from colichat.persist.loading import read_saved

    args = ["--model", TINY_LLAMA, "--temperature", "1", "--seed", "5", "--max-tokens", "8", "--session", "a"]
    chat(colichat_home, args, lines("Hello there", "And again")).ok()
    [kv] = colichat_home.glob("data/sessions/*/a.coli_kv")
    side, directory = kv.with_suffix(".json"), kv.parent
    saved = {p: p.read_bytes() for p in (kv, side)}
    old = saved_turns(colichat_home, "a")
    chat(colichat_home, args, lines("/regen")).ok()  # seeded: every /regen from `saved` answers this
    new = saved_turns(colichat_home, "a")
    assert new[:3] == old[:3] and new[3] != old[3]
    seen = set()
    for call in ("pwrite64", "fsync", "rename", "ftruncate"):
        for k in range(1, 30):
            for p in directory.iterdir():
                if p.suffix != ".lock":
                    p.unlink()
            for p, data in saved.items():
                p.write_bytes(data)
            paths = ["-P", str(kv), "-P", str(side), "-P", f"{side}.tmp"]  # (only the calls on its files count)
            run = subprocess.run(["strace", "-f", "-qq", "-o", "/dev/null", *paths, "-e", f"trace={call}",
                                  "-e", f"inject={call}:signal=KILL:when={k}", *CHAT, *args],
                                 input=lines("/regen").encode(), capture_output=True,
                                 env=env_for(colichat_home), cwd=str(colichat_home), timeout=300)
            res = read_saved(directory, "a")
            got = [(t.role, t.text) for t in res.turns]
            assert got in (old, new) and res.warnings == [] and not res.unread, (call, k, got, res.warnings)
            seen.add(got == new)
            if run.returncode == 0:  # the save was done before the k-th call
                break
            assert run.returncode in (-9, 137), run.stderr.decode()
        else:
            raise AssertionError(f"/regen never finished under {call} kills")
    assert seen == {False, True}
    assert "And again" in chat(colichat_home, ["--export", "a"]).ok().out.decode()
