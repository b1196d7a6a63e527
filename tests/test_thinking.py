"""Thinking models (<think>...</think>): the thinking sorted from the answer as it streams and as it is
saved; shown folded, whole or not at all (/set think); marked in /history and exports; and dropped
from later prompts exactly as the model's real chat template drops it, the cache read again from the
first token that differs. The model's words are scripted (app_helpers.script) on tiny models carrying
the real templates of tests/data/templates."""

from __future__ import annotations

import json

import numpy as np
import pytest
from app_helpers import Recorder, run, script
from cli_helpers import TINY_LLAMA, copy_gguf
from conftest import TEMPLATES
from hypothesis import given
from hypothesis import strategies as st

from colichat.conversation.chat import Conversation, Settings
from colichat.conversation.saved import export_saved, markdown
from colichat.conversation.thinking import Splitter, split
from colichat.engine import load
from colichat.persist import Store
from colichat.terminal.screen import Screen
from colichat.wrap import DIM, PLAIN

V31_THINKING = "{%- set thinking = true -%}"  # V3.1 thinks when its template is given `thinking`

# (template file, what is put before it): the generation prompt opens <think> (R1, GLM-4.7, GLM-5 and 5.1,
# V3.1 asked to think), or the model writes its own (GLM-4.6)
TEMPLATE_FILES = {"r1": ("deepseek-ai-DeepSeek-R1.jinja", ""), "glm47": ("GLM-4.7-Flash.jinja", ""),
                  "v31": ("deepseek-ai-DeepSeek-V3.1.jinja", V31_THINKING), "glm46": ("GLM-4.6.jinja", ""),
                  "glm5": ("zai-org-GLM-5.jinja", ""), "glm51": ("zai-org-GLM-5.1.jinja", "")}
OPENS = {"r1": True, "glm47": True, "v31": True, "glm46": False, "glm5": True, "glm51": True}

# what each model writes, for three messages: thinking (its opening tag where the template does not
# open it), then the answer; the thinking words are unique, to find them in the prompt
ANSWERS = ["First thought: twelve.\n</think>\n\nIt is 12.", "Second thought: apples.</think>Apples!",
           "Third thought: done.\n</think>\n\nBye."]


def written(name: str, n: int) -> list[str]:
    return [("" if OPENS[name] else "<think>\n") + a for a in ANSWERS[:n]]


@pytest.fixture(scope="module", params=list(TEMPLATE_FILES))
def thinker(request, tmp_path_factory):
    """(name, a tiny model whose GGUF carries that real chat template)."""
    file, head = TEMPLATE_FILES[request.param]
    source = head + (TEMPLATES / file).read_text("utf-8")
    path = copy_gguf(TINY_LLAMA, tmp_path_factory.mktemp(request.param) / "m.gguf",
                     set_keys={"tokenizer.chat_template": source})
    return request.param, load(path, n_ctx=1024)


@pytest.fixture(scope="module")
def r1(tmp_path_factory):
    source = (TEMPLATES / TEMPLATE_FILES["r1"][0]).read_text("utf-8")
    return load(copy_gguf(TINY_LLAMA, tmp_path_factory.mktemp("r1") / "r1.gguf",
                          set_keys={"tokenizer.chat_template": source}), n_ctx=1024)


def conversation(model, store=None, name=None, **settings) -> Conversation:
    model.reset()
    return Conversation(model, Settings(temperature=0, draft=0, **settings), store=store, session_name=name,
                        save=store is not None)


# ---- the text: thinking and answer -------------------------------------------------------------------


def test_split_sorts_the_thinking_from_the_answer_with_or_without_the_opening_tag():
    assert split("Hmm.\n</think>\n\nYes.", opened=True) == ("Hmm.", "Yes.")
    assert split("<think>\nHmm.</think>Yes.", opened=False) == ("Hmm.", "Yes.")
    assert split("Yes.", opened=False) == (None, "Yes.")  # no thinking: the text as it is
    assert split("  <think></think>\n\nYes.", opened=False) == (None, "Yes.")  # thought nothing
    assert split("Hmm, let me", opened=True) == ("Hmm, let me", "")  # cut short while thinking
    assert split("<think>Hmm", opened=False) == ("Hmm", "")
    assert split("<thinking> is a tag", opened=False) == (None, "<thinking> is a tag")


