"""The slash commands in-process: what /set reads, and that no line typed to any command ends the
program or prints more than one error line."""

from __future__ import annotations

import os

import pytest
from app_helpers import Recorder, run
from conftest import TINY
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from colichat.conversation.chat import Conversation, Settings
from colichat.conversation.settings import TABLE
from colichat.engine import Sampler, load
from colichat.persist import Store
from colichat.terminal.commands import COMMANDS


@pytest.fixture(scope="module")
def model():
    return load(str(TINY / "llama.gguf"), n_ctx=256)


@pytest.fixture
def app(model, tmp_path):
    model.reset()
    conv = Conversation(model, Settings(temperature=0, max_tokens=4), store=Store(tmp_path / "s"))
    yield Recorder(conv)
    conv.close()




# ---- /set ---------------------------------------------------------------------------------------


def test_set_system_takes_the_rest_of_the_line(app):
    assert run(app, "/set system You are a pirate.") == ["system = You are a pirate."]
    assert app.conv.prefs.settings.system == "You are a pirate."
    run(app, "/set system 'Don't lie.'")
    assert app.conv.prefs.settings.system == "Don't lie."
    run(app, '/set system "You are" a pirate')
    assert app.conv.prefs.settings.system == '"You are" a pirate'
    run(app, '/set system "Be brief."')
    assert app.conv.prefs.settings.system == "Be brief."
    assert app.errors == 0


def test_set_without_a_value_shows_the_current_one(app):
    assert run(app, "/set system") == ["system = none"]
    assert run(app, "/set temperature") == ["temperature = 0.0"]
    assert run(app, "/set top-k") == ["top_k = 40"]
    assert app.errors == 0 and app.conv.prefs.settings.system is None


def test_set_errors_are_one_line(app):
    assert run(app, "/set") == ["colichat: /set needs a setting and a value: /set KEY VALUE (/help set lists them)"]
    assert run(app, "/set temperature hot") == ["colichat: temperature takes a number, not 'hot'"]
    assert run(app, "/set temperature\thot\nter") == ["colichat: temperature takes a number, not 'hot\\nter'"]
    assert run(app, "/set top_p 2") == ["colichat: top_p must be in (0, 1]"]
    assert app.errors == 4


# ---- any line to any command ---------------------------------------------------------------------

TRICKY = ["", " ", "none", "None", "0", "-1", "1", "2", "1e999", "nan", "-0", "99999999999999999999", "0.5",
          "'", '"', "''", '""', "'a b'", '"a" b', "Don't", "..", "../x", "/", "x" * 80, "\t", "\x00", "\x1b[2J",
          "\u2028", "\x85", "é", "\ud7ff", "a\nb"]
words = st.one_of(st.sampled_from(TRICKY), st.text(max_size=12))
settable = ["temperature", "top_k", "top_p", "min_p", "repeat_penalty", "seed", "max_tokens", "system", "colour"]
lines = st.builds(
    lambda name, first, rest, sep: f"{name}{sep}{first}{sep}{' '.join(rest)}".rstrip(" "),
    st.sampled_from([c.name for c in COMMANDS] + ["/", "/frob", "/SET", "/Help"]),
    st.one_of(st.sampled_from(settable + [c.name[1:] for c in COMMANDS]), words),
    st.lists(words, max_size=3),
    st.sampled_from([" ", "\t", "  "]),
)


