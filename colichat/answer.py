"""One exchange's forward passes: the prompt read (in steps, a stop honoured between them), then the
answer's tokens generated, streamed as text as they come, a thinking model's thinking sorted out.

What chat.Conversation.ask runs (engine/generate.py makes the tokens, thinking.py tells thinking
from answer); it reads the conversation's model, settings, clock and stop_requested.
"""

from __future__ import annotations

from .engine.generate import Generation
from .engine.speculative import PromptLookup
from .errors import ChatError
from .report import TurnStats
from .thinking import Splitter

# A prompt longer than PROMPT_STEPPED is read PROMPT_STEP tokens at a time: progress is shown and a
# stop request is honoured between steps. (The engine cuts each step again by its PREFILL_CHUNK, a
# bound on memory; SmolLM2 reads a 1024-token prompt as fast in steps of 256 as of 512, within 2%.)
PROMPT_STEP, PROMPT_STEPPED = 256, 512


def prefill(conv, ids: list[int], on_progress):
    """Read the prompt `ids` into `conv`'s cache (-> the last row's logits). Long prompts go in steps
    (PROMPT_STEP): progress can be shown, and a stop request drops the message instead of waiting
    for the whole prompt."""
    step = PROMPT_STEP if len(ids) > PROMPT_STEPPED else len(ids)
    if on_progress:
        on_progress(0, len(ids))
    for i in range(0, len(ids), step):
        logits = conv.model.prefill(ids[i : i + step], all_logits=False)[-1]
        conv.clock.tick()
        if on_progress and step < len(ids):
            on_progress(min(i + step, len(ids)), len(ids))
        if conv.stop_requested and i + step < len(ids):
            raise ChatError("interrupted while reading the message; it was not sent")
    return logits


def _draft(conv) -> int:
    """Drafts per pass. Speculation relies on a pass giving decode's exact rows; llama.cpp numerics
    compute a batch differently from single tokens (Model.exact_passes), so they decode one token
    at a time."""
    return conv.settings.draft if conv.model.exact_passes else 0


def _sorted(conv, on_text, on_think, stats: TurnStats):
    """The callback `generate` gives each token's text to (and, `end`, the text left at the end of
    the answer): as it is without `on_think`, else thinking to on_think (its tokens counted in
    stats.thinking) and the answer to on_text."""
    if on_think is None:
        return on_text and (lambda piece, end=False: piece and on_text(piece))
    split = Splitter(conv.prefs.opens_thinking)

    def sort(piece: str, end: bool = False) -> None:
        was = split.thinking
        parts = split.feed(piece) + (split.end() if end else [])
        if not end and (was or split.thinking):
            stats.thinking += 1
            parts = parts if any(thinking for thinking, _ in parts) else [(True, "")] + parts
        stats.still_thinking = split.thinking  # (an answer that ends so was cut short)
        for thinking, text in parts:
            if thinking:
                on_think(text, stats.thinking)
            elif text and on_text:
                on_text(text)

    return sort


def generate(conv, logits, stats: TurnStats, on_text=None, on_think=None) -> tuple[str, TurnStats]:
    """The answer of `conv` (chat.Conversation) after a prompt whose last row gave `logits`, its text
    streamed through on_text (and a thinking model's thinking through on_think: _sorted), counted in
    `stats`. `conv.stop_requested` ends it: what was shown stays, in the cache too; a token being
    computed when the stop came is dropped, and an answer stopped before its first token is none."""
    on_text = _sorted(conv, on_text, on_think, stats)
    stream = conv.tok.stream()
    pieces: list[str] = []
    conv.clock.start()
    drafts = [PromptLookup()] + ([conv.model.mtp] if conv.model.mtp is not None else [])
    gen = Generation(conv.model, logits, conv.prefs.sampler, conv.tok.eog_ids, conv.settings.max_tokens,
                     drafts=drafts, draft=_draft(conv))  # (the penalty's window: the sampler's)
    stats.stopped = "interrupt"
    tokens, first = iter(gen), conv.model.cache.length
    try:
        while not conv.stop_requested or stats.generated == conv.settings.max_tokens:
            tok = next(tokens, None)  # the token is in the cache before it is shown
            if tok is None:
                stats.stopped = gen.stopped
                break
            if conv.stop_requested:  # asked to stop while it was computed: neither shown nor kept
                break
            stats.generated += 1
            piece = stream.push(tok.id)
            pieces.append(piece)
            if on_text:
                on_text(piece)
            conv.clock.tick()
    finally:
        tokens.close()  # a stop inside a batched pass drops the tokens not shown
        cut = stream.pending_tokens if stats.stopped == "interrupt" else 0  # nor those of a part of a character
        stats.generated -= cut
        stats.thinking = min(stats.thinking, stats.generated)
        if conv.model.cache.length > first + stats.generated:  # and the one computed after a stop
            conv.model.cache.truncate(first + stats.generated)
    if stats.stopped == "interrupt" and not stats.generated:  # nothing shown: as if it was never sent
        raise ChatError("interrupted before the answer began; the message was not sent")
    tail = stream.flush() if not cut else ""
    pieces.append(tail)
    if on_text:
        on_text(tail, end=True)
    stats.decode_s = conv.clock.elapsed()
    stats.drafted, stats.accepted = gen.n_drafted, gen.n_accepted
    if len(drafts) > 1:  # which source the drafts came from
        stats.by_source = {name: tuple(c) for name, c in gen.by_source.items() if c[0]}
    return "".join(pieces), stats