TEXT = st.lists(st.sampled_from(["<think>", "</think>", "<", "</th", "ink>", "\n", " ", "a", "b c", "é"]),
                max_size=12).map("".join)


@given(TEXT, st.booleans(), st.lists(st.integers(0, 40), max_size=8))
def test_an_answer_streamed_in_any_pieces_sorts_as_the_whole_text_does(text, opened, cuts):
    """A tag may come in several pieces (a byte-level vocabulary) or inside one with text around it."""
    s, parts, at = Splitter(opened), [], 0
    for cut in sorted(min(c, len(text)) for c in cuts) + [len(text)]:
        parts += s.feed(text[at:cut])
        at = cut
    parts += s.end()
    thinking = "".join(t for is_thinking, t in parts if is_thinking) or None
    answer = "".join(t for is_thinking, t in parts if not is_thinking)
    assert (thinking, answer) == split(text, opened)


# ---- the prompt: earlier thinking dropped as the template drops it -------------------------------------


def test_earlier_thinking_is_dropped_from_the_prompt_as_the_real_template_drops_it(thinker):
    """Each turn keeps the model's whole text; the template renders the earlier answers (R1's, V3.1's
    and GLM's without their thinking), and the model reads exactly that prompt: the cache holds the
    tokens of the rendered conversation, the latest answer's thinking included, the earlier ones' not."""
    name, model = thinker
    conv = conversation(model)
    assert conv.prefs.opens_thinking is OPENS[name]
    script(conv, *written(name, 3))
    for i, question in enumerate(["How many?", "Which fruit?", "Thanks"]):
        conv.ask(question)
        prompt = conv.prompt.template.render(conv.prompt.messages(conv.transcript.turns[:-1]), True)
        ids = model.cache.token_ids()
        assert ids[: conv.transcript.turns[-1].first] == conv.prompt.tok.encode_prompt(prompt)  # never a stale row
        read = conv.prompt.tok.decode(ids, special=True)
        assert [thought in read for thought in ("First thought", "Second thought", "Third thought")][: i + 1] == \
            [False] * i + [True]
    assert [t.text for t in conv.transcript.turns if t.role == "assistant"] == written(name, 3)


def test_a_prompt_whose_earlier_text_changed_is_read_again_from_the_first_token_that_differs(thinker):
    """The cache keeps its rows up to the first token the new prompt changes (inside a turn too: R1
    renders a past answer without the `<think>` its prompt opened, GLM with `</think>` instead), reads
    the rest, and its rows are the rows a fresh read of the whole prompt gives."""
    name, model = thinker
    conv = conversation(model)
    script(conv, *written(name, 2))
    conv.ask("How many?")
    before, first = model.cache.token_ids(), conv.transcript.turns[0]
    _, stats = conv.ask("Which fruit?")
    rendered = conv.prompt.template.render(conv.prompt.messages(conv.transcript.turns[:-1]), True)
    prompt = conv.prompt.tok.encode_prompt(rendered)
    same = next(i for i, (a, b) in enumerate(zip(prompt, before, strict=False)) if a != b)
    assert stats.prompt_tokens == len(prompt) - same  # not from the turn's start, not from the start
    if name in ("r1", "glm47"):  # inside the first message's turn (which ends with the opening <think>):
        assert 0 < same < first.last and conv.transcript.turns[0].last == same  # the turn keeps its head
    rows = model.cache.records["kv"][: model.cache.length].copy()
    ids = model.cache.token_ids()
    model.reset()
    model.prefill(ids)
    assert np.allclose(model.cache.records["kv"][: model.cache.length], rows, atol=1e-4)
    turns = conv.transcript.turns
    assert all(a.last == b.first for a, b in zip(turns, turns[1:], strict=False)) and turns[-1].last == len(ids)


