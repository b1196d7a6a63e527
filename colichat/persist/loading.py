"""Loading a session: its files to a LoadResult, and every rule of what a damaged session keeps.

    src = Source(directory, name, ident, layout)      # the files, and the model that reads them
    res = load(src, fd, cache, ctx_limit=None, detokenize=None, exchanges=False, ctx_most=None)
    res = load_text_only(src, damage, cache=None)     # no KV file, or none a load can use
    res = read_saved(directory, name)                 # what opening NAME keeps, without its model (--export)
    n = tokens_to_load(directory, name)               # the tokens opening NAME reads (before the model loads)

Refused (SessionError, the cache untouched): a sidecar that is not colichat's, of a newer colichat
or of other weights; a KV file of another kind of model or shape; rows rotated with other rope factors;
more tokens than the context. Dropped, with a warning each, from the first bad one on: turns past
the records present, a turn whose checksum or token ids are wrong, records no turn covers, a last
message without its answer (`exchanges`). A KV file that is not this conversation's (its header
disagrees with its own sidecar) or is not there: no records, the text of the intact exchanges read
again (LoadResult.unread). What the sidecar committed and the file does not show yet (a staged
exchange, an unfinished cut: pending.py) is read as done. Nothing here writes a file: what a load
drops stays on disk until the writer's (session.py) next save rewrites nrec and the sidecar to the
kept prefix (FORMAT.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass, field, replace

import numpy as np

from ..units import count
from .kvfile import (
    CODEC_OF_MAGIC,
    HEADER_SIZE,
    KIND_OF_MAGIC,
    CacheLayout,
    SavedRecords,
    SessionError,
    lstat_regular,
    open_file,
    oserror_text,
    read_header,
    read_records,
    unusable_header,
)
from .locks import reading
from .names import KV_EXT, SIDECAR_EXT, interrupted_create
from .pending import Pending, pending_of
from .sidecar import (
    FORMAT_VERSION,
    MAX_SIDECAR_BYTES,
    Turn,
    doc_check,
    document,
    drop_unanswered,
    kv_gone,
    lineage,
    parse_turns,
    readable_again,
    span,
    turn_crc,
)

# Tokens of context a reopened conversation has left at least, to go on with a short exchange: the
# size a refusal of too small a context asks for (more_context), and below which the chat says the
# context is nearly full (chat.FULL_BELOW).
REOPEN_ROOM = 16


@dataclass
class LoadResult:
    name: str
    tokens: int
    turns: list[Turn]
    elapsed_ms: float
    warnings: list[str] = field(default_factory=list)  # one line per thing dropped, and why
    sampler: dict = field(default_factory=dict)
    # the dropped turns whose text is intact (sidecar.readable_again): whole exchanges, after `turns`
    unread: list[Turn] = field(default_factory=list)
    # what the writer goes on from (Session.load):
    crcs: list[int] = field(default_factory=list)  # each kept turn's record CRC
    layout: CacheLayout | None = None  # the model's, in the codec of the file read (the cache's now)
    sidecar: bool = False  # whether there was one: sampler, created, parent and branch are its own
    created: str | None = None  # None: the sidecar records no time
    parent: str | None = None  # a fork's (sidecar.lineage)
    branch: int | None = None
    unread_entries: list[dict] = field(default_factory=list)  # the sidecar's entries of `unread`
    text_only: bool = False  # no records read: no KV file, or none this load can use (`kv_damage`)
    kv_damage: str | None = None
    pending: Pending | None = None  # what the sidecar committed that the file does not show yet (pending.py)
    kv_gone: str | None = None  # "was pruned" (--prune-kv) or "is not there": no KV file, all the text read again
    emptied: bool = False  # emptied in place by /reset (the sidecar's "emptied"): a conversation with no exchange

    def summary(self) -> str:
        """The line the chat program prints to stderr after a resume."""
        return (f"resumed {count(self.tokens, 'token')}, {count(len(self.turns), 'turn')} from {self.name} "
                f"in {self.elapsed_ms:.0f} ms, no re-prefill")


@dataclass(frozen=True)
class Source:
    """A session's files as a load reads them, and the model they are read for."""

    directory: str
    name: str
    ident: dict  # the model's identity (identity.model_identity); without the model, the sidecar's own
    layout: CacheLayout | None  # the model's cache layout; None without the model

    @property
    def kv_path(self) -> str:
        return os.path.join(self.directory, self.name + KV_EXT)

    @property
    def json_path(self) -> str:
        return os.path.join(self.directory, self.name + SIDECAR_EXT)


