"""One exchange's forward passes: the prompt read (in steps), then the answer's tokens generated,
streamed as text as they come, a thinking model's thinking sorted out.

What chat.Conversation.ask runs (engine/generate.py makes the tokens, thinking.py tells thinking
from answer). They take what they use: the model, the sampler, a clock (stopwatch.Stopwatch), and a
cancel token (engine.cancel.Cancel) that the engine checks before every layer: a stop acts within a
layer's time on any model. While they run, the model's background work (the experts' warm start) waits.
"""

from __future__ import annotations

from ..engine.cancel import Cancel, Cancelled
from ..engine.generate import Generation
from ..engine.speculative import PromptLookup
from ..errors import ChatError
from .report import TurnStats
from .thinking import Splitter

# A prompt longer than PROMPT_STEPPED is read PROMPT_STEP tokens at a time (the engine cuts each step
# again by its PREFILL_CHUNK, a bound on memory; SmolLM2 reads a 1024-token prompt as fast in steps of
# 256 as of 512, within 2%). The steps fix how a prompt is cut, hence its cache rows' bits.
PROMPT_STEP, PROMPT_STEPPED = 256, 512


def prefill(model, ids: list[int], clock, cancel: Cancel, on_progress=None):
    """Read the prompt `ids` into the model's cache (-> the last row's logits). on_progress(done, total)
    is told the tokens read so far (a float: a step's layers count) at every layer; a stop (`cancel`)
    drops the message (ChatError) and the rows read for it."""
    step = PROMPT_STEP if len(ids) > PROMPT_STEPPED else len(ids)
    first, total = model.cache.length, len(ids)
    if on_progress:
        on_progress(0, total)
    with model.quiet():
        for i in range(0, total, step):
            progress = on_progress and (lambda done, i=i: on_progress(min(i + done, total), total))
            try:
                logits = model.prefill(ids[i : i + step], all_logits=False, cancel=cancel, progress=progress)[-1]
            except Cancelled:
                model.cache.truncate(first)
                raise ChatError("interrupted while reading the message; it was not sent") from None
            clock.tick()
    return logits


def _sorted(opens_thinking: bool, on_text, on_think, stats: TurnStats):
    """The callback `generate` gives each token's text to (and, `end`, the text left at the end of
    the answer): as it is without `on_think`, else thinking to on_think (its tokens counted in
    stats.thinking) and the answer to on_text."""
    if on_think is None:
        return on_text and (lambda piece, end=False: piece and on_text(piece))
    split = Splitter(opens_thinking)

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


def generate(model, logits, sampler, clock, cancel: Cancel, stats: TurnStats, max_tokens: int, draft: int = 0,
             opens_thinking: bool = False, on_text=None, on_think=None) -> tuple[str, TurnStats]:
    """The answer after a prompt whose last row gave `logits` (the model's tokenizer makes its text),
    at most `max_tokens`, streamed through on_text (and a thinking model's thinking, `opens_thinking`
    if the prompt leaves it inside it, through on_think: _sorted), counted in `stats`. `draft`: drafts
    per pass (speculative decoding; 0 where the model's passes are not exact: llama.cpp numerics compute
    a batch otherwise than single tokens). `cancel` ends it: what was shown stays, in the cache too; a
    token being computed when the stop came is dropped, and an answer stopped before its first token is
    none (ChatError)."""
    on_text = _sorted(opens_thinking, on_text, on_think, stats)
    stream = model.tokenizer.stream()
    pieces: list[str] = []
    clock.start()
    drafts = [PromptLookup()] + ([model.mtp] if model.mtp is not None else [])
    gen = Generation(model, logits, sampler, model.tokenizer.eog_ids, max_tokens, drafts=drafts,
                     draft=draft if model.exact_passes else 0, cancel=cancel)  # (the penalty's window: the sampler's)
    stats.stopped = "interrupt"
    tokens, first = iter(gen), model.cache.length
    try:
        with model.quiet():
            while not cancel.requested or stats.generated == max_tokens:
                try:
                    token = next(tokens, None)  # the token is in the cache before it is shown
                except Cancelled:  # asked to stop inside a pass: nothing of it is kept
                    break
                if token is None:
                    stats.stopped = gen.stopped
                    break
                if cancel.requested:  # asked to stop while it was computed: neither shown nor kept
                    break
                stats.generated += 1
                piece = stream.push(token.id)
                pieces.append(piece)
                if on_text:
                    on_text(piece)
                clock.tick()
    finally:
        tokens.close()  # a stop inside a batched pass drops the tokens not shown
        cut = stream.pending_tokens if stats.stopped == "interrupt" else 0  # nor those of a part of a character
        stats.generated -= cut
        stats.thinking = min(stats.thinking, stats.generated)
        if model.cache.length > first + stats.generated:  # and the one computed after a stop
            model.cache.truncate(first + stats.generated)
    if stats.stopped == "interrupt" and not stats.generated:  # nothing shown: as if it was never sent
        raise ChatError("interrupted before the answer began; the message was not sent")
    tail = stream.flush() if not cut else ""
    pieces.append(tail)
    if on_text:
        on_text(tail, end=True)
    stats.decode_s = clock.elapsed()
    stats.drafted, stats.accepted = gen.n_drafted, gen.n_accepted
    if len(drafts) > 1:  # which source the drafts came from
        stats.by_source = {name: tuple(c) for name, c in gen.by_source.items() if c[0]}
    return "".join(pieces), stats
