"""colichat with an injected slow layer (a big model's pace on a tiny file), for process tests:

    python tests/slow_layers.py SECONDS LOG -- COLICHAT ARGS...

runs colichat's main() with every layer of the llama architecture writing its number to LOG (a line,
flushed) and then sleeping SECONDS before it computes. What a test counts is the layers begun after
a key, never a time.
"""

from __future__ import annotations

import sys
import time

from colichat.engine.architectures import llama
from colichat.terminal.cli import main


def slowed(seconds: float, log: str) -> None:
    layer = llama.Forward.layer

    def slow(self, l, *args, **kwargs):
        with open(log, "a", encoding="utf-8") as f:
            f.write(f"{l}\n")
        time.sleep(seconds)
        return layer(self, l, *args, **kwargs)

    llama.Forward.layer = slow


if __name__ == "__main__":
    seconds, log, rest = float(sys.argv[1]), sys.argv[2], sys.argv[3:]
    slowed(seconds, log)
    sys.exit(main(rest[1:] if rest[:1] == ["--"] else rest))