def test_a_conversation_read_again_from_inside_a_turn_is_saved_and_resumes_to_the_byte(tmp_path):
    file, _ = TEMPLATE_FILES["glm47"]
    path = copy_gguf(TINY_LLAMA, tmp_path / "glm.gguf",
                     set_keys={"tokenizer.chat_template": (TEMPLATES / file).read_text("utf-8")})
    model, store = load(path, n_ctx=1024), Store(tmp_path / "s")
    conv = conversation(model, store, "g")
    script(conv, *written("glm47", 3))
    for question in ("How many?", "Which fruit?", "Thanks"):
        assert conv.ask(question)[1].saved
    rows, turns = model.cache.raw(0, model.cache.length).tobytes(), list(conv.transcript.turns)
    prompt = conv.prompt
    assert turns[0].last < len(prompt.tok.encode_prompt(prompt.template.render(prompt.messages(turns[:1]), True)))
    conv.close()
    again = conversation(model, store)
    again.resume("g")
    assert again.transcript.turns == turns and model.cache.raw(0, model.cache.length).tobytes() == rows
    again.close()


# ---- what the user sees ------------------------------------------------------------------------------


def thinking_app(model, tmp_path, mode: str, *answers: str) -> Recorder:
    conv = conversation(model, Store(tmp_path / "s"), "t", think=mode, max_tokens=200)
    script(conv, *answers)
    return Recorder(conv)


def test_fold_shows_one_line_counting_the_thinking_tokens_then_the_answer(r1, tmp_path):
    app = thinking_app(r1, tmp_path, "fold", ANSWERS[0])
    lines = run(app, "How many?")
    tok = app.conv.prompt.tok
    thought, total = (len(tok.encode(text)) for text in ("First thought: twelve.\n</think>", ANSWERS[0]))
    assert lines[0] == f"thinking ({thought} tokens)" and lines[1].startswith(f"[{total} tokens, {thought} thinking, ")
    assert answer(app) == "It is 12.\n"  # the answer alone
    app.conv.close()


def answer(app: Recorder) -> str:
    """What the app wrote to stdout."""
    return "".join(text for _, text in app.written)


def test_show_writes_the_thinking_and_piped_between_tags(r1, tmp_path):
    app = thinking_app(r1, tmp_path, "show", ANSWERS[0])
    lines = run(app, "How many?")
    assert answer(app) == "<think>\nFirst thought: twelve.\n</think>\n\nIt is 12.\n"
    assert "".join(text for thinking, text in app.written if thinking).startswith("<think>\nFirst thought")
    assert lines[0].startswith("thinking (") and app.errors == 0
    app.conv.close()


def test_hide_shows_nothing_of_the_thinking(r1, tmp_path):
    app = thinking_app(r1, tmp_path, "hide", ANSWERS[0])
    lines = run(app, "How many?")
    assert answer(app) == "It is 12.\n"
    assert len(lines) == 1 and " thinking, " in lines[0]  # the footer alone counts it
    app.conv.close()


class Status:
    """A StatusLine on a terminal: what it shows, as it is shown."""

    def __init__(self):
        self.seen: list[str] = []
        self.shown = False

    def show(self, text: str) -> None:
        self.seen.append(text)
        self.shown = True

    def clear(self) -> None:
        self.shown = False


def test_folded_thinking_counts_on_a_status_line_as_it_comes(r1, tmp_path):
    app = thinking_app(r1, tmp_path, "fold", "One, two.</think>Three.")
    app.status = Status()
    run(app, "Count")
    counts = [s for s in app.status.seen if s.startswith("thinking ... ")]
    assert counts[0] == "thinking ... 1 token" and counts[-1] == f"thinking ... {len(counts)} tokens"
    assert not app.status.shown and app.lines[0] == f"thinking ({len(counts)} tokens)"
    app.conv.close()


def test_an_answer_cut_while_thinking_says_what_gives_it_room(r1, tmp_path):
    conv = conversation(r1, think="fold", max_tokens=5)
    script(conv, "A long thought that goes on and on.</think>Done.")
    app = Recorder(conv)
    lines = run(app, "Think hard")
    assert lines[0] == "thinking (5 tokens)" and "max_tokens reached" in lines[1]
    assert lines[2].startswith("note: the answer reached max_tokens (5) while the model was still thinking: "
                               "/set max_tokens 4096")
    assert [t for _, t in app.written] == ["\n"]


def test_history_marks_the_thinking_as_think_says(r1, tmp_path):
    app = thinking_app(r1, tmp_path, "fold", ANSWERS[0])
    run(app, "How many?")
    n = len(app.conv.prompt.tok.encode("First thought: twelve."))
    assert run(app, "/history") == ["user> How many?", f"assistant> thinking ({n} tokens)\nIt is 12."]
    run(app, "/set think show")
    assert run(app, "/history")[1] == "assistant> <think>\nFirst thought: twelve.\n</think>\nIt is 12."
    run(app, "/set think hide")
    assert run(app, "/history")[1] == "assistant> It is 12."
    app.conv.close()


