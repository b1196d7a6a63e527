"""What colichat does from the shell without a chat, then exits: --sessions and --export NAME
(the saved conversations, printed), --models (the models known), --prune-kv DAYS (old
conversations' KV files freed). No model is loaded.
"""

from __future__ import annotations

import sys

from ..conversation.saved import export_saved, listing
from ..models.default import DefaultModelMissing, default_model_path
from ..models.hub import is_hub_model, model_file
from ..models.listing import NO_MODELS, model_rows
from ..persist import SessionError, Store
from ..persist.prune import choose, listed, prune_kv
from ..units import format_size
from ..wrap import wrap_line
from .start import unreadable_sessions
from .streams import ask_yes, print_out, terminal_columns, to_stderr


def from_the_shell(args, store: Store) -> int:
    """--sessions and --export NAME: read the saved conversations, print to stdout; --prune-kv DAYS: free
    their KV files' space; --models: the models known, on stdout. No model is loaded."""
    root = store.root
    problem = unreadable_sessions(root)
    if problem:  # else the listing would say "no saved conversations" of conversations it cannot see
        raise SessionError(f"cannot read the saved conversations in {root} ({problem}); fix that, or set "
                           "COLICHAT_HOME to the directory that holds them")
    if args.models:
        return print_out("".join(f"{row}\n" for row in model_rows(store)) or NO_MODELS)
    if args.prune_kv is not None:
        return prune_asked(store, args)
    if args.sessions:
        rows = listing(store)
        if sys.stdout.isatty():  # as /sessions shows them
            rows = [wrap_line(row, terminal_columns(), hang=4) for row in rows]
        return print_out("\n".join(rows) + "\n" if rows else "no saved conversations\n")
    model = args.model
    if is_hub_model(model):  # --export NAME --model hf:...: the one downloaded (nothing is downloaded)
        model = model_file(model, to_stderr, offline=True)
    try:
        model = model or default_model_path()
    except DefaultModelMissing:
        model = None
    text, warnings, note = export_saved(store, model, args.export, given=args.model is not None)
    if note:  # the other models' conversations of that name, and how to print one
        to_stderr(note)
    for line in warnings:  # as opening says what it drops
        to_stderr(f"warning: {line}")
    return print_out(text)


def prune_asked(store: Store, args) -> int:
    """--prune-kv DAYS: list the KV files it would free, ask (unless --yes, or stdin is not a terminal:
    a script), then free them. DAYS 0 keeps the last hour's conversations unless --all."""
    choices = choose(store, args.prune_kv, everything=args.all)
    days = f"{args.prune_kv:g} days" if args.prune_kv or args.all else "the last hour"
    if not choices:
        to_stderr(f"nothing to prune: no conversation's KV file unused for {days}"
                  + ("" if args.all or args.prune_kv else " (--all prunes those too)"))
        return 0
    free = sum(c.size for c in choices if not c.kept)
    to_stderr(f"--prune-kv {args.prune_kv:g} frees {format_size(free)}: the KV files of the conversations not used "
              f"for {days} (their text stays; reopening one reads it again):")
    for line in listed(choices):
        to_stderr(line)
    if free and not args.yes and sys.stdin.isatty() and not ask_yes("Free them?"):
        to_stderr("nothing pruned")
        return 0
    for line in prune_kv(choices, args.prune_kv) if free else ["nothing pruned"]:
        to_stderr(line)
    return 0