def more_context(name: str, n: int, ctx: int, most: int | None = None) -> str:
    """The refusal of session NAME's `n` tokens in a context of `ctx`, and what reopens it: the --ctx
    with room to go on (exactly `n` would reopen it full), where the model takes it (`most`: its
    trained context, when known), else the model's maximum, else nothing: --export reads it."""
    if most is None or n + REOPEN_ROOM <= most:
        return (f"session {name} holds {n} tokens, more than the context of {ctx}: start colichat with "
                f"--ctx {n + REOPEN_ROOM} or more to reopen it with room for an exchange")
    if n <= most:
        room = f"with room for {count(most - n, 'token')} more" if n < most else "full (/rewind makes room)"
        return (f"session {name} holds {n} tokens, more than the context of {ctx}: start colichat with "
                f"--ctx {most}, this model's maximum, to reopen it {room}")
    return (f"session {name} holds {n} tokens, more than this model's maximum context of {most}: it cannot "
            f"be reopened with this model; colichat --export {name} prints it, and a new conversation "
            "goes on without it")


# ---- the read-only entry points (no writer's lock: they read between two saves, locks.reading) ----


def what_opens(base: str, missing: str) -> tuple[bool, str | None]:
    """(text only, damage) of the session at `base`: whether it has no KV file (its text is read again),
    and why its KV header cannot be used (read its text instead), or None. SessionError(missing) where
    there is nothing to open (no files, or only what an interrupted create leaves)."""
    text_only = lstat_regular(base + KV_EXT, "session file") is None
    side = lstat_regular(base + SIDECAR_EXT, "sidecar")
    if text_only and (side is None or interrupted_create(base)):
        raise SessionError(missing)
    return text_only, None if text_only or side is None else unusable_header(base + KV_EXT)


def read_saved(directory, name: str) -> LoadResult:
    """What opening session NAME would keep, without its model (for an export): the same checks
    over its files, the same warnings, the same refusals (its model is the one its sidecar
    names; that the sidecar belongs in this directory is the caller's to check). Modifies nothing.
    A session without a sidecar has no text: refused."""
    base = os.path.join(str(directory), name)
    text_only, damage = what_opens(base, f"no session named {name} (colichat --sessions lists them)")
    src = Source(str(directory), name, _saved_model(base + SIDECAR_EXT), None)
    if text_only or damage:
        return load_text_only(src, damage)
    fd = open_file(src.kv_path, "session file", os.O_RDONLY)
    try:
        with reading(fd, src.kv_path, name):
            header, size = read_header(fd, src.kv_path)
            doc = read_sidecar(src)
            if doc is None:
                raise SessionError(f"session {name} has no sidecar, so no text to export: colichat --session "
                                   f"{name} with its model loads its cache as one imported turn, which /export "
                                   "writes")
            why = header_disagreement(doc, header)
            if why:
                return load_text_only(src, why)
            layout = CacheLayout.from_header(header)
            records = (size - HEADER_SIZE) // max(1, layout.record_bytes)  # (a staged exchange lies past nrec)
            return load(replace(src, layout=layout), fd, SavedRecords(layout, records), exchanges=True)
    finally:
        with contextlib.suppress(OSError):  # (a descriptor only read from: closing it loses nothing)
            os.close(fd)


