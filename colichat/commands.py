"""The slash commands: one table drives /help, Tab completion and dispatch.

A handler gets the App (see cli.py: `.conv` the Conversation, `.say(line)` status to stderr,
`.out(text)` the model's text to stdout) and the rest of the line as one string.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Callable

from .chat import ChatError

SETTABLE = {
    # key: (type, what it means)
    "temperature": (float, "0 = greedy; higher = more random"),
    "top_k": (int, "keep the k most likely tokens (0 = off)"),
    "top_p": (float, "keep the smallest set with this total probability (1 = off)"),
    "min_p": (float, "drop tokens below this fraction of the best one (0 = off)"),
    "repeat_penalty": (float, "penalize recently used tokens (1 = off)"),
    "seed": (int, "random seed (same seed, same answers)"),
    "max_tokens": (int, "the longest answer, in tokens"),
    "system": (str, "the system prompt (applies to new conversations: /reset)"),
    "draft": (int, "speculative decoding: tokens guessed from the conversation per step (0 = off)"),
}


@dataclass(frozen=True)
class Command:
    name: str
    args: str
    summary: str
    run: Callable


def _int_arg(arg: str, default: int, what: str) -> int:
    if not arg.strip():
        return default
    try:
        return int(arg)
    except ValueError:
        raise ChatError(f"{what} takes a whole number, not '{arg.strip()}'") from None


def cmd_help(app, arg: str) -> None:
    name = arg.strip().lstrip("/")
    if name:
        cmd = BY_NAME.get("/" + name)
        if cmd is None:
            raise ChatError(f"unknown command '/{name}': /help lists them")
        app.say(f"/{name} {cmd.args}".rstrip() + f"  {cmd.summary}")
        if cmd.name == "/set":
            for key, (_, meaning) in SETTABLE.items():
                app.say(f"  {key:<15}{meaning}")
        return
    for cmd in COMMANDS:
        app.say(f"{(cmd.name + ' ' + cmd.args).strip():<20}{cmd.summary}")
    app.say('Multi-line input: Esc then Enter for a newline, or a block between """ lines.')


def cmd_resume(app, arg: str) -> None:
    app.say(app.conv.resume(arg.strip() or None))


def cmd_sessions(app, arg: str) -> None:
    rows = app.conv.list_sessions()
    if not rows:
        app.say("no saved sessions for this model")
        return
    for line in rows:
        app.say(line)


def cmd_delete(app, arg: str) -> None:
    name = arg.strip()
    if not name:
        raise ChatError("/delete needs the name of a session (/sessions lists them)")
    app.say(app.conv.delete_session(name))


def cmd_reset(app, arg: str) -> None:
    app.say(app.conv.reset())


def cmd_rewind(app, arg: str) -> None:
    n = _int_arg(arg, 1, "/rewind")
    dropped = app.conv.rewind(n)
    for t in dropped:
        preview = t.text.strip().replace("\n", " ")
        app.say(f"removed {t.role}: {preview[:70] + ('...' if len(preview) > 70 else '')}")
    app.say(f"rewound {n} exchange(s); {app.conv.n_tokens} tokens in context")


def cmd_regen(app, arg: str) -> None:
    users = [t for t in app.conv.turns if t.role == "user"]
    if not users:
        raise ChatError("nothing to regenerate: the conversation is empty")
    app.conv.rewind(1)
    app.answer(users[-1].text)


def cmd_history(app, arg: str) -> None:
    if not app.conv.turns:
        app.say("the conversation is empty")
    for t in app.conv.turns:
        app.say(f"{t.role}> {t.text}")


def cmd_set(app, arg: str) -> None:
    key, _, value = arg.strip().partition(" ")
    key, value = key.strip().lower().replace("-", "_"), value.strip()
    if key not in SETTABLE:
        raise ChatError(f"cannot set '{key}': one of {', '.join(SETTABLE)}")
    kind = SETTABLE[key][0]
    if not value and kind is not str:
        raise ChatError(f"/set {key} needs a value")
    try:
        parsed = kind(value) if kind is not str else (shlex.split(value)[0] if value[:1] in "'\"" else value)
    except ValueError:
        raise ChatError(f"{key} takes a {'whole number' if kind is int else 'number'}, not '{value}'") from None
    app.say(app.conv.set_option(key, parsed))


def cmd_show(app, arg: str) -> None:
    for key, value in app.conv.options().items():
        app.say(f"{key:<15}{value!r}" if isinstance(value, str) else f"{key:<15}{value}")


def cmd_stats(app, arg: str) -> None:
    for line in app.conv.stats_lines():
        app.say(line)


def cmd_quit(app, arg: str) -> None:
    app.quit()


COMMANDS = [
    Command("/help", "[CMD]", "list the commands, or explain one", cmd_help),
    Command("/resume", "[NAME]", "reopen a saved conversation (the latest by default), no re-prefill", cmd_resume),
    Command("/sessions", "", "list saved conversations of this model", cmd_sessions),
    Command("/reset", "", "start a new empty conversation (the current one stays saved)", cmd_reset),
    Command("/delete", "NAME", "delete a saved conversation of this model (not the current one)", cmd_delete),
    Command("/rewind", "[N]", "drop the last N exchanges (default 1)", cmd_rewind),
    Command("/regen", "", "drop the last answer and answer the last message again", cmd_regen),
    Command("/history", "", "show the conversation so far", cmd_history),
    Command("/set", "KEY VALUE", "change a setting (/help set lists them)", cmd_set),
    Command("/show", "", "show the settings", cmd_show),
    Command("/stats", "", "context used, bytes on disk, last speeds", cmd_stats),
    Command("/quit", "", "save and exit (Ctrl-D works too)", cmd_quit),
]
BY_NAME = {c.name: c for c in COMMANDS}


class Message(str):
    """An input from a `\"\"\"` block: a message even if it starts with `/`."""


def is_command(line: str) -> bool:
    return line.startswith("/") and not isinstance(line, Message)


def dispatch(app, line: str) -> None:
    """Run one command line; ChatError carries the one-line message for a bad one."""
    name, _, arg = line.strip().partition(" ")
    cmd = BY_NAME.get(name.lower())
    if cmd is None:
        raise ChatError(f"unknown command '{name}': /help lists the commands")
    cmd.run(app, arg)


def completions(text: str) -> list[str]:
    """Command names that start with what was typed (for Tab), or settable keys after /set."""
    if text.startswith("/set ") and " " not in text[5:]:
        return ["/set " + k for k in SETTABLE if k.startswith(text[5:])]
    return [c.name for c in COMMANDS if c.name.startswith(text.lower())]
