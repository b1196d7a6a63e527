"""A stop request as a value (engine/cancel.py): Ctrl-C acts at the engine's next safe point (before a
layer, between routed-expert fills) on any model, and what was not finished is not kept; a prefill shows
it moves (tokens, rate, time left) at every layer; the experts' warm start waits while colichat answers.

Slow models are tiny ones with an injected slow layer: what is counted is the work done after the stop
(layers, expert fills), never a time."""

from __future__ import annotations

import io
import os
import signal
import threading

import pytest
from conftest import TINY

from colichat.conversation.chat import ChatError, Conversation, Settings
from colichat.conversation.report import progress
from colichat.engine import load
from colichat.engine.cancel import Cancel, Cancelled
from colichat.terminal import app as app_mod
from colichat.terminal.app import App
from colichat.terminal.streams import StatusLine

PROMPT = [5, 17, 42, 99, 123, 7, 64, 200, 33, 150, 11, 80]


def slowed(model, on_layer):
    """The model's layers call on_layer(l) first (an injected slow layer: what it does decides)."""
    layer = model.fwd.layer

    def slow(l, *args, **kwargs):
        on_layer(l)
        return layer(l, *args, **kwargs)

    model.fwd.layer = slow
    return model


def test_a_stop_during_a_layer_ends_the_pass_before_the_next_and_keeps_none_of_its_rows():
    model = load(str(TINY / "llama.gguf"), n_ctx=64)
    model.prefill(PROMPT[:4])
    before = (model.cache.length, model.cache.records[: model.cache.length].tobytes())
    cancel, layers = Cancel(), []

    def on_layer(l):
        layers.append(l)
        if len(layers) == 2:  # Ctrl-C while the second layer computes
            cancel.set()

    with pytest.raises(Cancelled):
        slowed(model, on_layer).prefill(PROMPT[4:], cancel=cancel)
    assert layers == [0, 1]  # the layer under way ends; no other starts
    assert (model.cache.length, model.cache.records[: model.cache.length].tobytes()) == before
    del model.fwd.layer
    fresh = load(str(TINY / "llama.gguf"), n_ctx=64)
    assert model.prefill(PROMPT[4:]).tobytes() == (fresh.prefill(PROMPT[:4]), fresh.prefill(PROMPT[4:]))[1].tobytes()


def test_a_stop_inside_a_layer_acts_before_the_next_block_of_a_product(monkeypatch):
    """A dense layer of a big model is a few long matrix products: the stop is checked before each of
    their row blocks (the products a prompt's pass computes by blocks), so no product begins after it."""
    import colichat.engine.architectures.llama as llama

    model = load(str(TINY / "llama.gguf"), n_ctx=128)
    cancel, told, before, after, layers = Cancel(), [], [], [], []
    linear = llama.linear

    def counted(*args):
        (after if cancel.requested else before).append(1)
        return linear(*args)

    def progress(done):
        told.append(done)
        if len(told) == 2:  # the first safe point inside layer 0 (the first was before it)
            cancel.set()

    monkeypatch.setattr(llama, "linear", counted)
    with pytest.raises(Cancelled):
        slowed(model, layers.append).prefill(list(range(3, 40)), cancel=cancel, progress=progress)
    assert told == [0.0, 0.0] and layers == [0] and len(before) == 1 and after == []


def test_a_stop_in_a_prompt_of_several_chunks_keeps_none_of_them(monkeypatch):
    monkeypatch.setattr("colichat.engine.model.PREFILL_CHUNK", 4)
    model = load(str(TINY / "llama.gguf"), n_ctx=64)
    cancel, layers = Cancel(), []

    def on_layer(l):
        layers.append(l)
        if len(layers) == 2 * model.cfg.n_layer + 1:  # in the third chunk
            cancel.set()

    with pytest.raises(Cancelled):
        slowed(model, on_layer).prefill(PROMPT, cancel=cancel)
    assert model.cache.length == 0


def test_progress_is_told_at_every_safe_point_in_tokens_read():
    """At every layer (as a fraction of the pass) and again at the safe points inside it, then the end."""
    model = load(str(TINY / "llama.gguf"), n_ctx=64)
    told = []
    model.prefill(PROMPT, progress=told.append)
    n = model.cfg.n_layer
    assert sorted(set(told)) == [len(PROMPT) * l / n for l in range(n)] + [len(PROMPT)] and told == sorted(told)


def test_a_stop_between_routed_expert_fills_acts_before_the_next_fill(monkeypatch):
    """A MoE layer can be long (every expert a miss on a big model): the stop is checked between fills.
    Without an expert cache every use is a fill; the fills started after the stop are at most the ones
    under way on the filling threads. The slots stay consistent: the next pass gives the same bits."""
    name = str(TINY / "ds-v2-lite.gguf")
    model = load(name, n_ctx=64, expert_cache=0)
    cancel, fills, after = Cancel(), [], []
    preadv, reads = os.preadv, threading.local()

    def counted(*args):  # a fill reads its expert's three parts (gate, up, down), one preadv each, on one thread
        reads.n = getattr(reads, "n", 0) + 1
        if reads.n % 3 == 1:  # a fill begins
            (after if cancel.requested else fills).append(1)
            if len(fills) == 3:
                cancel.set()
        return preadv(*args)

    with monkeypatch.context() as patch:
        patch.setattr(os, "preadv", counted)
        with pytest.raises(Cancelled):
            model.prefill(PROMPT, cancel=cancel)
    assert model.cache.length == 0 and len(fills) == 3 and len(after) < model.experts.fill_threads
    assert model.prefill(PROMPT).tobytes() == load(name, n_ctx=64, expert_cache=0).prefill(PROMPT).tobytes()


