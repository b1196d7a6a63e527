"""The slash commands: one table drives /help, Tab completion and dispatch.

A handler gets the App (see app.py: `.conv` the Conversation, whose verbs the commands call, with
`.conv.transcript` its turns, `.conv.prefs` its settings and `.conv.shelf` this model's saved
conversations; `.say(line)` status to stderr, `.out(text)` the model's text to stdout) and the rest
of the line as one string. A bad command raises a typed error (errors.py): one line.
"""

from __future__ import annotations

import contextlib
import difflib
import os
from dataclasses import dataclass
from typing import Callable

from ..conversation import report
from ..conversation.saved import markdown
from ..conversation.settings import BY_NAME as SETTINGS
from ..conversation.settings import TABLE, key_of, printable, unquoted
from ..conversation.shelf import CURRENT_MARK
from ..errors import ChatError
from ..models.default import model_title
from ..paths import expand_home
from ..units import count
from ..wrap import displayable, wrap_line
from .inputs import Message


@dataclass(frozen=True)
class Command:
    name: str
    args: str
    summary: str
    run: Callable
    aliases: tuple[str, ...] = ()  # other names it answers to (habits from other chat programs)
    instead: str = ""  # for a command that takes no argument: what to type for what an argument may have meant
    more: str = ""  # where /help CMD says more (shown in the /help list only: not as a pointer to itself)

    @property
    def title(self) -> str:
        """'/new (/clear, /reset)' for the help."""
        return self.name + (f" ({', '.join(self.aliases)})" if self.aliases else "")


def _int_arg(arg: str, default: int, what: str) -> int:
    if not arg.strip():
        return default
    try:
        return int(arg)
    except ValueError:
        raise ChatError(f"{what} takes a whole number, not '{printable(arg.strip())}'") from None


def cmd_help(app, arg: str) -> None:
    name = arg.strip().lstrip("/")
    if name:
        cmd = find_command("/" + name)
        app.say(f"{cmd.title} {cmd.args}".rstrip() + f"  {cmd.summary}", hang=4)
        if cmd.name == "/set":
            for row in TABLE:
                app.say(f"  {row.name:<15}{row.help}", hang=17)
        return
    for cmd in COMMANDS:
        app.say(f"{(cmd.name + ' ' + cmd.args).strip():<20}{listed(cmd)}", hang=20)
    app.say('Multi-line input: Esc then Enter for a newline, or a block between """ lines. Several lines that are '
            "all commands (typed while colichat was busy, say) run one by one, in order; any other text of "
            "several lines is one message.")
    app.say("A message that starts with / is typed with // (it is sent with one /).")


def listed(cmd: Command) -> str:
    """A command's summary in the /help list, with what the list adds (where to read more, its other
    names) in the same parentheses as the summary's own, if it ends with some: one group, not two."""
    notes = [note for note in (cmd.more, cmd.aliases and "also " + ", ".join(cmd.aliases)) if note]
    if not notes:
        return cmd.summary
    if cmd.summary.endswith(")"):
        return f"{cmd.summary[:-1]}; {'; '.join(notes)})"
    return f"{cmd.summary} ({'; '.join(notes)})"


def cmd_resume(app, arg: str) -> None:
    """Reopen saved conversation ARG (the latest without one); on the terminal, show where it stands
    (its last exchange)."""
    conv = app.conv
    said = conv.resume(arg.strip() or None, on_progress=app.prefill_progress("its saved text"), on_note=app.say,
                       cancel=app.cancel)
    if said:
        app.say(said)
    app.warm_note = True
    for line in report.recap(conv.transcript.turns, conv, app.dim) if app.interactive else ():
        app.say(line)


def cmd_sessions(app, arg: str) -> None:
    """This model's conversations, newest first; on a terminal, the newest that fit in the window with
    the command and the next prompt (the others would push the newest out of view), the current one
    (marked *) below them where it is older, then a line saying how many older ones are not shown,
    and where they all are."""
    rows = app.conv.shelf.listing(app.conv.name)
    if not rows:
        app.say("no saved sessions for this model")
        return
    window = app.window()
    current = next((k for k, row in enumerate(rows) if row.startswith(CURRENT_MARK)), None)
    shown = newest_that_fit(rows, *window, keep=current) if window else len(rows)
    listed = rows[:shown] + ([rows[current]] if current is not None and current >= shown else [])
    for line in listed:
        app.say(line, hang=4)
    if len(listed) < len(rows):
        app.say(older_line(len(rows) - len(listed)))
    elif not window or len(rows) + 3 <= window[1]:  # (room for it below the rows, the command's and the prompt's)
        app.say(app.conv.shelf.total())


