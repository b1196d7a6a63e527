"""The `colichat` command: says "starting" on a terminal at once, then imports the program.

Importing numpy, jinja2 and the engine takes about half a second (seconds on a busy machine);
the line is cleared before the program prints anything.
"""

from __future__ import annotations

import sys

STARTING = "starting colichat ..."


def main() -> int:
    shown = sys.stderr is not None and sys.stderr.isatty()  # None: closed by the caller (cli opens it)
    if shown:
        sys.stderr.write(STARTING)
        sys.stderr.flush()
    from .cli import main as run  # first: cli takes a Ctrl-C during the imports quietly
    from .streams import dumb_terminal

    if shown:  # a dumb terminal takes no escape sequences: spaces over the line
        sys.stderr.write("\r" + " " * len(STARTING) + "\r" if dumb_terminal() else "\r\033[K")
        sys.stderr.flush()
    return run()


if __name__ == "__main__":
    sys.exit(main())
