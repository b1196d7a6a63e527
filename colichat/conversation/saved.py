"""The saved conversations read without a model: `colichat --sessions` (every one, by model),
`--export NAME` (one as Markdown, checked as opening checks it), and the Markdown /export writes too.

    listing(store) -> [line]          # every saved conversation, by model
    export_saved(store, model_path, name) -> (str, [warning], note)  # a saved conversation as Markdown
    markdown(title, model, turns, system, opens_thinking) -> str  # (role, text) turns as Markdown
"""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime

from ..models.default import model_title
from ..persist import SessionError, Store, check_name
from ..persist.listing import damaged_text, total_line, under_parents
from ..persist.loading import read_saved
from ..persist.sidecar import span
from ..wrap import displayable
from .reopen import model_fingerprint, namesakes_note
from .thinking import split


def listing(store: Store) -> list[str]:
    """Every saved conversation, grouped by model (newest first), for `colichat --sessions`."""
    by_model, every = defaultdict(list), store.list()
    for info in every:
        by_model[(info.model, info.model_dir)].append(info)
    lines = []
    for (model, directory), infos in by_model.items():
        file = next((i.model_file for i in infos if i.model_file), "")
        lines.append(f"{model_title(model, file)} ({directory}):")
        lines += ["  " + "  " * depth + displayable(i.describe())  # (texts from files: shown, not acted on)
                  for i, depth in under_parents(infos)]  # forks under their parents
    if lines:
        lines.append(total_line(every))
    return lines


def export_saved(store: Store, model_path: str | None, name: str, given: bool = False) -> tuple[str, list[str]]:
    """Saved conversation NAME as Markdown (this model's, as --session NAME reopens it; without a model
    given, the newest of that name): the turns opening it would keep, checked as opening checks them, the warnings for
    what it drops, and a note naming the other models' conversations NAME (or None). `given`: the
    model was named (--model), so only its conversation NAME will do.
    A session opening refuses is refused, with the same line (no model is loaded: the checks over
    records and text are over the files' bytes)."""
    check_name(name)
    fp = model_fingerprint(model_path) if model_path else None
    found = [i for i in store.list() if i.name == name]  # newest first
    if not found:
        raise SessionError(f"no session named {name} (colichat --sessions lists them)")
    mine = next((i for i in found if i.made_by(fp)), None)
    if given and mine is None:  # an explicit --model: its conversation or none, as --session NAME
        raise SessionError(f"no session named {name} for {model_path} (another model has one: colichat --export "
                           f"{name} without --model prints it; colichat --sessions lists them)")
    info = mine or next((i for i in found if not i.damage), found[0])
    note = namesakes_note(store, name, info.model_dir, f"colichat --export {name} --model {{path}} prints it")
    if info.damage:
        raise SessionError(f"session {damaged_text(name, info.damage)}")
    res = read_saved(info.path.parent, name)
    system = res.sampler.get("system")
    turns = res.turns + res.unread  # the text of exchanges whose records were dropped, as reopening reads it
    text = markdown(name, model_title(info.model, info.model_file), [(t.role, t.text) for t in turns],
                    system if isinstance(system, str) else None, res.sampler.get("opens_thinking") is True)
    kept = ([f"{span(turns, len(res.turns))} printed all the same: their saved text is intact (reopening "
             "reads it again)"] if res.unread and not res.kv_gone else [])  # (pruned: nothing to warn of)
    return text, res.warnings + kept, note


def markdown(title: str, model: str, turns, system: str | None = None, opens_thinking: bool = False) -> str:
    """A conversation as Markdown: a heading per turn, the text as it was written; a thinking model's
    thinking (thinking.split; `opens_thinking`: the answers begin inside it) whole, folded in a
    <details> block before the answer, whatever /set think says (an export keeps everything)."""
    out = [f"# {title}", "", f"Model: {model}. Exported {datetime.now().strftime('%Y-%m-%d %H:%M')}.", ""]
    if system:
        out += ["## System", "", system.strip(), ""]
    names = {"user": "User", "assistant": "Assistant"}
    for role, text in turns:
        out += [f"## {names.get(role, role.capitalize())}", ""]
        thought, answer = split(text, opens_thinking) if role == "assistant" else (None, text)
        if thought is not None:
            out += ["<details><summary>Thinking</summary>", "", thought, "", "</details>", ""]
        out += [answer.strip(), ""] if answer.strip() or thought is None else []
    return "\n".join(out)