@settings(max_examples=300, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(line=lines)
def test_any_line_to_any_command_gives_at_most_one_clean_error_line(app, tmp_path, line):
    if line.lower().startswith("/export"):  # files it writes stay in tmp_path
        assume(not any(x in line[7:] for x in ("/", "~", "..", "\\")))
    cwd = os.getcwd()
    os.chdir(tmp_path)  # a command that writes a file writes it here
    try:
        errors = app.errors
        said = run(app, line)  # an exception here (a traceback for the user) fails the test
    finally:
        os.chdir(cwd)
        app.quitting = False
    if app.errors > errors:
        failed = [x for x in said if x.startswith("colichat: ")]
        assert len(failed) == 1, said
        assert len(failed[0].splitlines()) == 1 and failed[0].isprintable(), failed


# ---- the settings table ----------------------------------------------------------------------------


def test_show_prints_values_as_set_takes_them(app):
    run(app, "/set seed 7")
    run(app, "/set system Be brief.")
    shown = run(app, "/show")
    assert "seed           7" in shown and "system         Be brief." in shown and "temperature    0.0" in shown
    assert [line.split()[0] for line in shown[:-1]] == [row.name for row in TABLE]
    assert shown[-1] == "kv             f32"  # --kv's
    before = app.conv.prefs.settings
    for line in shown:  # every line typed back after /set changes nothing
        run(app, "/set " + line)
    assert app.conv.prefs.settings == before and app.errors == 0


def test_set_seed_none_unsets_it(app):
    run(app, "/set seed 3")
    assert app.conv.prefs.settings.seed == 3
    assert run(app, "/set seed none") == ["seed = none"]
    assert app.conv.prefs.settings.seed is None and "seed           none" in run(app, "/show")
    run(app, "/set system Be brief.")
    run(app, "/set system none")
    assert app.conv.prefs.settings.system is None and app.errors == 0


def test_the_repeat_window_is_the_setting(model):
    """The sampler sees the last repeat_last_n tokens of the context, whatever that setting is."""
    seen = []
    for window in (0, 64, 100):
        model.reset()
        conv = Conversation(model, Settings(temperature=0, max_tokens=3, repeat_last_n=window), save=False)
        class Watched(Sampler):
            def __call__(self, logits, recent=(), w=window):
                seen.append((w, len(recent)))
                return super().__call__(logits, recent)

        conv.prefs.sampler = Watched(conv.prefs.sampler.settings)
        conv.ask(" ".join(f"word{i}" for i in range(25)))  # well over 100 tokens
    assert {w: n for w, n in seen} == {0: 0, 64: 64, 100: 100}


def test_the_options_are_the_table(colichat_home):
    from colichat.terminal.cli import parse_args, settings_from

    args = parse_args(["--seed", "none", "--top-k", "5", "--system", "Be brief."])
    settings, given = settings_from(args)
    assert given == {"seed", "top_k", "system"} and settings.top_k == 5 and settings.system == "Be brief."
    assert settings.seed is None and settings.temperature == 0.7


def test_the_settings_refuse_what_the_sampler_refuses_in_its_words():
    """The sampling rules are the sampler's (engine/sampler.py): /set, an option and a saved value are
    refused where SamplerSettings would be, with the same line."""
    import dataclasses

    from colichat.conversation.settings import BY_NAME, SettingError
    from colichat.engine import SamplerSettings

    for key, bad in (("temperature", -1.0), ("temperature", float("inf")), ("top_k", -1), ("top_k", 2.5),
                     ("top_p", 0.0), ("top_p", 1.5), ("min_p", 1.0), ("repeat_penalty", 0.0),
                     ("repeat_last_n", -3), ("seed", -1)):
        with pytest.raises(ValueError) as engine:
            dataclasses.replace(SamplerSettings(), **{key: bad}).validate()
        with pytest.raises(SettingError) as setting:
            BY_NAME[key].validate(bad)
        assert str(setting.value) == str(engine.value), key
    for key, fine in (("top_p", 1.0), ("min_p", 0.0), ("seed", None), ("temperature", 0)):
        BY_NAME[key].validate(fine)


# ---- inputs: one reader of \"\"\" blocks for the terminal and for pipes --------------------------------


def test_blocks_are_read_the_same_way_everywhere():
    from colichat.terminal.inputs import Message, inputs_of, read_input

    got = list(inputs_of(["hello\n", '"""\n', "/not a command\n", "\n", "  x\n", '"""\n', '"""inline"""\n',
                          "/show\n", '"""\n', "cut at the end\n"]))
    assert got == ["hello", "/not a command\n\n  x", "inline", "/show", "cut at the end"]
    assert [type(x) is Message for x in got] == [False, True, True, False, True]
    # The terminal's reader is the same function: Ctrl-D (EOFError) inside a block ends the block.
    typed = iter(['"""', "first", "second"])

    def prompt(in_block):
        try:
            return next(typed)
        except StopIteration:
            raise EOFError from None

    assert read_input(prompt) == "first\nsecond"


def test_system_given_with_resume_waits_for_the_next_conversation(model, tmp_path):
    """--resume --system X: the saved conversation was read with its own system prompt; X is kept
    for the next conversation instead of re-reading the whole history, and reopening says so."""
    model.reset()
    store = Store(tmp_path / "s")
    conv = Conversation(model, Settings(temperature=0, max_tokens=4, system="Old."), session_name="sy", store=store)
    conv.ask("hello")
    conv.close()
    model.reset()
    again = Conversation(model, Settings(system="New.", temperature=0.5), store=store, pinned={"system", "temperature"})
    said = again.resume("sy").splitlines()
    assert ("note: the system prompt given waits for the next conversation (/new starts one); this one goes on "
            "with the one it was saved with") in said
    assert again.prefs.settings.system == "Old." and again.prefs.options()["system (next)"] == "New."
    assert again.prefs.settings.temperature == 0.5 and again.prefs.settings.max_tokens == 4
    again.reset()
    assert again.prefs.settings.system == "New."
    again.close()


# ---- arguments -------------------------------------------------------------------------------------

NO_ARGUMENT = [name for c in COMMANDS if not c.args for name in (c.name, *c.aliases)]


@pytest.mark.parametrize("name", NO_ARGUMENT)
def test_a_command_that_takes_no_argument_refuses_one_and_does_nothing(app, name):
    app.conv.ask("hello")
    before = [(t.role, t.text) for t in app.conv.transcript.turns]
    said = run(app, f"{name} extra words")
    assert len(said) == 1 and said[0].startswith(f"colichat: {name} takes no argument"), said
    assert [(t.role, t.text) for t in app.conv.transcript.turns] == before and not app.quitting and app.errors == 1


def test_new_with_a_name_says_how_to_name_the_conversation(app):
    assert run(app, "/new notes") == ["colichat: /new takes no argument (/rename NAME names this conversation)"]
    assert run(app, "/Clear x") == ["colichat: /clear takes no argument (/rename NAME names this conversation)"]


# ---- /export ---------------------------------------------------------------------------------------


def test_export_takes_a_quoted_name_as_set_does(app, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    app.conv.ask("hello")
    assert run(app, '/export "my notes.md"') == ["exported 2 turns to my notes.md"]
    assert (tmp_path / "my notes.md").read_text().startswith("# ")
    run(app, "/export 'other.md'")
    assert (tmp_path / "other.md").exists() and not any("'" in p.name or '"' in p.name for p in tmp_path.iterdir())


def test_export_to_a_directory_writes_name_md_in_it_and_never_overwrites(app, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes").mkdir()
    app.conv.ask("hello")
    name = app.conv.name
    assert run(app, "/export notes") == [f"exported 2 turns to notes/{name}.md"]
    assert (tmp_path / "notes" / f"{name}.md").read_text().startswith("# ")
    assert run(app, "/export notes/") == [f"exported 2 turns to notes/{name}-2.md"]  # a name colichat chose


def test_export_never_overwrites_a_file_named_by_the_user_and_numbers_its_own(app, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    app.conv.ask("hello")
    name = app.conv.name
    assert run(app, "/export") == [f"exported 2 turns to {name}.md"]
    assert run(app, "/export") == [f"exported 2 turns to {name}-2.md"]
    run(app, "/export mine.md")
    assert run(app, "/export mine.md") == ["colichat: mine.md already exists: give /export another file name"]


@pytest.mark.parametrize("umask", [0o022, 0o000])
def test_export_files_are_private(app, tmp_path, monkeypatch, umask):
    monkeypatch.chdir(tmp_path)
    app.conv.ask("hello")
    old = os.umask(umask)
    try:
        run(app, "/export a.md")
    finally:
        os.umask(old)
    assert (tmp_path / "a.md").stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize("arg", ['"a" "b"', '"un', "'a' b'", '"a"b"'])
def test_export_refuses_unbalanced_or_several_quoted_names(app, tmp_path, monkeypatch, arg):
    monkeypatch.chdir(tmp_path)
    app.conv.ask("hello")
    said = run(app, f"/export {arg}")
    assert len(said) == 1 and said[0].startswith("colichat: /export takes one file name")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prefixes", "s"]  # (the store's), no export


def test_export_to_a_missing_directory_says_so(app, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    app.conv.ask("hello")
    assert run(app, "/export nowhere/") == ["colichat: there is no directory nowhere/: make it first, or give "
                                            "/export a file name"]


def test_export_dash_is_refused_not_a_file_named_dash(app, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    app.conv.ask("hello")
    said = run(app, "/export -")
    assert len(said) == 1 and said[0].startswith("colichat: /export writes a file, not standard output")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prefixes", "s"]  # only the store's


def test_export_expands_the_home_directory(app, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    app.conv.ask("hello")
    run(app, "/export ~/chat.md")
    assert (tmp_path / "chat.md").exists() and app.errors == 0


# ---- the same things said the same way --------------------------------------------------------------


def test_rewind_says_what_regen_and_forget_say(app):
    assert run(app, "/rewind") == ["colichat: nothing to rewind: the conversation is empty"]
    assert run(app, "/regen") == ["colichat: nothing to regenerate: the conversation is empty"]
    app.conv.ask("hello")
    app.conv.ask("again")
    for n in ("0", "3", "-1"):
        more = " (/reset empties it)" if n == "3" else ""
        assert run(app, f"/rewind {n}") == [f"colichat: /rewind takes 1 to 2: the conversation has 2 exchanges{more}"]
        assert run(app, f"/forget {n}") == ["colichat: /forget takes 1 to 2: the conversation has 2 exchanges"]
    assert len(app.conv.transcript.starts()) == 2


def test_habits_from_other_chat_programs_get_a_did_you_mean(app):
    assert run(app, "/set parameter temperature 0") == [
        "colichat: did you mean /set temperature 0? (colichat's /set takes the key first; /help set lists them)"]
    assert run(app, "/load trip") == ["colichat: unknown command '/load': did you mean /resume NAME? /help lists the "
                                      "commands"]
    assert run(app, "/show info") == ["colichat: '/show info' is not a colichat command: did you mean /show (and "
                                      "/stats)?"]


def test_stats_after_new_shows_no_answer_of_the_conversation_before(app):
    app.conv.ask("hello")
    assert any(line.startswith("last answer:") for line in run(app, "/stats"))
    run(app, "/new")
    assert not any(line.startswith("last answer:") for line in run(app, "/stats"))


def test_help_says_each_thing_once(app):
    listing = run(app, "/help")
    assert not any(") (" in line for line in listing), listing
    assert any("(the current one stays saved; also /clear)" in line for line in listing)
    assert any("(Ctrl-D works too; also /exit, /bye, /q)" in line for line in listing)
    assert any(line.startswith("/set KEY VALUE") and "(/help set lists them)" in line for line in listing)
    explained = run(app, "/help set")
    assert explained[0].startswith("/set KEY VALUE  change a setting") and "/help set" not in explained[0]


def test_help_says_lines_of_commands_typed_ahead_run_one_by_one(app):
    said = " ".join(run(app, "/help"))
    assert ("Several lines that are all commands (typed while colichat was busy, say) run one by one, in order; "
            "any other text of several lines is one message.") in said


def test_slash_alone_says_it_is_not_a_command(app):
    assert run(app, "/") == ["colichat: / alone is not a command: /help lists them"]


def test_rename_before_the_first_answer_names_the_conversation_for_its_first_save(app):
    assert run(app, "/rename notes") == ["this conversation is named notes: its first answer saves it"]
    app.handle("hello")
    assert app.conv.name == "notes" and app.conv.shelf.names() == ["notes"] and app.errors == 0
    run(app, "/new")
    assert run(app, "/rename notes") == ["colichat: session notes already exists: choose another name"]
    assert run(app, "/rename other") == ["this conversation is named other: its first answer saves it"]
    assert run(app, "/rename third") == ["renamed session other to third"]  # named, not saved yet
    app.handle("hello")
    assert sorted(app.conv.shelf.names()) == ["notes", "third"]


def test_set_system_alone_shows_the_prompt_waiting_for_the_next_conversation(app):
    app.conv.ask("hello")
    assert run(app, "/set system You are a pirate.")[0].startswith("system prompt set for the next conversation")
    assert run(app, "/set system") == ["system = none (next conversation: You are a pirate.)"]
    run(app, "/new")
    assert run(app, "/set system") == ["system = You are a pirate."]


# ---- Tab ---------------------------------------------------------------------------------------------


def tab(text: str) -> list[str]:
    """What the REPL's completer offers for `text` before the cursor, as the line it makes."""
    from prompt_toolkit.completion import CompleteEvent
    from prompt_toolkit.document import Document

    from colichat.terminal.repl import SlashCompleter

    found = SlashCompleter().get_completions(Document(text), CompleteEvent(completion_requested=True))
    return [text[: len(text) + c.start_position] + c.text for c in found]


def test_tab_completes_command_names_after_help(app):
    assert tab("/help se") == ["/help sessions", "/help set"]
    assert tab("/help /re") == ["/help /resume", "/help /reset", "/help /rename", "/help /rewind", "/help /regen"]
    assert tab("/HELP q") == ["/HELP quit"]
    assert len(tab("/help ")) == len(COMMANDS) and tab("/help set x") == []
    assert tab("/he") == ["/help"]
    for line in tab("/help "):  # each one explains a command
        assert len(run(app, line)) >= 1 and app.errors == 0


def test_readme_names_every_word_that_asks_whether_quit_was_meant():
    from pathlib import Path

    from colichat.terminal.commands import QUIT_WORDS, is_quit_word

    readme = (Path(__file__).parents[1] / "README.md").read_text("utf-8")
    row = next(line for line in readme.splitlines() if "asks whether you meant `/quit`" in line)
    assert all(f"`{word}`" in row for word in QUIT_WORDS), row
    assert is_quit_word("Bye!") and "`Bye!`" in row and is_quit_word("EXIT.") and not is_quit_word("clear")


def test_a_word_alone_that_means_a_command_is_asked_about_and_commands_typed_ahead_run_one_by_one():
    from colichat.terminal.commands import commands_of, meant_command
    from colichat.terminal.inputs import Message

    assert [meant_command(w) for w in ("exit", "Bye!", "clear", "CLS.", "clear the table", Message("clear"))] == [
        "/quit", "/quit", "/clear", "/clear", None, None]
    assert commands_of("/history\n/rewind 1\n\n/stats") == ["/history", "/rewind 1", "/stats"]
    for one in ("/history", "/history\nwhat was that?", "hello\n/stats", "//etc\n/stats", Message("/a\n/b")):
        assert commands_of(one) == [one]  # anything else stays one input, as typed


def test_sessions_on_a_terminal_lists_the_newest_that_fit_with_the_command_and_the_prompt():
    from colichat.terminal.commands import newest_that_fit, older_line
    from colichat.wrap import wrap_line

    rows = [f"  conv-{k}: 2 turns, 15 tokens, 31.0 KiB, 23 h ago, \"hello\"" for k in range(30)]
    assert newest_that_fit(rows, 80, 32) == 30  # all of them, the command's row and the prompt's
    more = wrap_line(older_line(30), 80).count("\n") + 1
    assert newest_that_fit(rows, 80, 31) == 31 - 2 - more
    assert newest_that_fit(rows, 40, 24) == (24 - 2 - (wrap_line(older_line(30), 40).count("\n") + 1)) // 2
    assert newest_that_fit(rows, 80, 3) == 1  # a window too small for more: the newest still
    assert newest_that_fit(rows, 80, 3, keep=20) == 0  # or the current conversation only, when it is older
    assert newest_that_fit(rows, 80, 31, keep=2) == 31 - 2 - more  # the current one among the newest: as before


def test_sessions_cut_to_the_window_still_shows_the_current_conversation(app, monkeypatch):
    """/sessions on a terminal too small for every conversation: the current one (marked *), older
    than the newest that fit, is shown below them, before the line on the older ones."""
    for k in range(8):
        run(app, f"Topic {k}?")
        run(app, "/new")
    run(app, "/resume topic-0")
    monkeypatch.setattr(app, "window", lambda: (80, 9))  # the command, 5 rows, the older line (2), the prompt
    rows = run(app, "/sessions")
    assert [row.split(":")[0] for row in rows[:-1]] == ["  topic-7", "  topic-6", "  topic-5", "  topic-4",
                                                        "* topic-0"], rows
    assert rows[-1].startswith("... and 3 older conversations (colichat --sessions lists them all"), rows
    monkeypatch.setattr(app, "window", lambda: (80, 20))  # all of them fit
    rows = run(app, "/sessions")
    assert [row.split(":")[0] for row in rows[:-1]] == [f"  topic-{k}" for k in range(7, 0, -1)] + ["* topic-0"]
    assert rows[-1].startswith("8 conversations, ") and rows[-1].endswith(" on disk")  # the total, room left for it


def test_a_resumed_conversation_folds_a_long_pasted_turn_of_its_last_exchange():
    from colichat.conversation.report import RECAP_LINES, recap
    from colichat.persist import Turn

    paste = "\n".join(f"line {k}" for k in range(40))
    shown = recap([Turn("user", "hi", 0, 1), Turn("assistant", "hello", 1, 2), Turn("user", paste, 2, 3),
                   Turn("assistant", "short answer", 3, 4)])
    assert shown[0] == "(1 earlier exchange; /history shows the whole conversation)"
    folded = shown[1].split("\n")
    assert len(folded) == RECAP_LINES and folded[0] == "user> line 0"
    assert folded[-1] == f"(... {40 - RECAP_LINES + 1} more lines; /history shows them)"
    assert shown[2] == "assistant> short answer"
