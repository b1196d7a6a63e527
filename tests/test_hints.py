"""Hints are hints, everywhere (hints.py): every file colichat reads only as a hint, driven through the same
damages, leaves a start (or a new conversation) working, says so once, and never hangs. Each run is a process
bounded by a timeout; "no permission" runs as a user file permissions apply to (cli_helpers.unprivileged).

    the prefix index          data/prefixes/MODEL.json              a new conversation looks it up, saves update it
    the last-used mark        data/last-used/MODEL                  a start names the latest conversation
    the weights cache's meta  cache/weights/KEY/meta.json           a start maps the dequantized weights
    the experts' use counts   cache/weights/KEY/usage.npy           a MoE model's start warms its expert cache
    the hub cache's ref       HF_HOME/hub/models--O--R/refs/main    an hf: model from the cache
    the hub's agent registry  HF_HOME/.agent_harnesses.json         an hf: model downloaded (its requests' headers)
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import stat
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import GREEDY, TINY_LLAMA, chat, lines, unprivileged
from conftest import TINY
from hub_server import HubServer

from colichat.hints import Hint, Said, read_hint
from colichat.models import hub

MOE = str(TINY / "ds-v2-lite.gguf")
REPO = "test/tiny-GGUF"
TIMEOUT = 120  # s a run may take at most: a hang fails the test
DIGITS = b"9" * 5001
DEEP = b"[" * 100_000 + b"]" * 100_000


def _npy(shape: bytes) -> bytes:
    """A .npy file whose header declares `shape` (no data follows)."""
    header = b"{'descr': '<f4', 'fortran_order': False, 'shape': (" + shape + b",), }"
    header += b" " * (-(len(header) + 11) % 64) + b"\n"
    return b"\x93NUMPY\x02\x00" + len(header).to_bytes(4, "little") + header


def _checksummed(body: bytes) -> bytes:
    """meta.json's form: a SHA-256 line, then the JSON (so the damage is in what is parsed, not its checksum)."""
    return hashlib.sha256(body).hexdigest().encode() + b"\n" + body


class HintFile:
    """One hint: where it is in a home prepared by `setup`, the run that reads it, the note it gives."""

    def __init__(self, name, args, stdin, setup, where, note, wrap=lambda body: body, env=None):
        self.name, self.args, self.stdin, self.setup, self.where = name, args, stdin, setup, where
        self.note, self.wrap, self.env = note, wrap, env or _no_env  # env(home): a context giving the run's


@contextmanager
def _no_env(home):
    yield {}


@contextmanager
def _offline_hub(home):
    yield {"HF_HOME": str(home / "hf"), "HF_HUB_OFFLINE": "1"}


@contextmanager
def _serving_hub(home):
    with HubServer({REPO: {"llama-Q4_K_M.gguf": Path(TINY_LLAMA).read_bytes()}}) as server:
        yield {"HF_HOME": str(home / "hf"), "HF_ENDPOINT": server.url}


def _agents(home: Path) -> None:
    (home / "hf").mkdir()
    (home / "hf" / ".agent_harnesses.json").write_text('{"standardEnvVars": [], "harnesses": {}}')


def _sessions_of(home: Path) -> list[Path]:
    return list((home / "data" / "sessions").iterdir())


def _saved(home: Path, model: str = TINY_LLAMA) -> None:
    chat(home, ["--model", model, *GREEDY, "--max-tokens", "4", "--session", "s"], lines("Hello there")).ok()


def _resumed(home: Path) -> None:
    _saved(home)
    chat(home, ["--model", TINY_LLAMA, *GREEDY, "--max-tokens", "4", "--resume", "--session", "s"],
         lines("/sessions")).ok()


def _entry(home: Path) -> Path:
    [entry] = (home / "cache" / "weights").iterdir()
    return entry


def _hub_cached(home: Path) -> None:
    with HubServer({REPO: {"llama-Q4_K_M.gguf": Path(TINY_LLAMA).read_bytes()}}) as server:
        hub.model_file(f"hf:{REPO}", print, endpoint=server.url, cache_dir=home / "hf" / "hub")


