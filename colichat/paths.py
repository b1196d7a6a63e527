"""Where colichat keeps things: sessions (data), input history (state), re-creatable caches (cache).

COLICHAT_HOME, when set, holds all three as data/, state/ and cache/ (tests use it); otherwise the
XDG directories from platformdirs (~/.local/share/colichat, ~/.local/state/colichat, ~/.cache/colichat).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Paths:
    data: Path  # sessions (what a user keeps)
    state: Path  # history
    cache: Path  # dequantized weights and other re-creatable files


def paths() -> Paths:
    home = os.environ.get("COLICHAT_HOME")
    if home:
        h = Path(home).expanduser()
        return Paths(h / "data", h / "state", h / "cache")
    import platformdirs

    return Paths(Path(platformdirs.user_data_dir("colichat")), Path(platformdirs.user_state_dir("colichat")),
                 Path(platformdirs.user_cache_dir("colichat")))
