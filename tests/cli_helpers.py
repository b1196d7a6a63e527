"""Drive colichat the way scripts (and the tests) do: a subprocess in pipe mode, stdout and stderr apart.

    r = chat(home, ["--model", TINY_LLAMA, *GREEDY], "hello\\n/history\\n")
    r.rc, r.out (bytes: only the answers), r.err (str: everything else)
    chat_here(home, args, stdin)   the same run in this process (the fast tier: no process start, the
                                   imports shared); for what a process changes (signals, locks between two
                                   colichats, closed descriptors, permissions), `chat`
    r.ok() / r.failed()            assert the exit code, no traceback; return r
    saved_turns(home, name)        [(role, text), ...] from the session's sidecar
    answers_bytes(texts)           what stdout must hold for these answers
    unprivileged(), read_only(dir) command prefixes: file permissions apply; dir mounted read-only
    copy_gguf(src, dst, ...)       a GGUF rewritten with a key or tensor dropped, or another architecture
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import re
import select
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from conftest import TINY

TINY_LLAMA = str(TINY / "llama.gguf")
CHAT = [sys.executable, "-m", "colichat.terminal.cli"]
GREEDY = ["--temperature", "0", "--repeat-penalty", "1"]  # llama.cpp's greedy decoding (no penalty)
TINY_ARGS = ["--model", TINY_LLAMA, *GREEDY, "--max-tokens", "8"]
RESUMED_RE = re.compile(r"^resumed (\d+) tokens?, (\d+) turns? from (\S+) in \d+ ms, no re-prefill$", re.M)
FOOTER_RE = re.compile(r"^\[\d+ tokens?, .*?(\d+) of (\d+) context left.*; "
                       r"(saved to \S+|NOT saved: .*|not saved \(.*\))\]$", re.M)


@dataclass
class Run:
    rc: int
    out: bytes
    err: str

    def ok(self) -> Run:
        return self.exits(0)

    def failed(self) -> Run:
        return self.exits(1)

    def exits(self, rc: int) -> Run:
        assert "Traceback" not in self.err, self.err
        assert self.rc == rc, f"exit {self.rc}, expected {rc}; stderr:\n{self.err}"
        return self

    def errors(self) -> list[str]:
        """The error lines (`colichat: ...`) on stderr."""
        return [line for line in self.err.splitlines() if line.startswith("colichat: ")]

    def footers(self) -> list[str]:
        return [m.group(0) for m in FOOTER_RE.finditer(self.err)]

    def contexts(self) -> list[tuple[int, int]]:
        """(tokens used, context size) as each footer says them (it says what is left of the context)."""
        return [(int(m.group(2)) - int(m.group(1)), int(m.group(2))) for m in FOOTER_RE.finditer(self.err)]

    def resumed(self) -> tuple[int, int, str]:
        """(tokens, turns, name) of the resume line; fails if there is none."""
        m = RESUMED_RE.search(self.err)
        assert m, f"no resume line in stderr:\n{self.err}"
        return int(m.group(1)), int(m.group(2)), m.group(3)


def env_for(home, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONIOENCODING"}
    env.update({"COLICHAT_HOME": str(home), **extra})
    return env


def chat(home, args, stdin: str | bytes = "", timeout: float = 300, env_extra=None, prefix=(), **popen) -> Run:
    """Run colichat with `args` (after the command `prefix`, e.g. `unprivileged()`), feed `stdin`, wait."""
    data = stdin.encode() if isinstance(stdin, str) else stdin
    p = subprocess.run([*prefix, *CHAT, *map(str, args)], input=data, capture_output=True, timeout=timeout,
                       env=env_for(home, **(env_extra or {})), cwd=str(home), **popen)
    return Run(p.returncode, p.stdout, p.stderr.decode("utf-8", "replace"))


def chat_here(home, args, stdin: str | bytes = "", env_extra=None) -> Run:
    """`chat`'s run without a process: colichat.terminal.cli.main(args) with the standard streams on temporary
    files (real descriptors, made as CPython makes them for a pipe: UTF-8 after set_encodings, no newline
    translation), COLICHAT_HOME `home` and the working directory `home`; all three are put back after.
    Exit codes as the process's: main's status, or SystemExit's (argparse: 2, --help and --version: 0).
    What a process would hide is checked: the run leaves no file descriptor open."""
    from colichat.terminal.cli import main

    data = stdin.encode() if isinstance(stdin, str) else stdin
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    saved_streams = sys.stdin, sys.stdout, sys.stderr
    descriptors = sorted(os.listdir("/proc/self/fd"))
    with contextlib.ExitStack() as stack:
        i, o, e = (stack.enter_context(tempfile.TemporaryFile()) for _ in range(3))
        i.write(data)
        i.seek(0)
        try:
            sys.stdin = open(i.fileno(), "r", encoding="utf-8", newline="\n", closefd=False)
            sys.stdout = open(o.fileno(), "w", encoding="utf-8", newline="\n", closefd=False)
            sys.stderr = open(e.fileno(), "w", buffering=1, encoding="utf-8", errors="backslashreplace",
                              newline="\n", closefd=False)
            os.environ.clear()
            os.environ.update(env_for(home, **(env_extra or {})))
            os.chdir(home)
            rc = main([str(a) for a in args])
        except SystemExit as stop:
            rc = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
        finally:
            for stream in (sys.stdin, sys.stdout, sys.stderr):
                if stream not in saved_streams:
                    with contextlib.suppress(OSError, ValueError):
                        stream.close()  # flushes what is left
            sys.stdin, sys.stdout, sys.stderr = saved_streams
            os.environ.clear()
            os.environ.update(saved_env)
            os.chdir(saved_cwd)
        o.seek(0)
        e.seek(0)
        run = Run(rc, o.read(), e.read().decode("utf-8", "replace"))
    gc.collect()  # the model's maps of its file, in reference cycles, go with the cycles
    left = [f"{fd} -> {os.readlink(f'/proc/self/fd/{fd}')}" for fd in sorted(os.listdir("/proc/self/fd"))
            if fd not in descriptors and os.path.exists(f"/proc/self/fd/{fd}")]
    assert not left, f"colichat left descriptors open: {left}"
    return run


NAMESPACES = ("needs user namespaces (util-linux `unshare`; allowed by the kernel, e.g. "
              "sysctl kernel.unprivileged_userns_clone=1, and by the container)")


def _usable(prefix: list[str], what: str) -> list[str]:
    """`prefix` if a command runs under it here; else the test is skipped, saying what it does, what
    is missing and what it needs."""
    import pytest

    try:
        p = subprocess.run([*prefix, "true"], capture_output=True, text=True, timeout=60)
    except OSError as e:
        pytest.skip(f"{what} {NAMESPACES}; {prefix[0]} cannot run here ({e})")
    if p.returncode != 0:
        pytest.skip(f"{what} {NAMESPACES}; `{' '.join(prefix)}` failed here: {p.stderr.strip()}")
    return prefix


def unprivileged() -> list[str]:
    """A command prefix under which file permissions apply: as root, a user namespace in which the
    process is uid 1000 (execve drops its capabilities), so a mode-000 directory is refused."""
    if os.geteuid() != 0:
        return []
    return _usable(["unshare", "--user", "--map-user=1000", "--map-group=1000"],
                   "running colichat as a user that file permissions apply to (the tests run as root)")


def read_only(directory) -> list[str]:
    """A command prefix that runs the command with `directory` remounted read-only (a private mount
    namespace: nothing outside sees it)."""
    script = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec "$@"'
    return _usable(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script, str(directory)],
                   "running colichat on a read-only file system")


def start(home, args, **popen) -> subprocess.Popen:
    """colichat running in the background with stdin, stdout and stderr piped."""
    return subprocess.Popen([*CHAT, *map(str, args)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env_for(home), cwd=str(home), **popen)


def read_until(stream, needle: bytes = b"", timeout: float = 120) -> bytes:
    """Read a pipe until `needle` appears (the empty needle: any data) or it ends; fails after `timeout` s."""
    fd, got = stream.fileno(), b""
    deadline = time.monotonic() + timeout
    while not got or needle not in got:
        left = deadline - time.monotonic()
        assert left > 0, f"timed out waiting for {needle!r}; got {got[-2000:]!r}"
        if select.select([fd], [], [], left)[0]:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            got += chunk
    return got


def finish(p: subprocess.Popen, head_out: bytes = b"", head_err: bytes = b"", timeout: float = 300) -> Run:
    out, err = p.communicate(timeout=timeout)
    return Run(p.returncode, head_out + out, (head_err + err).decode("utf-8", "replace"))


def session_files(home) -> list[Path]:
    return sorted(p for p in (Path(home) / "data" / "sessions").glob("*/*") if p.is_file())


def saved_turns(home, name: str) -> list[tuple[str, str]]:
    """The (role, text) turns of session NAME, read from its sidecar (one model per home in these tests)."""
    found = list((Path(home) / "data" / "sessions").glob(f"*/{name}.json"))
    assert len(found) == 1, f"session {name}: {found}"
    return [(t["role"], t["text"]) for t in json.loads(found[0].read_text("utf-8"))["turns"]]


def saved_answers(home, name: str) -> list[str]:
    return [text for role, text in saved_turns(home, name) if role == "assistant"]


def saved_users(home, name: str) -> list[str]:
    return [text for role, text in saved_turns(home, name) if role == "user"]


def session_names(run: Run) -> list[str]:
    """The sessions the footers say the answers were saved to, in order."""
    return [m.group(1) for m in re.finditer(r"; saved to (\S+)\]$", run.err, re.M)]


def answers_bytes(texts) -> bytes:
    """Stdout of a run that gave these answers: each answer's text, then a newline."""
    return b"".join(t.encode("utf-8") + b"\n" for t in texts)