def tokens_to_load(directory, name: str) -> int | None:
    """The tokens opening session NAME reads, the number `load` holds against its context, from the
    files alone (before the model loads); None where they cannot say (opening says why)."""
    src, fd = Source(str(directory), name, {}, None), None
    try:
        header = None
        if lstat_regular(src.kv_path, "session file") is not None and not unusable_header(src.kv_path):
            fd = open_file(src.kv_path, "session file", os.O_RDONLY)
            with reading(fd, src.kv_path, name):
                header, size = read_header(fd, src.kv_path)
                doc = _sidecar_as_it_is(src.json_path)
        else:
            doc = _sidecar_as_it_is(src.json_path)
        if header is None or isinstance(doc, dict) and isinstance(doc.get("layout"), dict) \
                and header_disagreement(doc, header):
            turns = readable_again(doc, []) if doc is not None else []  # no records: all read again
            return turns[-1].last if turns else None
        return listed_prefix(doc, header.nrec, size, [], CacheLayout.from_header(header).record_bytes)[2]
    except (SessionError, OSError, ZeroDivisionError):  # (a header of records of no bytes)
        return None
    finally:
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


def saved_rope_factors(src: Source) -> str | None:
    """The rope factors the session's cache rows were rotated with (the sidecar's
    model.rope_factors), None if it records none (a model whose rope does not depend on the
    context size, an older colichat, no sidecar). SessionError for a damaged sidecar or value."""
    doc = read_sidecar(src)
    return None if doc is None else _rope_factors_of(doc, src.json_path)


# ---- loading into a cache -----------------------------------------------------------------------


def load(src: Source, fd: int, cache, ctx_limit: int | None = None, detokenize=None, exchanges: bool = False,
         ctx_most: int | None = None) -> LoadResult:
    """Fill `cache` with the longest valid prefix of whole turns of the KV file open as `fd`; modifies
    no file.

    Refuses (SessionError, cache untouched) a file of another model, kind or shape, other
    weights (sidecar fingerprint), rows rotated with other rope factors than the ident's
    ("rope_factors", where the model has them), or more saved tokens than ctx_limit (the cache
    capacity by default): a conversation that fills its context reopens, full. Damage drops
    turns from the first bad one on, with a warning each.
    `detokenize(ids) -> str` names the text of a cache saved without a sidecar (one turn).
    `exchanges`: keep whole exchanges (the chat program's unit): a last user turn, whose answer
    was dropped, is dropped too. `ctx_most`: the model's largest context (its trained one), which
    the refusal of too many tokens holds its suggestion to.
    """
    t0 = time.perf_counter()
    src.layout.check_cache(cache)
    header, size = read_header(fd, src.kv_path)
    doc = read_sidecar(src)  # first: the model that saved it tells damage from another model's file
    kind = KIND_OF_MAGIC[header.magic]
    if doc is not None and (kind != src.layout.kind or header.mismatches(src.layout)):
        why = header_disagreement(doc, header)
        if why:  # not this conversation's records: its text is read again
            return load_text_only(src, why, cache, ctx_limit, ctx_most)
    if kind != src.layout.kind:
        raise SessionError(f"session {src.name} holds a cache of another kind of model "
                           f"(magic {header.magic!r}, this model needs {src.layout.magic!r}); "
                           "start a new session with /reset")
    bad = header.mismatches(src.layout)
    if bad:
        raise SessionError(f"session {src.name} was saved by another model ({', '.join(bad)}); "
                           "start a new session with /reset")
    if doc is not None:
        _check_rope_factors(src, doc)
    warnings: list[str] = []
    if doc is not None and doc.get("settings damaged"):
        warnings.append("the sidecar's settings do not match their checksum: the saved sampler "
                        "settings were not restored")
        if src.ident.get("rope_factors") and "rope_factors" not in doc["model"]:
            warnings.append("the sidecar does not say which rope factors the cache rows were rotated "
                            f"with: assumed {src.ident['rope_factors']!r}, this model's")
    elif doc is not None and doc["format"] == 1:
        warnings.append("the sidecar was written by an older colichat: its turn texts carry no "
                        "checksum (the next save adds them)")
    # a conversation keeps the codec it was saved in: the cache takes the file's
    layout = src.layout.with_codec(CODEC_OF_MAGIC[header.magic], getattr(cache, "row_width", 0))
    turns, crcs, n, pend = listed_prefix(doc, header.nrec, size, warnings, layout.record_bytes)
    ctx = cache.capacity if ctx_limit is None else min(ctx_limit, cache.capacity)
    if n > ctx:
        raise SessionError(more_context(src.name, n, ctx, ctx_most))
    codec = cache.codec
    try:
        cache.set_codec(layout.codec)
        for first, last, at in (pend or Pending()).spans(n):  # (a staged exchange: from where it lies)
            read_records(fd, cache.raw(first, last), layout.record_bytes, at)
        cache.loaded(n)
    except (OSError, SessionError) as e:
        cache.set_length(0)
        cache.set_codec(codec)
        why = oserror_text(e) if isinstance(e, OSError) else str(e)
        raise SessionError(f"could not read session {src.name} ({why}); the cache was cleared") from None
    if doc is not None:
        n = _verify(cache, turns, crcs, warnings, layout.vocab)
        if exchanges:
            n = drop_unanswered(turns, crcs, warnings)
    else:
        n = _check_tokens(cache, n, warnings, layout.vocab)
        warnings.append(f"no sidecar {src.name}{SIDECAR_EXT}: loaded the {n} records as one imported turn "
                        "(no weights fingerprint to check)" if n else f"no sidecar {src.name}{SIDECAR_EXT}")
        if n:
            text = "" if detokenize is None else str(detokenize(cache.tokens[:n].tolist()))
            turns, crcs = [Turn("imported", text, 0, n)], [turn_crc(cache, Turn('imported', '', 0, n))]
    cache.set_length(n)
    ms = (time.perf_counter() - t0) * 1000
    if doc is None:
        return LoadResult(src.name, n, list(turns), ms, warnings, crcs=crcs, layout=layout)
    unread = readable_again(doc, turns)
    return LoadResult(src.name, n, list(turns), ms, warnings, unread=unread, crcs=crcs, layout=layout,
                      unread_entries=doc["turns"][len(turns): len(turns) + len(unread)] if unread else [],
                      pending=pend, **_kept(doc))