def test_a_stop_between_resident_experts_acts_before_the_next_experts_product(monkeypatch):
    """With every expert resident (no fill), a long prefill's MoE layer is many expert products: the stop
    is checked before each. (The tiny model: one dense layer, then layers of 4 experts, all hit here.)"""
    import colichat.engine.ffn as ffn

    model = load(str(TINY / "ds-v2-lite.gguf"), n_ctx=64, expert_cache=64)
    model.prefill(PROMPT)
    model.reset()
    misses, cancel, calls, after = model.experts.misses, Cancel(), [], []
    swiglu = ffn.swiglu

    def counted(*args):
        (after if cancel.requested else calls).append(1)
        if len(calls) == 3:  # the second expert of the first MoE layer (the dense layer's FFN was the first)
            cancel.set()
        return swiglu(*args)

    monkeypatch.setattr(ffn, "swiglu", counted)
    with pytest.raises(Cancelled):
        model.prefill(PROMPT, cancel=cancel)
    assert after == [] and model.experts.misses == misses and model.cache.length == 0


def test_a_stop_inside_a_decode_pass_keeps_only_the_tokens_shown():
    model = load(str(TINY / "llama.gguf"), n_ctx=64)
    conv = Conversation(model, Settings(temperature=0, max_tokens=20, draft=0), save=False)
    cancel, shown, layers, after = Cancel(), [], [], []

    def on_layer(l):
        (after if cancel.requested else layers).append(l)
        if len(layers) == 3 * model.cfg.n_layer + 2:  # inside the third decode pass (after the prompt's)
            cancel.set()

    slowed(model, on_layer)
    answer, stats = conv.ask("hello", on_text=shown.append, cancel=cancel)
    assert after == [] and stats.stopped == "interrupt" and answer == "".join(shown) and stats.generated == 2
    assert model.cache.length == conv.transcript.turns[-1].last == conv.transcript.turns[-1].first + stats.generated


# --- Ctrl-C through the app, as the REPL takes it ----------------------------------------------------


class Shown(io.StringIO):
    """A terminal's stderr for a StatusLine: every line it shows, in order."""

    def isatty(self):
        return True


def app_on(conv, stream=None) -> App:
    status = StatusLine(stream or io.StringIO())
    status.tty = stream is not None
    return App(conv, interactive=False, status=status)


def test_ctrl_c_while_a_slow_layer_reads_the_message_drops_it_at_the_next_layer(capsys):
    """SIGINT arrives while the second layer of the message's prefill computes (a layer of a big model):
    the App's handler sets the input's Cancel, the pass ends before the third layer, the message is
    not sent and the conversation is as before."""
    model = load(str(TINY / "llama.gguf"), n_ctx=256)
    conv = Conversation(model, Settings(temperature=0, max_tokens=4), save=False)
    conv.ask("hello")
    before = (model.cache.length, list(conv.transcript.turns))
    app, layers, after = app_on(conv), [], []

    def on_layer(l):
        (after if app.cancel.requested else layers).append(l)
        if len(layers) == 2 and not after:
            os.kill(os.getpid(), signal.SIGINT)  # delivered to the main thread before the layer goes on

    old = signal.signal(signal.SIGINT, lambda signum, frame: app.interrupted())
    try:
        slowed(model, on_layer)
        app.handle("tell me about rivers")
    finally:
        signal.signal(signal.SIGINT, old)
        del model.fwd.layer
    assert after == [] and layers == [0, 1]
    assert "colichat: interrupted while reading the message; it was not sent" in capsys.readouterr().err
    assert (model.cache.length, conv.transcript.turns) == before
    app.handle("and now?")  # a new input, a new Cancel: it is answered
    assert len(conv.transcript.starts()) == 2


