"""ChatError: something the user asked of the conversation that cannot be done (the message is one line).

The other user errors live beside what raises them (engine.ModelError, persist.SessionError,
settings.SettingError, models.DefaultModelMissing); the CLI and the REPL print any of them as one
line `colichat: MESSAGE`.
"""

from __future__ import annotations


class ChatError(Exception):
    """Something the user asked that cannot be done; the message is one line."""
