"""Chat templates: render a GGUF's Jinja `tokenizer.chat_template` the way Hugging Face does.

The environment matches transformers' `apply_chat_template`: a sandboxed, immutable Jinja2
environment with `trim_blocks`/`lstrip_blocks` and the loop-control extension; the globals
`raise_exception` and `strftime_now`; a `tojson` filter that keeps non-ASCII text as is and
accepts `indent`, `separators` and `sort_keys`; the `{% generation %}` block (rendered as its
body); and the variables `messages`, `add_generation_prompt`, `bos_token`, `eos_token` and
`tools` (None unless given). We also provide a `from_json` filter, which some DeepSeek templates
use to read tool-call arguments.

Templates that emit `{{ bos_token }}` themselves are rendered with the real BOS text;
`Tokenizer.encode_prompt` then avoids adding a second BOS (docs: mla-spec section 10.4).

Every problem (a syntax error, a `raise_exception` call, a failing expression) becomes a
`TemplateError` whose message is one line. `check_chat_template` is the model's template tried once
when the model loads, so a broken one is refused then, naming the file; `system_prompt_refusal` says
whether it takes a system prompt (Gemma's refuses one with `raise_exception`).
"""

from __future__ import annotations

import datetime
import json
from functools import lru_cache

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox

from ...errors import ModelError

# Used when a GGUF carries no chat template: plain ChatML, the format of the SmolLM2, Qwen and
# MiniCPM families. It adds no default system prompt.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class TemplateError(ModelError):
    """A chat template that cannot be compiled or rendered. The message is one line; `what` is the
    problem without the words that name the template (for a message that names it another way)."""

    def __init__(self, message: str, what: str | None = None):
        super().__init__(message)
        self.what = what or message


def _one_line(text: str) -> str:
    return " ".join(str(text).split()) or "unknown error"


def _raise_exception(message):
    raise TemplateError(f"chat template: {_one_line(message)}", _one_line(message))


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (marks assistant text for training masks in HF;
    for rendering it is just its body)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


@lru_cache(maxsize=1)
def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.filters["from_json"] = json.loads
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """A compiled chat template. `render(messages)` returns the prompt text to tokenize."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        self.source = source
        self.bos_token = bos_token or ""
        self.eos_token = eos_token or ""
        self.is_fallback = False
        self._template = _compile(source)

    def render(self, messages, add_generation_prompt: bool = True, **extra) -> str:
        """Render a conversation (a list of {"role": ..., "content": ...} dicts).

        `extra` adds template variables (`tools`, `enable_thinking`, `date_string`, ...)."""
        context = {
            "messages": list(messages),
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "tools": None,
        }
        context.update(extra)
        try:
            return self._template.render(**context)
        except TemplateError:
            raise
        except jinja2.TemplateError as e:
            raise TemplateError(f"chat template error: {_one_line(e)}", _one_line(e)) from None
        except Exception as e:  # errors raised by expressions inside the template
            what = f"{type(e).__name__}: {_one_line(e)}"
            raise TemplateError(f"chat template error: {what}", what) from None

    def __repr__(self):
        kind = "ChatML fallback" if self.is_fallback else f"{len(self.source)} chars"
        return f"ChatTemplate({kind})"


@lru_cache(maxsize=4)
def _compile(source: str) -> jinja2.Template:
    """The compiled template (kept: the load's check and the conversation compile the same source).
    An unknown filter or test is Jinja's TemplateAssertionError, a TemplateSyntaxError that is not
    a syntax error: said as what it is."""
    try:
        return _environment().from_string(source)
    except jinja2.TemplateAssertionError as e:
        what = f"uses a filter or test that colichat's Jinja does not have (line {e.lineno}): {_one_line(e.message)}"
    except jinja2.TemplateSyntaxError as e:
        what = f"has a syntax error (line {e.lineno}): {_one_line(e.message)}"
    except jinja2.TemplateError as e:
        what = f"cannot be compiled: {_one_line(e)}"
    raise TemplateError(f"chat template {what}", what) from None


def check_chat_template(tokenizer, path: str) -> None:
    """Refuse, when the model loads, a model whose own chat template does not compile, fails on a
    conversation of one user message (it could answer nothing) or on a second message after an answer
    (it could answer only once); the line names the file."""
    where = f"{path}: its chat template (tokenizer.chat_template)"
    try:
        template = chat_template_for(tokenizer)
    except TemplateError as e:
        raise TemplateError(f"{where} {e.what}") from None
    first = [{"role": "user", "content": "Hello"}]
    for messages, what in ((first, "a conversation of one message"),
                           (first + [{"role": "assistant", "content": "Hi there."}, *first], "a second message")):
        try:
            template.render(messages, add_generation_prompt=True)
        except TemplateError as e:
            raise TemplateError(f"{where} fails on {what}: {e.what}") from None


def system_prompt_refusal(template: ChatTemplate, system: str) -> str | None:
    """Why `template` fails on a conversation that opens with the system prompt `system` (its own
    words, e.g. 'System role not supported'), or None when it takes it. For a template that renders
    a conversation without one (check_chat_template): its failure is the system prompt's."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Hello"}]
    try:
        template.render(messages, add_generation_prompt=True)
    except TemplateError as e:
        return e.what
    return None


def chat_template_for(tokenizer) -> ChatTemplate:
    """The model's own template (`tokenizer.chat_template` in the GGUF) with its BOS/EOS texts;
    plain ChatML (`CHATML_TEMPLATE`) when the GGUF has none."""
    source = tokenizer.chat_template
    template = ChatTemplate(source or CHATML_TEMPLATE, tokenizer.bos_text, tokenizer.eos_text)
    template.is_fallback = not source
    return template
