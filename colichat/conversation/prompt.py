"""The prompt of a new user message: what the chat template makes of the turns so far plus the message,
as token ids to append to the cache.

The template text of a new user turn is computed from the messages alone (`render(messages + [user])
minus (render(messages before the last answer) + answer)`), so a resumed conversation continues with
exactly the tokens an uninterrupted one would have. A template that renders earlier turns otherwise
than they were read (R1's and GLM's drop a past answer's thinking, which the model read as it wrote
it) makes the new prompt differ from the cache: the cache keeps the rows before the first token that
differs, and the rest is read again (Transcript.rebase).
"""

from __future__ import annotations

from ..engine.text.template import TemplateError, chat_template_for
from ..persist import Turn
from .thinking import opens_thinking


class Prompt:
    """The chat template of `tokenizer`, rendering a conversation's turns so far (`transcript`,
    transcript.Transcript) with its settings (`prefs`, chat_settings.ChatSettings) and a new message."""

    def __init__(self, tokenizer, transcript, prefs):
        self.tok, self.transcript, self.prefs = tokenizer, transcript, prefs
        self.template = chat_template_for(tokenizer)

    def opens_thinking(self, on: bool) -> bool:
        """Whether the template's generation prompt leaves the model inside its thinking (R1, GLM-4.7/5.x;
        V3.1 asked to think), asked to think (`on`) or not."""
        try:
            return opens_thinking(self.template.render([{"role": "user", "content": "?"}], True, enable_thinking=on))
        except TemplateError:  # (a template that needs more than one message to render says so when used)
            return False

    def messages(self, turns: list[Turn]) -> list[dict]:
        """The chat messages for the template (turns imported from a bare cache file are opaque)."""
        system = self.prefs.settings.system
        msgs = [{"role": "system", "content": system}] if system else []
        return msgs + [{"role": t.role, "content": t.text} for t in turns if t.role in ("user", "assistant")]

    def ids(self, user_text: str) -> tuple[list[int], int]:
        """Token ids to append for a new user message, and the cache row they start at (below the
        cache's length only when the template re-renders the turns differently)."""
        turns, cached, thinks = self.transcript.turns, self.transcript.cache, self.prefs.thinks
        full = self.template.render(self.messages(turns) + [{"role": "user", "content": user_text}], True,
                                    enable_thinking=thinks)  # (asked of templates with the switch: V3.1, GLM, Qwen3)
        users = [i for i, t in enumerate(turns) if t.role == "user"]
        if not turns:
            return self.tok.encode_prompt(full), 0
        if not users:  # only turns imported from a bare cache: continue after them, no second BOS
            bos = self.tok.bos_text
            return self.tok.encode(full[len(bos):] if bos and full.startswith(bos) else full,
                                   special=True), cached.length
        last_user = users[-1]
        base = self.template.render(self.messages(turns[: last_user + 1]), True, enable_thinking=thinks)
        base += "".join(t.text for t in turns[last_user + 1 :])
        if full.startswith(base):
            return self.tok.encode(full[len(base) :], special=True), cached.length
        # Not prefix-stable (a template that rewrites past answers, as R1's drops their thinking):
        # the cache keeps the rows of the longest common token prefix (a row depends only on the
        # tokens up to it) and the rest is read again, from the first token that differs; at least
        # one token is read, for the logits of the answer.
        ids = self.tok.encode_prompt(full)
        have = cached.token_ids()
        lcp = 0
        while lcp < min(len(ids), len(have)) and ids[lcp] == have[lcp]:
            lcp += 1
        keep = min(lcp, len(ids) - 1)
        return ids[keep:], keep