HINTS = [
    HintFile("prefix-index", ["--model", TINY_LLAMA, *GREEDY, "--max-tokens", "4", "--session", "t"],
             lines("Hello there", "And again"), _saved,
             lambda home: next((home / "data" / "prefixes").iterdir()), "note: the prefix index {} cannot be used ("),
    HintFile("last-used", ["--model", TINY_LLAMA, *GREEDY, "--max-tokens", "4"], lines("/resume", "And again"),
             _resumed, lambda home: next((home / "data" / "last-used").iterdir()),
             "note: the last-used mark {} cannot be used ("),
    HintFile("meta-json", ["--model", TINY_LLAMA, *GREEDY, "--max-tokens", "4", "--no-save"], lines("Hello there"),
             _saved, lambda home: _entry(home) / "meta.json",
             "note: the dequantized-weights cache {.parent} was damaged (meta.json: ", _checksummed),
    HintFile("usage-npy", ["--model", MOE, *GREEDY, "--max-tokens", "4", "--no-save"], lines("Hello there"),
             lambda home: _saved(home, MOE), lambda home: _entry(home) / "usage.npy",
             "note: the experts' use counts {} cannot be used (", lambda body: _npy(body)),
    HintFile("hub-ref", ["--model", f"hf:{REPO}", *GREEDY, "--max-tokens", "4", "--no-save"], lines("Hello there"),
             _hub_cached, lambda home: next((home / "hf" / "hub").glob("models--*/refs/main")),
             "note: the Hugging Face cache's ref {} cannot be used (", env=_offline_hub),
    HintFile("hub-agents", ["--model", f"hf:{REPO}", *GREEDY, "--max-tokens", "4", "--no-save"], lines("Hello there"),
             _agents, lambda home: home / "hf" / ".agent_harnesses.json",
             "note: the Hugging Face cache's list of agent harnesses {} cannot be used (", env=_serving_hub),
]
REMOVED = {"hub-ref", "hub-agents"}  # (removed, and written again by the hub when it needs them)


def _replace(path: Path, make) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()
    make(path)


DAMAGES = {
    "fifo": lambda hint, path: _replace(path, os.mkfifo),
    "directory": lambda hint, path: _replace(path, lambda p: (p.mkdir(), (p / "x").write_text("x"))),
    "dev-zero": lambda hint, path: _replace(path, lambda p: p.symlink_to("/dev/zero")),
    "long-integer": lambda hint, path: _replace(path, lambda p: p.write_bytes(hint.wrap(DIGITS))),
    "deep-nesting": lambda hint, path: _replace(path, lambda p: p.write_bytes(hint.wrap(DEEP))),
    "no-permission": lambda hint, path: path.chmod(0),
}


@pytest.fixture(scope="module")
def prepared_homes(tmp_path_factory):
    """{hint name: a home where the hint exists, as a run left it} (made once; each case works on a copy)."""
    homes = {}
    for hint in HINTS:
        home = tmp_path_factory.mktemp(hint.name)
        hint.setup(home)
        assert hint.where(home).is_file()
        homes[hint.name] = home
    return homes


@pytest.mark.process
@pytest.mark.parametrize("damage", DAMAGES)
@pytest.mark.parametrize("hint", HINTS, ids=[h.name for h in HINTS])
def test_every_hint_file_survives_every_damage_and_says_so_once(hint, damage, prepared_homes, tmp_path):
    home = tmp_path / "home"
    shutil.copytree(prepared_homes[hint.name], home, symlinks=True)
    path = hint.where(home)
    prefix = unprivileged() if damage == "no-permission" else []
    DAMAGES[damage](hint, path)
    with hint.env(home) as env:
        run = chat(home, hint.args, hint.stdin, timeout=TIMEOUT, env_extra=env, prefix=prefix).ok()
    assert run.out and run.footers(), run.err
    assert run.err.count(hint.note.format(path)) == 1, run.err
    if damage != "directory" and hint.name not in REMOVED:  # replaced by a sound hint (a directory is left)
        assert read_hint(hint.where(home), lambda data: data).value, f"{path} not written again"
    if hint.name == "prefix-index":  # rebuilt: both conversations in it
        kept = hint.where(home)
        if damage != "directory":
            assert sorted(json.loads(kept.read_bytes())["sessions"]) == ["s", "t"]


