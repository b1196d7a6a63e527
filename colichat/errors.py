"""The user errors: what the user asked, gave or has on disk cannot be used. Each carries a message of
one line (what is wrong, what to do) and is raised `from None`; the CLI and the REPL print it as
`colichat: MESSAGE`, never a traceback. Any other exception (a plain ValueError, an assert) is a
bug of colichat and shows its traceback.

A leaf: every layer (the engine, persist/, the settings, the chat) raises these, so this module
imports nothing from colichat. The layers add their own kinds (TemplateError, SessionBusy, ...).

    ChatError            something asked of the conversation or the command line that cannot be done
      UsageError         a command line no run could carry out (a bad option value, options that
                         contradict each other): exit 2, as argparse's own errors (terminal/cli.py)
    SettingError         a value a setting or an option cannot take (settings.py)
    ModelError           a model file that is missing, damaged or not supported (engine/)
      ContextError       a context size it cannot run with (too small or large, no room for --system)
    SessionError         a saved conversation that cannot be opened, loaded or saved (persist/)
    DefaultModelMissing  no --model and the default model is not downloaded (models/default.py)
"""

from __future__ import annotations


class ChatError(Exception):
    """Something the user asked that cannot be done; the message is one line."""


class UsageError(ChatError):
    """A command line no run could carry out, known before anything is read: exit status 2."""


class SettingError(Exception):
    """A value a setting cannot take; the message is one line naming the setting."""


class ModelError(Exception):
    """A model file colichat cannot use. The message is one line meant for the user."""


class ContextError(ModelError):
    """A context size the model cannot run with: too small, longer than it was trained for, more than
    memory holds, or without room for the system prompt and a message."""


class SessionError(Exception):
    """A session colichat cannot open, load or save. The message is one line meant for the user."""


class DefaultModelMissing(Exception):
    """No --model, and the default model is not installed (or not the file it should be)."""


USER_ERRORS = (ChatError, SettingError, ModelError, SessionError, DefaultModelMissing)  # each shown as one line