def test_think_is_a_setting_shown_and_saved_with_the_conversation(r1, tmp_path):
    app = thinking_app(r1, tmp_path, "fold", ANSWERS[0])
    assert run(app, "/set think") == ["think = fold"] and "think          fold" in run(app, "/show")
    assert run(app, "/set think SHOW") == ["think = show"]
    assert run(app, "/set think loud") == ["colichat: think must be show, fold, hide or off"]
    run(app, "How many?")
    app.conv.close()
    again = conversation(r1, Store(tmp_path / "s"))
    again.resume("t")
    assert again.prefs.settings.think == "show"
    again.close()


@pytest.fixture(scope="module")
def switchable(tmp_path_factory):
    """Tiny models carrying V3.1's and GLM-5's real templates (as is: no thinking forced), by name."""
    out = {}
    for name, file in (("v31", "deepseek-ai-DeepSeek-V3.1.jinja"), ("glm5", "zai-org-GLM-5.jinja")):
        source = (TEMPLATES / file).read_text("utf-8")
        out[name] = load(copy_gguf(TINY_LLAMA, tmp_path_factory.mktemp(name) / "m.gguf",
                                   set_keys={"tokenizer.chat_template": source}), n_ctx=1024)
    return out


@pytest.mark.parametrize("name", ["v31", "glm5"])
def test_think_off_asks_a_template_with_the_switch_not_to_think(switchable, name):
    """V3.1 and GLM-5 think by default (`enable_thinking` true, as llama.cpp asks: V3.1's own default is
    not to); with think off the prompt closes the thinking before the answer, and an answer is all answer."""
    model = switchable[name]
    on = conversation(model)
    assert on.prefs.opens_thinking
    script(on, ANSWERS[0])
    on.ask("How many?")
    opened = on.prompt.tok.encode("<think>", special=True)[-1]
    assert model.cache.token_ids()[on.transcript.turns[-1].first - 1] == opened
    assert split(on.transcript.turns[-1].text, on.prefs.opens_thinking) == ("First thought: twelve.", "It is 12.")
    off = conversation(model, think="off")
    assert not off.prefs.opens_thinking
    script(off, "Twelve.")
    off.ask("How many?")
    prompt = off.prompt.tok.decode(model.cache.token_ids()[: off.transcript.turns[-1].first], special=True)
    assert prompt.endswith("</think>")
    assert split(off.transcript.turns[-1].text, off.prefs.opens_thinking) == (None, "Twelve.")


def test_think_across_on_and_off_waits_for_the_next_conversation_and_a_resume_keeps_the_saved_switch(
        switchable, tmp_path):
    """A conversation's prompts were made with one switch: /set think off after its first answer waits for
    /new (the display modes change at once); reopened with --think off, it goes on as it was saved."""
    model, store = switchable["v31"], Store(tmp_path / "s")
    app = Recorder(conversation(model, store, "t"))
    script(app.conv, ANSWERS[0], ANSWERS[1])
    run(app, "How many?")
    said = run(app, "/set think off")
    assert said == ["think = off from the next conversation (/new starts one): this one was made with thinking"]
    assert app.conv.prefs.settings.think == "fold" and "think (next)   off" in run(app, "/show")
    assert run(app, "/set nothink") == ["colichat: did you mean /set think off? (it asks a model with the switch "
                                        "not to think)"]
    assert run(app, "/set think show") == ["think = show"] and "think (next)" not in "".join(run(app, "/show"))
    run(app, "/set think off")
    app.conv.close()
    again = Conversation(model, Settings(temperature=0, draft=0, think="off"), store=store, pinned={"think"})
    again.resume("t")
    assert again.prefs.settings.think == "show" and again.prefs.opens_thinking and again.prefs.pending_think == "off"
    script(again, ANSWERS[1])
    again.ask("Which fruit?")  # read with the switch it was made with: the prompt opens the thinking
    assert split(again.transcript.turns[-1].text, True)[0] == "Second thought: apples."
    again.new()
    assert again.prefs.settings.think == "off" and not again.prefs.opens_thinking
    again.close()