def load_text_only(src: Source, damage: str | None, cache=None, ctx_limit: int | None = None,
                   ctx_most: int | None = None) -> LoadResult:
    """A session whose KV file is not there (deleted to free its space, say) or has no records a load
    can use (`damage` says why): no records to read, so no turn is kept; its exchanges whose text is
    intact are returned to be read again (LoadResult.unread), and the writer's next save writes a new
    KV file first (in place of the broken one), then the sidecar. `cache` (emptied) may be None (an
    export). Refuses a sidecar opening refuses, and (as `load`) text that reads again into more
    tokens than ctx_limit."""
    t0 = time.perf_counter()
    if cache is not None:
        src.layout.check_cache(cache)
    doc = read_sidecar(src)
    if doc is None:
        raise SessionError(f"no session named {src.name} for this model (/sessions lists them)")
    listed, _, warn = parse_turns(doc)
    unread = readable_again(doc, [])
    gone = None if damage or warn else kv_gone(doc, listed, unread)  # nothing is lost: no warning
    state = f"is damaged ({damage})" if damage else "is not there"
    warnings = [] if gone else [f"the KV file {src.name}{KV_EXT} {state}: none of the {count(len(listed), 'turn')} "
                                "listed has its records"] + ([warn] if warn else [])
    n = unread[-1].last if unread else 0
    ctx = None if cache is None else cache.capacity if ctx_limit is None else min(ctx_limit, cache.capacity)
    if ctx is not None and n > ctx:
        raise SessionError(more_context(src.name, n, ctx, ctx_most))
    if cache is not None:
        cache.set_length(0)
    return LoadResult(src.name, 0, [], (time.perf_counter() - t0) * 1000, warnings, unread=unread,
                      layout=src.layout, unread_entries=doc["turns"][: len(unread)], text_only=True,
                      kv_damage=damage, kv_gone=gone, **_kept(doc))


# ---- the rules ---------------------------------------------------------------------------------