def older_line(hidden: int) -> str:
    return (f"... and {count(hidden, 'older conversation')} (colichat --sessions lists them all; "
            "Tab after /resume completes their names)")


def newest_that_fit(rows: list[str], columns: int, height: int, keep: int | None = None) -> int:
    """How many of the listing's `rows` (newest first) to show in a window `height` rows tall and
    `columns` wide: all if they fit, with the command's row and the next prompt's; else as many as fit
    with those and the line on the others (older_line), at least one. `keep`: the row of the current
    conversation, shown below them when it is not among them (room is kept for it; then the newest
    may be none, in a window too small for more)."""
    tall = [wrap_line(row, columns, hang=4).count("\n") + 1 for row in rows]
    room = height - 2  # the row of the command typed, the next prompt's
    if sum(tall) <= room:
        return len(rows)
    room -= wrap_line(older_line(len(rows)), columns).count("\n") + 1
    shown = _rows_in(tall, room)
    if keep is not None and keep >= shown:  # the current conversation's row goes below the newest
        return _rows_in(tall, room - tall[keep])
    return max(1, shown)


def _rows_in(tall: list[int], room: int) -> int:
    """How many of the first rows, `tall` screen rows each, fit in `room` screen rows."""
    shown = 0
    while shown < len(tall) and room >= tall[shown]:
        room -= tall[shown]
        shown += 1
    return shown


def cmd_delete(app, arg: str) -> None:
    name = arg.strip()
    if not name:
        raise ChatError("/delete needs the name of a session (/sessions lists them)")
    app.say(app.conv.shelf.delete(name, app.conv.name))


def cmd_rename(app, arg: str) -> None:
    new = arg.strip()
    if not new:
        raise ChatError("/rename needs the new name of this conversation")
    app.say(app.conv.rename(new))


def cmd_save(app, arg: str) -> None:
    if not arg.strip():
        raise ChatError("/save needs a name for the copy (/rename renames this conversation)")
    app.say(app.conv.save_as(arg.strip()))


def export_path(arg: str, title: str) -> tuple[str, bool]:
    """Where /export writes: FILE as typed (one pair of enclosing quotes removed, as /set does; `~`
    expanded), or TITLE.md in FILE when it is a directory, or here by default; and whether colichat
    chose the file's name (then TITLE-2.md, TITLE-3.md, ... follow when it is taken)."""
    raw = arg.strip()
    given = unquoted(raw)
    if raw[:1] in ("'", '"') and (given == raw or raw[0] in given):
        raise ChatError("/export takes one file name: put a name with spaces in one pair of quotes "
                        '(/export "my notes.md")')
    if given == "-":  # stdout carries only the answers (pipe mode): a Markdown copy there would mix in
        raise ChatError("/export writes a file, not standard output: /export FILE "
                        "(colichat --export NAME prints a saved conversation)")
    path = expand_home(given or f"{title}.md", ChatError)
    if given and os.path.isdir(path):
        return os.path.join(path, f"{title}.md"), True
    if given.endswith(("/", os.sep)):
        raise ChatError(f"there is no directory {printable(given)}: make it first, or give /export a file name")
    return path, not given