def test_exports_fold_the_thinking_in_a_details_block_with_or_without_the_model(r1, tmp_path, monkeypatch):
    """/export and `colichat --export` (which reads no model: the session says whether its answers
    begin inside the thinking) give the same Markdown; an answer cut while thinking is all thinking."""
    store = Store(tmp_path / "s")
    conv = conversation(r1, store, "e", think="hide")
    script(conv, ANSWERS[0])
    conv.ask("How many?")
    conv.set_option("max_tokens", 12)
    long = "Second thought: this goes on too long"
    script(conv, long)
    conv.ask("And?")
    cut = conv.prompt.tok.decode(conv.prompt.tok.encode(long)[:12])
    here = markdown("e", "m", [(t.role, t.text) for t in conv.transcript.turns], None, conv.prefs.opens_thinking)
    assert ("## Assistant\n\n<details><summary>Thinking</summary>\n\nFirst thought: twelve.\n\n</details>\n\n"
            "It is 12.\n") in here
    assert here.endswith(f"## Assistant\n\n<details><summary>Thinking</summary>\n\n{cut.strip()}\n\n</details>\n")
    conv.close()
    [sidecar] = (tmp_path / "s").glob("*/e.json")
    assert json.loads(sidecar.read_text("utf-8"))["sampler"]["opens_thinking"] is True
    saved, warnings, _ = export_saved(store, None, "e")
    assert saved.split("\n", 3)[3] == here.split("\n", 3)[3] and not warnings  # (below the date line)


def test_shown_thinking_is_dim_and_the_answer_starts_on_a_row_of_its_own():
    screen = Screen(lambda: (40, 10), dim=True)
    out = screen.answer("Let me see", thinking=True) + screen.answer(" it", thinking=True) + screen.answer("Yes.")
    assert out == f"{DIM}Let me see{PLAIN}{DIM} it{PLAIN}\nYes."
    screen.end_answer()
    assert screen.redraw().endswith(f"{DIM}Let me see it{PLAIN}\r\nYes.\r\n")



@pytest.mark.process
def test_on_a_terminal_folded_thinking_is_one_dim_line_and_shown_thinking_dim_text(colichat_home, tmp_path):
    """The real terminal (tmux): the status line that counts the thinking gives way to one dim line, the
    thinking's own text shows nowhere; with /set think show it streams dim, and the same line ends it.
    (The tiny model under R1's template never writes </think>: all it writes is thinking.)"""

    from tmux_helpers import rows_after, start_colichat, visible

    source = (TEMPLATES / TEMPLATE_FILES["r1"][0]).read_text("utf-8")
    path = copy_gguf(TINY_LLAMA, tmp_path / "r1.gguf", set_keys={"tokenizer.chat_template": source})
    t = start_colichat(colichat_home, "--model", str(path), "--temperature", "0", "--max-tokens", "30")
    try:
        t.wait_for(lambda s: "Type a message" in s, 120, "the prompt")
        t.type("Think")
        t.keys("Enter")
        t.wait_for(lambda s: "[30 tokens, 30 thinking, " in s and s.rstrip().endswith(">"), 120, "the footer")
        assert rows_after(visible(t, joined=True), "Think")[0] == "thinking (30 tokens)"  # and nothing else
        styled = t.run("capture-pane", "-p", "-e", "-J")
        assert "\x1b[2mthinking (30 tokens)" in styled and "thinking ..." not in t.screen()
        t.type("/set think show")
        t.keys("Enter")
        t.wait_for(lambda s: "think = show" in s and s.rstrip().endswith(">"), 120, "the setting")  # (typed ahead,
        t.type("Again")  # a line would wait at the prompt unsent)
        t.keys("Enter")
        t.wait_for(lambda s: s.count("30 thinking, ") == 2 and s.rstrip().endswith(">"), 120, "the second footer")
        rows = rows_after(visible(t, joined=True), "Again")
        assert rows[-1] == "thinking (30 tokens)" and len(rows) >= 2 and rows[0].strip()
        styled = t.run("capture-pane", "-p", "-e", "-J").split("> Again", 1)[1]
        assert styled.lstrip("\n").startswith("\x1b[2m")  # the thinking's text, dim
    finally:
        t.close()