def read_sidecar(src: Source) -> dict | None:
    """The sidecar document, None if there is none; refuses a damaged one or another model's."""
    path = src.json_path
    st = lstat_regular(path, "sidecar")
    if st is None:
        return None
    aside = f"move {path} aside to load the cache as one imported turn"
    if st.st_size > MAX_SIDECAR_BYTES:
        raise SessionError(f"sidecar {path} is implausibly large; {aside}")
    fd = open_file(path, "sidecar", os.O_RDONLY)
    try:
        data = os.read(fd, st.st_size + 1)
    except OSError as e:
        raise SessionError(f"cannot read sidecar {path}: {oserror_text(e)}") from None
    finally:
        os.close(fd)
    doc = document(data)
    if not isinstance(doc, dict) or not isinstance(doc.get("format"), int) \
            or not isinstance(doc.get("model"), dict) or doc["format"] < 1:
        raise SessionError(f"sidecar {path} is damaged (not a colichat sidecar); {aside}")
    intact = doc.get("check") == doc_check(doc) or (doc["format"] == 1 and "check" not in doc)
    if doc["format"] > FORMAT_VERSION:  # its checks may be computed otherwise: they cannot tell
        raise SessionError(f"session {src.name} was written by a newer colichat "
                           f"(sidecar format {doc['format']}); upgrade colichat to resume it")
    saved, me = doc["model"], src.ident
    other = saved.get("arch") != me.get("arch") or saved.get("fingerprint") != me.get("fingerprint")
    if not intact and other:
        raise SessionError(f"sidecar {path} is damaged (its model does not match its checksum); {aside}")
    if not intact:  # the turns carry their own checks; only the settings are in doubt
        doc = {**doc, "sampler": {}, "created": None, "settings damaged": True}
    if other:
        raise SessionError(
            f"session {src.name} was saved with other weights ({saved.get('name')}, fingerprint "
            f"{str(saved.get('fingerprint'))[:12]}; this model: {me.get('name')}, "
            f"{str(me.get('fingerprint'))[:12]}); load that model or start a new session with /reset")
    return doc


def header_disagreement(doc: dict, header) -> str | None:
    """How a header disagrees with the layout its own sidecar recorded (damage, another session's KV file), or None."""
    saved = doc.get("layout") if isinstance(doc.get("layout"), dict) else {}
    saved = {"codec": "f32", "head_dim": 0, **saved}  # (an f32 sidecar names no codec)
    got = CacheLayout.from_header(header).__dict__
    bad = [f"{k} {v} (sidecar: {saved.get(k)})" for k, v in got.items() if saved.get(k) != v]
    return f"its header disagrees with the sidecar: {', '.join(bad)}" if bad else None


def listed_prefix(doc, nrec: int, size: int, warnings: list[str], record_bytes: int):
    """(turns, crcs, records to read, pending): the sidecar's turns within the whole records (of `record_bytes`)
    present (all records present when there is no sidecar), where the sidecar's marks say they lie (pending.py:
    `pending`, what the file does not show yet, or None)."""
    whole = (size - HEADER_SIZE) // record_bytes
    avail = min(nrec, whole)
    pend = pending_of(doc, nrec)
    if whole < nrec:
        warnings.append(f"the KV file is cut short: its header lists {nrec} records, it holds {whole} whole ones")
    if doc is None:
        return [], [], avail, None
    turns, crcs, warn = parse_turns(doc)
    warnings += [warn] if warn else []
    kept = next((i for i, t in enumerate(turns) if not (pend or Pending()).holds(t, nrec, whole)), len(turns))
    if kept < len(turns):
        warnings.append(f"dropped {span(turns, kept)}: past the {avail} records in the KV file")
        del turns[kept:], crcs[kept:]
    n = turns[-1].last if turns else 0
    pend = pend or pending_of(doc, nrec, n, whole)
    if avail > n and not warn and pend is None:  # (after a dropped sidecar turn the records are that turn's)
        warnings.append(f"dropped {avail - n} records after the last turn (an interrupted save)")
    return turns, crcs, n, pend


def opening_keeps(doc: dict, nrec: int | None, size: int, record_bytes: int) -> list[Turn]:
    """The turns opening keeps of a sidecar's, from the files alone (what a listing counts; the records are
    not checksummed): the checked turns whose records the KV file holds (`nrec` in its header, `size`
    bytes; None: no KV file it can read), whole exchanges, then those whose text it reads again."""
    kept, crcs = listed_prefix(doc, nrec, size, [], record_bytes)[:2] if nrec is not None else ([], [])
    drop_unanswered(kept, crcs, [])
    return kept + readable_again(doc, kept)


