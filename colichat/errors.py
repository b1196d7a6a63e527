"""The user errors: what the user asked, gave or has on disk cannot be used. Each carries a message of
one line (what is wrong, what to do) and is raised `from None`; the CLI and the REPL print it as
`colichat: MESSAGE`, never a traceback. Any other exception (a plain ValueError, an assert) is a
bug of colichat and shows its traceback.

    ChatError            something asked of the conversation or the command line that cannot be done
      UsageError         a command line no run could carry out (a bad option value, options that
                         contradict each other): exit 2, as argparse's own errors (cli.py)
    SettingError         a value a setting or an option cannot take (settings.py)
    ModelError           a model file that is missing, damaged or not supported (engine/gguf.py)
      ContextError       a context size it cannot run with (too small or large, no room for --system)
    SessionError         a saved conversation that cannot be opened, loaded or saved (persist/kvfile.py)
    DefaultModelMissing  no --model and the default model is not downloaded (models.py)
"""

from __future__ import annotations

from .engine import ModelError
from .models import DefaultModelMissing
from .persist import SessionError
from .settings import SettingError


class ChatError(Exception):
    """Something the user asked that cannot be done; the message is one line."""


class UsageError(ChatError):
    """A command line no run could carry out, known before anything is read: exit status 2."""


USER_ERRORS = (ChatError, SettingError, ModelError, SessionError, DefaultModelMissing)  # each shown as one line
