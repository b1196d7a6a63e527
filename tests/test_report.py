"""What the user is told after an answer and by /stats (report.py): a footer that fits one line of 80
columns on the usual answer, what matters only now and then shown only then, the rest in /stats, and
/stats that never describes an answer /rewind removed."""

from __future__ import annotations

import pytest
from cli_helpers import TINY_LLAMA

from colichat.conversation.chat import Conversation, Settings
from colichat.conversation.report import SLOW_READ_S, TurnStats, footer, stats_lines
from colichat.engine import load
from colichat.persist import Store


@pytest.fixture(scope="module")
def model():
    return load(TINY_LLAMA, n_ctx=2048)


def conversation(model, tmp_path, name: str = "a-usual-name") -> Conversation:
    model.reset()
    return Conversation(model, Settings(temperature=0, max_tokens=8), store=Store(tmp_path), session_name=name)


def test_the_usual_footer_is_one_line_of_80_columns_with_tokens_speed_context_left_and_where_saved(model, tmp_path):
    conv = conversation(model, tmp_path)
    _, stats = conv.ask("What is the capital of France?")
    stats.generated, stats.decode_s, stats.prefill_s, stats.stopped = 512, 51.2, 0.1, "eog"  # a long answer
    line = footer(conv, stats)
    left = 2048 - conv.model.cache.length
    assert line == f"[512 tokens, 10.0 tok/s, {left} of 2048 context left; saved to a-usual-name]"
    assert len(line) <= 80
    conv.close()


def test_a_reused_prompt_says_reused_not_0_tok_s_and_a_slow_read_shows_its_speed(model, tmp_path):
    conv = conversation(model, tmp_path)
    _, stats = conv.ask("Hello")
    quick = TurnStats(prompt_tokens=1, prefill_s=0.5, generated=7, decode_s=1.0, reused=577, saved=True)
    line = footer(conv, quick)
    assert ", reused 577 tokens, " in line and "prompt" not in line and line.count("tok/s") == 1
    slow = TurnStats(prompt_tokens=3000, prefill_s=SLOW_READ_S * 6, generated=7, decode_s=1.0, saved=True)
    assert ", prompt 3,000 at 250 tok/s, " in footer(conv, slow)
    conv.close()


def test_drafts_and_the_prompt_speed_are_in_stats_not_in_the_footer(model, tmp_path):
    conv = conversation(model, tmp_path)
    _, stats = conv.ask("Hello")
    stats.drafted, stats.accepted, stats.by_source = 15, 4, {"lookup": (15, 4)}
    stats.reused, stats.prefill_s = 40, 0.1
    assert "draft" not in footer(conv, stats)
    lines = stats_lines(conv)
    assert lines[-2].startswith("last answer: ") and "; prompt: 40 tokens reused, " in lines[-2]
    assert lines[-1] == "drafts (tokens guessed ahead, then checked in one pass): 4 of 15 kept (27%; lookup 4 of 15)"
    conv.close()


def test_stats_after_rewind_does_not_show_the_removed_answer(model, tmp_path):
    conv = conversation(model, tmp_path)
    conv.ask("Hello")
    conv.ask("And again")
    assert any(line.startswith("last answer: ") for line in stats_lines(conv))
    conv.rewind(1)
    lines = stats_lines(conv)
    assert not any(line.startswith(("last answer: ", "drafts")) for line in lines)
    assert lines[0].startswith(f"context: {conv.model.cache.length} of 2048 tokens, 1 exchange")
    conv.close()


def test_forget_progress_and_its_result_count_the_same_tokens(model, tmp_path):
    conv = conversation(model, tmp_path)
    for q in ("One " * 40, "Two " * 40, "Three " * 40):
        conv.ask(q)
    seen = []
    said = conv.forget(1, on_progress=lambda done, total: seen.append((done, total)))
    assert f"{conv.model.cache.length} tokens read again" in said
    assert seen[-1][1] == conv.model.cache.length  # the last total shown is the result's count
    assert [done for done, _ in seen] == sorted(done for done, _ in seen)  # one count, never starting again
    conv.close()