def write_export(path: str, text: str, chosen: bool) -> str:
    """Write `text` to a new file (0600, as everything colichat writes: it holds the conversation) at
    `path`, never over an existing one; where colichat chose the name, the next free NAME-2.md etc."""
    stem, ext = os.path.splitext(path)
    for k in range(1, 1000 if chosen else 2):
        candidate = path if k == 1 else f"{stem}-{k}{ext}"
        try:
            fd = os.open(candidate, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            continue
        except ValueError:  # a NUL in the name
            raise ChatError(f"cannot write '{printable(path)}': not a file name") from None
        except OSError as e:
            raise ChatError(f"cannot write {printable(path)}: {e.strerror or type(e).__name__}") from None
        try:
            os.fchmod(fd, 0o600)
            with open(fd, "w", encoding="utf-8", errors="surrogateescape") as f:
                f.write(text)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(candidate)
            raise ChatError(f"cannot write {printable(candidate)}: {e.strerror or type(e).__name__}") from None
        return candidate
    raise ChatError(f"{printable(path)} already exists: give /export another file name")


def cmd_export(app, arg: str) -> None:
    """/export [FILE]: the conversation as Markdown, in FILE (default NAME.md here); never overwrites."""
    conv = app.conv
    turns = conv.transcript.turns
    if not turns:
        raise ChatError("nothing to export yet: the conversation is empty")
    title = conv.name or "conversation"
    path, chosen = export_path(arg, title)
    model = model_title(conv.model.cfg.name, conv.model.cfg.path)  # as the banner names it
    text = markdown(title, model, [(t.role, t.text) for t in turns], conv.prefs.settings.system,
                    conv.prefs.opens_thinking)
    path = write_export(path, text, chosen)
    app.say(f"exported {count(len(turns), 'turn')} to {printable(path, 200)}")


def cmd_new(app, arg: str) -> None:
    app.say(app.conv.new())


def cmd_reset(app, arg: str) -> None:
    app.say(app.conv.reset())


def cmd_rewind(app, arg: str) -> None:
    n = _int_arg(arg, 1, "/rewind")
    conv = app.conv
    saved = conv.saved_name
    waiting = app.conv.prefs.pending_system is not False
    dropped = app.conv.rewind(n)
    for t in dropped:
        preview = displayable(t.text.strip().replace("\n", " "))
        app.say(f"removed {t.role}: {preview[:70] + ('...' if len(preview) > 70 else '')}")
    emptied = saved and not conv.saved_name  # no exchange left: no saved conversation until the next answer
    unread = conv.transcript.unread_left  # a stopped read left these on disk: saved as they were until an answer
    if conv.transcript.cut_failed:
        app.say(f"warning: {conv.transcript.cut_failed}")
    app.say(f"rewound {count(n, 'exchange')}; {count(conv.transcript.end, 'token')} in context"
            + (f"; session {saved} is empty, off the disk until its next answer" if emptied else "")
            + (f"; saved as it was (with the {count(unread, 'exchange')} not read) until the next answer"
               if unread else ""))
    if waiting and app.conv.prefs.pending_system is False:  # rewound to no exchange: a new start
        app.say(f"system = {SETTINGS['system'].show(conv.prefs.settings.system)} (it waited for the next conversation)")


def cmd_forget(app, arg: str) -> None:
    n = _int_arg(arg, 0, "/forget") if arg.strip() else None
    app.say(app.conv.forget(n, on_progress=app.prefill_progress("the exchanges kept"), cancel=app.cancel))


def cmd_fork(app, arg: str) -> None:
    n = _int_arg(arg, 0, "/fork") if arg.strip() else None
    app.say(app.conv.fork(n))


def cmd_regen(app, arg: str) -> None:
    app.answer(None)  # the last message, answered again (Conversation.regen)


def cmd_history(app, arg: str) -> None:
    forked = report.forked_line(app.conv)
    if forked:
        app.say(forked)
    turns = app.conv.transcript.turns
    if not turns:
        app.say("the conversation is empty")
    for t in turns:
        app.say(report.turn_line(t, app.conv, app.dim))


def cmd_set(app, arg: str) -> None:
    """/set KEY VALUE: the rest of the line is the value (one pair of enclosing quotes is removed);
    /set KEY alone shows the current value."""
    parts = arg.strip().split(None, 1)
    if not parts:
        raise ChatError("/set needs a setting and a value: /set KEY VALUE (/help set lists them)")
    if parts[0].lower() == "parameter" and len(parts) == 2:  # ollama's /set parameter KEY VALUE
        raise ChatError(f"did you mean /set {printable(parts[1])}? (colichat's /set takes the key first; "
                        "/help set lists them)")
    if parts[0].lower() == "nothink" and len(parts) == 1:  # ollama's
        raise ChatError("did you mean /set think off? (it asks a model with the switch not to think)")
    if parts[0].lower() == "kv":  # --kv: not a sampler setting, the format of new conversations' caches
        app.say(app.conv.set_option("kv", parts[1].strip().lower()) if len(parts) == 2 else f"kv = {app.conv.prefs.kv}")
        return
    key = key_of(parts[0])
    row = SETTINGS[key]
    if len(parts) == 1:
        app.say(shown_setting(app.conv.prefs.options(), key))
        return
    app.say(app.conv.set_option(key, row.parse(parts[1])))


def shown_setting(options: dict, key: str) -> str:
    """`key = VALUE`, and the value waiting for the next conversation if one does (a system prompt
    set after the first answer): the one in use alone would hide it."""
    row = SETTINGS[key]
    waiting = f"{key} (next)"
    later = f" (next conversation: {row.show(options[waiting])})" if waiting in options else ""
    return f"{key} = {row.show(options[key])}{later}"


def cmd_show(app, arg: str) -> None:
    """The settings as /set takes them (`/show info` and the like, ollama's, are pointed here)."""
    for key, value in app.conv.prefs.options().items():
        app.say(f"{key:<15}{SETTINGS[key.split()[0]].show(value)}")
    app.say(f"{'kv':<15}{app.conv.prefs.kv}")  # (new conversations'; /stats says how this one is kept)


def cmd_stats(app, arg: str) -> None:
    for line in report.stats_lines(app.conv):
        app.say(line)


def cmd_quit(app, arg: str) -> None:
    app.quit()


COMMANDS = [
    Command("/help", "[CMD]", "list the commands, or explain one", cmd_help),
    Command("/resume", "[NAME]", "reopen a saved conversation (the latest by default), no re-prefill", cmd_resume),
    Command("/sessions", "", "list saved conversations of this model", cmd_sessions,
            instead="/resume NAME reopens one"),
    Command("/new", "", "start a new empty conversation (the current one stays saved)", cmd_new,
            ("/clear",), instead="/rename NAME names this conversation"),
    Command("/reset", "", "empty this conversation in place: same name, every exchange removed from memory and "
            "disk, settings kept", cmd_reset, instead="/rewind N drops the last N exchanges"),
    Command("/rename", "NEW", "give this conversation another name (or, before its first answer, its name)",
            cmd_rename),
    Command("/save", "NAME", "keep a copy of this conversation as NAME (written from memory, no re-prefill)",
            cmd_save),
    Command("/export", "[FILE]", "write the conversation as Markdown (default NAME.md here, or in FILE if it "
            "is a directory)", cmd_export),
    Command("/delete", "NAME", "delete a saved conversation of this model (not the current one)", cmd_delete),
    Command("/rewind", "[N]", "drop the last N exchanges (default 1)", cmd_rewind),
    Command("/forget", "[N]", "continue in a new conversation without the N oldest exchanges (default: enough "
            "to free half the context); the current one stays saved", cmd_forget),
    Command("/fork", "[N]", "continue in a new conversation made of this one's first N exchanges (default: all), "
            "named after it (NAME-fork, NAME-fork-2, ...; /rename renames it); records copied, no re-prefill; "
            "the current one stays saved as it is", cmd_fork),
    Command("/regen", "", "drop the last answer and answer the last message again", cmd_regen,
            instead="/rewind, then a message, asks something else"),
    Command("/history", "", "show the conversation so far", cmd_history,
            instead="/export FILE writes it to a file"),
    Command("/set", "KEY VALUE", "change a setting; /set KEY shows its value", cmd_set, more="/help set lists them"),
    Command("/show", "", "show the settings", cmd_show, instead="/set KEY shows one"),
    Command("/stats", "", "context used, bytes on disk, last speeds", cmd_stats),
    Command("/quit", "", "save and exit (Ctrl-D works too)", cmd_quit, ("/exit", "/bye", "/q")),
]
BY_NAME = {name: c for c in COMMANDS for name in (c.name, *c.aliases)}
QUIT_WORDS = ("exit", "quit", "bye")  # alone on a line: meant as /quit, not as a message
CLEAR_WORDS = ("clear", "cls")  # alone on a line: meant as /clear (a shell's habit; ollama's /clear)


# other chat programs' commands (ollama's, llm's): what colichat calls them
ELSEWHERE = {"/load": "/resume NAME", "/show info": "/show (and /stats)", "/show parameters": "/show",
             "/show modelfile": "/show", "/show template": "/show", "/show system": "/set system",
             "/show license": "/show"}


def find_command(name: str) -> Command:
    """The command called `name` (or an alias), or a ChatError suggesting the nearest one."""
    cmd = BY_NAME.get(name.lower())
    if cmd is not None:
        return cmd
    if name.lower() in ELSEWHERE:
        raise ChatError(f"unknown command '{printable(name)}': did you mean {ELSEWHERE[name.lower()]}? "
                        "/help lists the commands")
    if name == "/":  # nearest to nothing: a guess such as /q would be noise
        raise ChatError("/ alone is not a command: /help lists them")
    near = difflib.get_close_matches(name.lower(), list(BY_NAME), n=1, cutoff=0.6)
    if near:
        raise ChatError(f"unknown command '{printable(name)}': did you mean {near[0]}? /help lists the commands")
    raise ChatError(f"unknown command '{printable(name)}': /help lists the commands "
                    "(a message that starts with / is typed with //)")


def is_command(line: str) -> bool:
    """A line starting with one `/` (`//` starts a message: message_text)."""
    return line.startswith("/") and not line.startswith("//") and not isinstance(line, Message)


def commands_of(text: str) -> list[str]:
    """The inputs in what a prompt sent: a text of several lines each of which is a command (typed ahead
    while colichat was busy, say) is those commands, to run one by one in order, as a shell runs lines
    typed ahead (blank lines skipped); anything else is one input, a message of several lines as typed."""
    lines = [line for line in text.split("\n") if line.strip()] if "\n" in text else []
    return lines if lines and not isinstance(text, Message) and all(map(is_command, lines)) else [text]


def message_text(line: str) -> str:
    """What a line that is not a command sends: a line `//text` sends `/text` (as IRC clients do),
    the way to start a message with `/`; a \"\"\" block is sent as it is."""
    return line[1:] if line.startswith("//") and not isinstance(line, Message) else line


def is_quit_word(line: str) -> bool:
    """`exit`, `quit` or `bye` typed alone (any case, a `.` or `!` after it or not): most likely meant
    for colichat, though `Bye!` can be a message: the REPL asks, and sends it on a "no"."""
    return meant_command(line) == "/quit"


def meant_command(line: str) -> str | None:
    """The command a word typed alone most likely meant (any case, a `.` or `!` after it or not): /quit
    for `exit`, `quit`, `bye`; /clear for `clear`, `cls`. None for anything else (a message)."""
    word = "" if isinstance(line, Message) else line.strip().lower().rstrip(".!")
    return "/quit" if word in QUIT_WORDS else "/clear" if word in CLEAR_WORDS else None


def dispatch(app, line: str) -> None:
    """Run one command line; ChatError carries the one-line message for a bad one."""
    name, arg = (line.strip().split(None, 1) + [""])[:2]
    cmd = find_command(name)
    said = f"{name} {arg.strip()}".lower()
    if said in ELSEWHERE:
        raise ChatError(f"'{printable(said)}' is not a colichat command: did you mean {ELSEWHERE[said]}?")
    if not cmd.args and arg.strip():  # refused, not ignored: `/new notes` must not look like it named anything
        hint = f" ({cmd.instead})" if cmd.instead else ""
        raise ChatError(f"{name.lower()} takes no argument{hint}")
    cmd.run(app, arg)


NAME_ARGS = ("/resume", "/delete")  # commands whose argument is a saved conversation's name


def completions(text: str, app=None) -> list[str]:
    """What Tab offers for the text before the cursor: command names (after /help too), settable keys
    after /set, saved conversations' names after /resume and /delete (with `app`, the running program)."""
    name, sep, rest = text.partition(" ")
    if sep and " " not in rest.lstrip():
        head, word = text[: len(text) - len(rest.lstrip())], rest.lstrip()
        if name.lower() == "/set":
            return [head + k for k in SETTINGS if k.startswith(word.lower())]
        if name.lower() == "/help":  # `/help set` as /help shows it, `/help /set` if a / was typed
            slash = "/" if word.startswith("/") else ""
            return [head + slash + c.name[1:] for c in COMMANDS if c.name[1:].startswith(word.lstrip("/").lower())]
        if name.lower() in NAME_ARGS and app is not None:
            try:
                names = app.conv.shelf.names()
            except OSError:
                names = []
            return [head + n for n in names if n.startswith(word)]
        return []
    return [c.name for c in COMMANDS if c.name.startswith(text.lower())]