def test_a_prefill_shows_tokens_rate_and_time_left_once_a_second_has_passed(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(app_mod.time, "monotonic", lambda: clock[0])
    shown = Shown()
    app = app_on(None, shown)
    show = app.prefill_progress()
    show(0, 100)
    for done in (5, 10, 20):  # every layer tells it; the line waits for a second of reading
        clock[0] += 0.4
        show(done, 100)
    clock[0] += 0.1
    show(21, 100)  # within PROGRESS_EVERY of the last line: not drawn again
    lines = [line for line in shown.getvalue().split("\r\x1b[K") if line]
    assert lines == ["reading your message (100 tokens) ...",
                     "reading your message: 20/100 tokens, 16.7 tok/s, about 5 s left ..."]
    show(0, 40)  # a prefill begins again (the next exchange read again): its own count and rate
    assert shown.getvalue().endswith("reading your message (40 tokens) ...")


def test_the_progress_line_reads_as_a_person_expects():
    assert progress(57, 105, 22.0) == "57/105 tokens, 2.6 tok/s, about 19 s left"
    assert progress(0, 105, 3.0) == "0/105 tokens"
    assert progress(100, 5000, 40.0) == "100/5,000 tokens, 2.5 tok/s, about 32 min 40 s left"
    assert progress(105, 105, 40.0) == "105/105 tokens, 2.6 tok/s"


# --- the experts' warm start yields to an answer -----------------------------------------------------


def warm_model(tmp_path):
    """A tiny MoE model whose earlier run's expert use counts are kept: loading it starts a warm start."""
    name = str(TINY / "ds-v2-lite.gguf")
    first = load(name, n_ctx=64, expert_cache=64, cache_dir=tmp_path)
    first.prefill(PROMPT)
    first.keep_expert_usage()
    return name


def test_the_warm_start_waits_while_the_model_answers(tmp_path, monkeypatch):
    name = warm_model(tmp_path)
    preadv = os.preadv
    gate, started = threading.Event(), []

    def held(*args):  # the warmer's first fill waits, at its first read, until the test lets it go
        if threading.current_thread().name == "colichat-warm":
            started.append(1)
            gate.wait()
        return preadv(*args)

    monkeypatch.setattr(os, "preadv", held)
    try:
        model = load(name, n_ctx=64, expert_cache=64, cache_dir=tmp_path)
        e = model.experts
        assert model.warming() == (0, e.warming) and e.warming > 1
        with model.quiet():
            gate.set()  # the fill under way ends; the next waits for the answer's end
            e.warmer.join(0.5)
            assert e.warmer.is_alive() and e.warmed == 1 and model.warming() == (1, e.warming)
        e.warmer.join()
        assert e.warmed == e.warming and model.warming() is None
    finally:
        gate.set()


def test_the_answer_passes_run_quiet():
    """answer.py reads the prompt and generates the answer inside Model.quiet (the warm start waits)."""
    model = load(str(TINY / "ds-v2-lite.gguf"), n_ctx=128, expert_cache=64)
    conv = Conversation(model, Settings(temperature=0, max_tokens=3, draft=0), save=False)
    passes, prefill = [], model.prefill

    def watched(*args, **kwargs):
        passes.append(not model.experts.unpaused.is_set())
        return prefill(*args, **kwargs)

    model.prefill = watched
    conv.ask("hello")
    assert passes and all(passes) and model.experts.unpaused.is_set()


class WarmingConversation:
    """A conversation whose model's warm start has read 3 of its 40 experts, and that answers nothing."""

    class model:  # noqa: N801  (the Conversation's attribute)
        @staticmethod
        def warming():
            return 3, 40

    def ask(self, text, **kwargs):
        raise ChatError("no answer here")

    def resume(self, name, **kwargs):
        return f"resumed {name}"


def test_the_first_answer_says_the_warm_start_still_runs_and_the_next_does_not(capsys):
    app = app_on(WarmingConversation())
    app.handle("hello")
    app.handle("again")
    err = capsys.readouterr().err
    assert err.count("note: the expert cache is still being filled from earlier runs (3 of 40 experts read)") == 1
    assert err.index("note: the expert cache") < err.index("colichat: no answer here")


def test_the_first_answer_after_a_resume_says_the_warm_start_still_runs_again(capsys):
    app = app_on(WarmingConversation())
    for line in ("hello", "again", "/resume a", "after it", "and again"):
        app.handle(line)
    err = capsys.readouterr().err
    note = "note: the expert cache is still being filled from earlier runs (3 of 40 experts read)"
    assert err.count(note) == 2 and err.index("resumed a") < err.rindex(note), err


def test_a_moe_model_on_the_kernel_path_answers_can_be_stopped_and_has_no_warm_start(tmp_path):
    """The routed experts multiplied in the map (mapped_experts.MappedExperts) have nothing to warm or
    pause: an answer runs (Model.quiet), says no warm start, and a stop acts between experts there too."""
    from quantized_models import quantized_copy

    model = load(quantized_copy("ds-v2-lite", "Q8_0", tmp_path), n_ctx=128, kernels="numba")
    assert model.kernels == "numba" and model.warming() is None
    conv = Conversation(model, Settings(temperature=0, max_tokens=3, draft=0), save=False)
    assert conv.ask("hello")[1].generated
    cancel, told = Cancel(), []

    def progress(done):
        told.append(done)
        if len(told) == 40:
            cancel.set()

    with pytest.raises(Cancelled):
        model.prefill(PROMPT, cancel=cancel, progress=progress)
    # 40 safe points in 4 layers: one before each expert the calling thread takes (a small pass's experts are
    # shared out whole among the threads, and the calling thread takes about half of them)
    assert len(told) == 40 and max(told) <= 4 * len(PROMPT) / model.cfg.n_layer
