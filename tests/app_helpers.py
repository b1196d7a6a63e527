"""The in-process harness of the commands: an App whose status lines are kept for the test, and `run`,
which hands it one typed line and returns what it said."""

from __future__ import annotations

from colichat.cli import App


class Recorder(App):
    """An App whose status lines are kept for the test and whose answers are dropped."""

    def __init__(self, conv):
        super().__init__(conv, interactive=False)
        self.lines: list[str] = []

    def say(self, line: str, hang: int = 0) -> None:
        self.lines.append(line)

    def out(self, text: str) -> None:
        pass


def run(app: Recorder, line: str) -> list[str]:
    """What `app` says for one typed line (a command or a message)."""
    app.lines.clear()
    app.handle(line)
    return list(app.lines)
