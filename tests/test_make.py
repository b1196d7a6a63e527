"""What `make chat` and `make test` install into a fresh .venv (a dry run of make: nothing is built)."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from conftest import REPO

pytestmark = pytest.mark.process  # every test here starts a process or a terminal


def dry_run(tmp_path, target: str) -> list[str]:
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(REPO / name, tmp_path / name)
    out = subprocess.run(["make", "-n", target], cwd=tmp_path, capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if "pip install" in line]


def test_make_chat_installs_only_what_chatting_needs(tmp_path):
    installs = dry_run(tmp_path, "chat")
    assert any(line.endswith("pip install -q -e .") for line in installs), installs
    assert not any("[test]" in line or "pytest" in line or "ruff" in line for line in installs), installs


def test_make_test_adds_the_test_tools(tmp_path):
    installs = dry_run(tmp_path, "test")
    assert any(line.endswith("pip install -q -e '.[test]'") for line in installs), installs