# ---- the reader itself (in process) -------------------------------------------------------------------------


@contextmanager
def bounded(seconds: int = 30):
    """The block fails (TimeoutError) instead of hanging past `seconds`."""
    def stop(*_):
        raise TimeoutError(f"still reading after {seconds} s")

    old = signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def test_read_hint_refuses_what_is_not_a_small_regular_file_and_turns_any_parse_error_into_a_line(tmp_path):
    with bounded():
        _read_hint_cases(tmp_path)


def _read_hint_cases(tmp_path):
    path = tmp_path / "hint"
    assert read_hint(path, json.loads) == Hint(None, None)  # no file: no hint, no problem
    path.write_bytes(b'{"a": 1}')
    assert read_hint(path, json.loads) == Hint({"a": 1}, None)
    assert read_hint(path, json.loads, limit=7) == Hint(None, "larger than 7 bytes")
    for data, why in ((DIGITS, "Exceeds the limit (4300 digits)"), (DEEP, "nested too deep"),
                      (b"\xff", "not UTF-8"), (b"[1]", "not in the expected shape")):
        path.write_bytes(data)
        value, problem = read_hint(path, lambda b: json.loads(b.decode())["key"])
        assert value is None and why in problem
    path.unlink()
    os.mkfifo(path)  # opened without blocking: refused before a byte is read
    assert read_hint(path, json.loads) == Hint(None, "a FIFO, not a file")
    path.unlink()
    path.symlink_to("/dev/zero")
    assert read_hint(path, json.loads) == Hint(None, "a link")
    assert stat.S_ISCHR(os.stat("/dev/zero").st_mode)
    path.unlink()
    path.mkdir()
    assert read_hint(path, json.loads) == Hint(None, "a directory, not a file")
    said = []
    once = Said(said.append)
    for _ in range(3):
        once(path, "line")
    assert said == ["line"]


def test_a_usage_file_of_a_huge_shape_is_refused_without_allocating(tmp_path):
    from colichat.engine.gguf.prepared import USAGE, read_usage

    (tmp_path / USAGE).write_bytes(_npy(b"1" + b"0" * 15))  # 10^15 counts announced
    notes = []
    assert read_usage(tmp_path, notes.append) is None
    assert len(notes) == 1 and notes[0].startswith(f"the experts' use counts {tmp_path / USAGE} cannot be used (")
    np.save(tmp_path / USAGE, np.ones(3, dtype=np.float32))
    assert read_usage(tmp_path, notes.append).tolist() == [1, 1, 1] and len(notes) == 1


# ---- files read beside the hints: a rename's mark, the input history ---------------------------------------


@pytest.mark.process
def test_a_rename_mark_that_is_a_fifo_is_not_waited_on(prepared_homes, tmp_path):
    """NAME.renaming (what an interrupted /rename leaves) is read as hints are: a FIFO there is passed by."""
    home = tmp_path / "home"
    shutil.copytree(prepared_homes["prefix-index"], home, symlinks=True)
    [model_dir] = _sessions_of(home)
    os.mkfifo(model_dir / "t.renaming")
    run = chat(home, ["--model", TINY_LLAMA, *GREEDY, "--max-tokens", "4", "--session", "t"], lines("Hello there"),
               timeout=TIMEOUT).ok()
    assert run.footers()[0].endswith("saved to t]")


@pytest.mark.process
@pytest.mark.parametrize("no_save", [False, True], ids=["saving", "no-save"])
def test_an_input_history_that_is_not_a_regular_file_is_kept_in_memory(no_save, tmp_path):
    import subprocess
    import sys

    (tmp_path / "state").mkdir()
    for make in (os.mkfifo, lambda p: p.symlink_to("/dev/zero")):
        history = tmp_path / "state" / "history"
        make(history)
        code = ("from colichat.terminal.repl import input_history; "
                f"print(type(input_history(no_save={no_save})).__name__)")
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT,
                           env={**os.environ, "COLICHAT_HOME": str(tmp_path)})
        assert p.stdout == "InMemoryHistory\n", p.stderr
        history.unlink()
