"""A system prompt is checked when it is given (--system at start, /set system) and when a saved
one is reopened, not at the next message: the model's chat template must take one (Gemma's refuses
it), and a message and its answer must fit in the context beside it.

The rule for room is Conversation.ask's: a first message is sent when its prompt (the template's
rendering, the system prompt included) and one token of answer fit in the context. A message's text
can merge with the template's around it (after Llama 2's "[INST] ", a message "a" makes " a", one
token, as " " was), so the prompt of an empty message is the least a message can need: a system
prompt is refused only when even that leaves no room for the answer's first token.
"""

from __future__ import annotations

from ..engine import ContextError, ModelError
from ..engine.text.template import TemplateError, chat_template_for, system_prompt_refusal


def refusal(tokenizer, system: str) -> str | None:
    """Why the model's chat template takes no system prompt (the template's words), or None."""
    return system_prompt_refusal(chat_template_for(tokenizer), system)


def room_problem(tokenizer, system: str, n_ctx: int) -> str | None:
    """'needs N tokens, more than the whole context of M' (N: the system prompt's text, as the
    message that refuses a first message counts it), or None when the prompt of an empty first
    message and one token of answer fit beside it in a context of n_ctx."""
    template = chat_template_for(tokenizer)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": ""}]
    try:
        used = len(tokenizer.encode_prompt(template.render(messages, add_generation_prompt=True)))
    except TemplateError:  # the template's own problem, said by `refusal` (or at the first message)
        return None
    if used + 1 < n_ctx:  # + one token of answer
        return None
    needs = len(tokenizer.encode(system))
    if needs > n_ctx:
        return f"needs {needs} tokens, more than the whole context of {n_ctx}"
    return f"needs {needs} tokens, which leave no room in the context of {n_ctx} for a message and its answer"


def larger_ctx(n_ctx: int, n_ctx_train: int, what: str = "a larger --ctx") -> str:
    """' or a larger --ctx (this model takes up to N)' when the model takes a larger context, else ''."""
    return f" or {what} (this model takes up to {n_ctx_train})" if n_ctx < n_ctx_train else ""


def check_at_start(cfg, tokenizer, n_ctx: int, system: str | None) -> None:
    """--system: refused (ModelError) before the weights are prepared when the chat template takes
    no system prompt (the line names the model file, as a broken template's does) or when no message
    would fit beside it."""
    if system is None:
        return
    why = refusal(tokenizer, system)
    if why is not None:
        raise ModelError(f"{cfg.path}: its chat template (tokenizer.chat_template) takes no system prompt "
                         f"({why}); run without --system")
    problem = room_problem(tokenizer, system, n_ctx)
    if problem:
        raise ContextError(f"the system prompt {problem}: give a shorter --system"
                         f"{larger_ctx(n_ctx, cfg.n_ctx_train)}")


def problem_for_set(model, system: str) -> str | None:
    """Why /set system TEXT is refused (one line; nothing changes), or None when TEXT can be used."""
    why = refusal(model.tokenizer, system)
    if why is not None:
        return f"system prompt not set: this model's chat template takes no system prompt ({why})"
    problem = room_problem(model.tokenizer, system, model.n_ctx)
    if problem:
        more = larger_ctx(model.n_ctx, model.cfg.n_ctx_train, "restart with a larger --ctx")
        return f"system prompt not set: it {problem}; shorten it{more}"
    return None