def _verify(cache, turns: list[Turn], crcs: list[int], warnings: list[str], vocab: int) -> int:
    """Drop (in place) the first turn whose CRC or token ids are wrong, and all later ones."""
    for i, t in enumerate(turns):
        if turn_crc(cache, t) != crcs[i]:
            warnings.append(f"dropped {span(turns, i)}: checksum mismatch (damaged records)")
            del turns[i:], crcs[i:]
            break
    n = turns[-1].last if turns else 0
    k = _check_tokens(cache, n, [], vocab)
    if k < n:
        i = next(i for i, t in enumerate(turns) if t.last > k)
        warnings.append(f"dropped {span(turns, i)}: token id {int(cache.tokens[k])} is outside "
                        "the vocabulary")
        del turns[i:], crcs[i:]
        n = turns[-1].last if turns else 0
    return n


def _check_tokens(cache, n: int, warnings: list[str], vocab: int) -> int:
    """The number of leading records whose token id is inside the vocabulary."""
    ids = cache.tokens[:n]
    out = np.flatnonzero((ids < 0) | (ids >= vocab))
    if not out.size:
        return n
    k = int(out[0])
    warnings.append(f"dropped records {k}-{n}: token id {int(ids[k])} is outside the vocabulary")
    return k


def _rope_factors_of(doc: dict, path: str) -> str | None:
    saved = doc["model"].get("rope_factors")
    if saved is not None and not (isinstance(saved, str) and saved.isascii() and saved.isprintable()
                                  and 0 < len(saved) <= 40):
        raise SessionError(f"sidecar {path} is damaged (its model.rope_factors is "
                           f"{json.dumps(saved)[:40]}, not a name); the session cannot be resumed safely")
    return saved


def _check_rope_factors(src: Source, doc: dict) -> None:
    """Refuse (before any record is read) rows rotated with other rope factors than the model
    uses now: mixed in one cache they give wrong answers. A sidecar without the field (an older
    colichat, or a model whose rope does not depend on the context size) is not checked."""
    saved, mine = _rope_factors_of(doc, src.json_path), src.ident.get("rope_factors")
    if saved is None or saved == mine:
        return
    head = f"session {src.name}'s cache rows were rotated with the {saved!r} rope factors"
    if mine is None:
        raise SessionError(f"{head}, which this model does not have (its rope is the same at every "
                           "context size): it cannot be resumed; start a new session with /reset")
    raise SessionError(f"{head} and this model's with {mine!r}: rotate with {saved!r} to resume it, "
                       "or start a new session with /reset")


def _kept(doc: dict) -> dict:
    """What a LoadResult takes from a sidecar besides the turns: settings, creation time, lineage."""
    parent, branch = lineage(doc)
    return dict(sampler=dict(doc["sampler"]) if isinstance(doc.get("sampler"), dict) else {}, sidecar=True,
                created=doc["created"] if isinstance(doc.get("created"), str) else None, parent=parent,
                branch=branch, emptied=doc.get("emptied") is True)


def _sidecar_as_it_is(path: str) -> dict | None:
    """The sidecar document as `listed_prefix` takes it, unchecked (None: none there; SessionError: no document)."""
    if lstat_regular(path, "sidecar") is None:
        return None
    fd = open_file(path, "sidecar", os.O_RDONLY)
    try:
        data = os.read(fd, MAX_SIDECAR_BYTES + 1)
    finally:
        os.close(fd)
    doc = document(data)
    if not isinstance(doc, dict):
        raise SessionError("damaged sidecar")
    return doc


def _saved_model(path: str) -> dict:
    """The sidecar's model entry (what it says it was saved with), {} if it cannot say: reading it
    for real refuses what is wrong with it."""
    try:
        with open(path, "rb") as f:
            doc = document(f.read(MAX_SIDECAR_BYTES))
    except OSError:
        return {}
    return doc["model"] if isinstance(doc, dict) and isinstance(doc.get("model"), dict) else {}