def lines(*inputs: str) -> str:
    return "".join(i + "\n" for i in inputs)


def copy_gguf(src, dst, drop_keys=(), drop_tensors=(), arch: str | None = None, scale: dict | None = None,
              set_keys: dict | None = None) -> str:
    """Rewrite GGUF `src` as `dst` without some keys or tensors, with another general.architecture,
    with some tensors multiplied by a factor (`scale={name: factor}`: the same model, other weights),
    or with other values for some of its keys (`set_keys={key: value}`, of the key's type; a key it lacks
    is added as a float32, an int32 or a string, after the value's type)."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(src))
    writer = gguf.GGUFWriter(str(dst), arch or str(reader.fields["general.architecture"].contents()))
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in drop_keys:
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, (set_keys or {}).get(key, f.contents()), vtype, sub)
    for key, value in (set_keys or {}).items():  # a key it lacks: a float32, an int32 or a string
        if key not in reader.fields:
            {float: writer.add_float32, int: writer.add_int32}.get(type(value), writer.add_string)(key, value)
    for t in reader.tensors:
        if t.name in drop_tensors:
            continue
        assert t.tensor_type == gguf.GGMLQuantizationType.F32, "copy_gguf handles F32 files only"
        data = np.array(t.data, dtype=np.float32) * np.float32((scale or {}).get(t.name, 1.0))
        writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(dst)
