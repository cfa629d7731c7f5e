"""Prompt templates: named, custom, system prompt overrides and tokenizer rendering."""

from __future__ import annotations

import json

import pytest

from qerl.data.templates import (
    QERL_SYSTEM_PROMPT,
    PromptTemplate,
    get_template,
    parse_messages,
    render_for_tokenizer,
    render_plain,
    render_prompts,
)
from qerl.errors import QerlConfigError


def test_qerl_template_asks_for_think_and_answer_tags() -> None:
    t = get_template("qerl")
    msgs = t.messages("What is 2+2?")
    assert [m["role"] for m in msgs] == ["system", "user"]
    assert msgs[0]["content"] == QERL_SYSTEM_PROMPT
    for tag in ("<think>", "</think>", "<answer>", "</answer>"):
        assert tag in QERL_SYSTEM_PROMPT
    assert msgs[1]["content"] == "What is 2+2?"
    assert t.render("What is 2+2?") == f"{QERL_SYSTEM_PROMPT}\n\nWhat is 2+2?"


def test_plain_template_is_the_question() -> None:
    t = get_template("plain")
    assert t.messages("Q?") == [{"role": "user", "content": "Q?"}]
    assert t.render("Q?") == "Q?"


def test_custom_template_replaces_every_placeholder_and_keeps_other_braces() -> None:
    t = get_template('Solve {question}. Output JSON like {"a": 1}. Again: {question}')
    assert t.name == "custom"
    assert t.system_prompt is None
    assert t.render("1+1") == 'Solve 1+1. Output JSON like {"a": 1}. Again: 1+1'


def test_custom_template_without_placeholder_names_the_field() -> None:
    with pytest.raises(QerlConfigError, match=r"data\.template") as exc:
        get_template("Answer the question please")
    assert exc.value.field == "data.template"
    assert "{question}" in str(exc.value)


def test_template_of_wrong_type_and_custom_field_name() -> None:
    with pytest.raises(QerlConfigError, match=r"eval\.template"):
        get_template(42, field="eval.template")  # type: ignore[arg-type]


def test_system_prompt_override_and_removal() -> None:
    assert get_template("plain", "Be brief.").messages("Q") == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Q"},
    ]
    assert get_template("qerl", "").messages("Q") == [{"role": "user", "content": "Q"}]
    with pytest.raises(QerlConfigError, match=r"data\.system_prompt"):
        get_template("qerl", ["not", "text"])  # type: ignore[arg-type]


def test_template_object_passes_through() -> None:
    t = PromptTemplate("mine", "Q: {question}", "S")
    assert get_template(t) is t
    assert render_plain(t.messages("x")) == "S\n\nQ: x"


class _ChatTokenizer:
    """Stands in for a HF tokenizer with a chat template."""

    chat_template = "{{ fake }}"

    def __init__(self, reject_system: bool = False) -> None:
        self.reject_system = reject_system
        self.calls: list[list[dict[str, str]]] = []

    def apply_chat_template(
        self, messages: list[dict[str, str]], tokenize: bool, add_generation_prompt: bool
    ) -> str:
        assert tokenize is False
        self.calls.append(messages)
        if self.reject_system and any(m["role"] == "system" for m in messages):
            raise ValueError("System role not supported")
        body = "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages)
        return body + ("<assistant>" if add_generation_prompt else "")


class _PlainTokenizer:
    chat_template = None


def test_render_for_tokenizer_uses_chat_template_when_present() -> None:
    msgs = get_template("plain", "S").messages("Q")
    tok = _ChatTokenizer()
    assert render_for_tokenizer(msgs, tok) == "<system>S</system><user>Q</user><assistant>"
    assert render_for_tokenizer(json.dumps(msgs), tok, add_generation_prompt=False) == (
        "<system>S</system><user>Q</user>"
    )


def test_render_for_tokenizer_without_chat_template_is_the_plain_prompt() -> None:
    t = get_template("qerl")
    assert render_for_tokenizer(t.messages("Q"), _PlainTokenizer()) == t.render("Q")


def test_render_for_tokenizer_folds_system_when_template_rejects_it() -> None:
    tok = _ChatTokenizer(reject_system=True)
    out = render_for_tokenizer(get_template("plain", "S").messages("Q"), tok)
    assert out == "<user>S\n\nQ</user><assistant>"
    assert len(tok.calls) == 2


def test_render_prompts_and_parse_messages_on_json_column() -> None:
    column = [json.dumps(get_template("plain").messages(q)) for q in ("a", "b")]
    assert render_prompts(column, _PlainTokenizer()) == ["a", "b"]
    assert parse_messages(column[0]) == [{"role": "user", "content": "a"}]


def test_render_with_a_real_transformers_chat_template() -> None:
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    model = tokenizers.models.WordLevel({"<unk>": 0}, unk_token="<unk>")
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer(model))
    tok.chat_template = (
        "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    out = render_for_tokenizer(get_template("plain", "S").messages("Q"), tok)
    assert out == "[system]S\n[user]Q\n[assistant]"
