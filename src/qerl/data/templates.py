"""Prompt templates and system prompts.

A :class:`PromptTemplate` turns a raw question into chat messages (an optional system prompt and
one user message) and into plain prompt text. Templates are chosen by parameter
(``data.template``):

* ``"qerl"`` -- the paper's format: a system prompt asking the model to reason inside
  ``<think>...</think>`` and then give only the final answer inside ``<answer>...</answer>``
  (what the ``format`` reward checks); the user message is the question itself.
* ``"plain"`` -- no system prompt, the user message is the question (``"{question}"``).
* any other string containing ``{question}`` -- a custom user template. Every ``{question}`` is
  replaced by the question; nothing else is interpreted, so literal braces need no escaping.

``data.system_prompt`` overrides the template's system prompt (``""`` removes it).

Two renderings exist and both are deterministic:

* :func:`render_plain` -- the system prompt and the user message joined by a blank line. This is
  the ``prompt`` column of the prompt table and what a model *without* a chat template sees.
* :func:`render_for_tokenizer` -- ``tokenizer.apply_chat_template`` when the tokenizer has a
  chat template, else :func:`render_plain`. The tokenizer is an argument, so this module stays
  free of transformers.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from qerl.errors import QerlConfigError

PLACEHOLDER = "{question}"

#: The paper's reasoning format (DeepSeek-R1-Zero style), used by the ``"qerl"`` template.
QERL_SYSTEM_PROMPT = (
    "A conversation between User and Assistant. The User asks a question and the Assistant "
    "solves it. The Assistant first thinks through the reasoning process step by step and then "
    "gives the final answer. The reasoning goes inside <think> </think> tags and the final "
    "answer, with nothing else, inside <answer> </answer> tags, i.e. "
    "<think> reasoning here </think> <answer> final answer here </answer>."
)

Message = dict[str, str]


@dataclass(frozen=True)
class PromptTemplate:
    """A user-message template plus an optional system prompt.

    Attributes:
        name: template name (``"qerl"``, ``"plain"`` or ``"custom"``).
        user_template: text with at least one ``{question}`` placeholder.
        system_prompt: the system message, or ``None`` for none.
    """

    name: str
    user_template: str
    system_prompt: str | None = None

    def user_message(self, question: str) -> str:
        """The user message for ``question`` (every ``{question}`` replaced)."""
        return self.user_template.replace(PLACEHOLDER, question)

    def messages(self, question: str) -> list[Message]:
        """Chat messages for ``question``: system prompt (if any) then the user message."""
        msgs: list[Message] = []
        if self.system_prompt:
            msgs.append({"role": "system", "content": self.system_prompt})
        msgs.append({"role": "user", "content": self.user_message(question)})
        return msgs

    def render(self, question: str) -> str:
        """Plain prompt text for ``question`` (see :func:`render_plain`)."""
        return render_plain(self.messages(question))


NAMED_TEMPLATES: dict[str, PromptTemplate] = {
    "qerl": PromptTemplate("qerl", PLACEHOLDER, QERL_SYSTEM_PROMPT),
    "plain": PromptTemplate("plain", PLACEHOLDER, None),
}


def get_template(
    template: str | PromptTemplate = "qerl",
    system_prompt: str | None = None,
    *,
    field: str = "data.template",
    system_field: str = "data.system_prompt",
) -> PromptTemplate:
    """Resolve a template parameter into a :class:`PromptTemplate`.

    Args:
        template: a name from :data:`NAMED_TEMPLATES`, a custom user template containing
            ``{question}``, or a ready :class:`PromptTemplate`.
        system_prompt: overrides the template's system prompt when not ``None``; ``""`` removes it.
        field: parameter name used in errors about ``template``.
        system_field: parameter name used in errors about ``system_prompt``.

    Raises:
        QerlConfigError: ``template`` is not a string, or is neither a known name nor contains
            ``{question}``; ``system_prompt`` is not a string.
    """
    if system_prompt is not None and not isinstance(system_prompt, str):
        raise QerlConfigError(
            system_field,
            f"expected a string, got {type(system_prompt).__name__}",
            'give the system prompt as text, "" for none, or leave it unset for the default',
        )
    if isinstance(template, PromptTemplate):
        resolved = template
    elif not isinstance(template, str):
        raise QerlConfigError(
            field,
            f"expected a template name or string, got {type(template).__name__}",
            f"use one of {sorted(NAMED_TEMPLATES)} or a string containing {PLACEHOLDER}",
        )
    elif template in NAMED_TEMPLATES:
        resolved = NAMED_TEMPLATES[template]
    elif PLACEHOLDER in template:
        resolved = PromptTemplate("custom", template, None)
    else:
        raise QerlConfigError(
            field,
            f"{template!r} is not a known template and has no {PLACEHOLDER} placeholder",
            f"use one of {sorted(NAMED_TEMPLATES)} or a custom string containing {PLACEHOLDER}",
        )
    if system_prompt is not None:
        resolved = PromptTemplate(resolved.name, resolved.user_template, system_prompt or None)
    return resolved


def render_plain(messages: Sequence[Mapping[str, str]]) -> str:
    """Join message contents with a blank line (the rendering for models without a chat template)."""
    return "\n\n".join(m["content"] for m in messages if m["content"])


def parse_messages(messages: str | Sequence[Mapping[str, str]]) -> list[Message]:
    """Return messages as a list of dicts, decoding the prompt table's JSON column if needed."""
    if isinstance(messages, str):
        messages = json.loads(messages)
    return [{"role": str(m["role"]), "content": str(m["content"])} for m in messages]


def _merge_system(messages: list[Message]) -> list[Message]:
    """Fold a leading system message into the first user message (for templates without system)."""
    if not messages or messages[0]["role"] != "system" or len(messages) < 2:
        return messages
    first = dict(messages[1])
    first["content"] = f"{messages[0]['content']}\n\n{first['content']}"
    return [first, *messages[2:]]


def render_for_tokenizer(
    messages: str | Sequence[Mapping[str, str]],
    tokenizer: Any,
    *,
    add_generation_prompt: bool = True,
) -> str:
    """Render messages as the prompt text a given tokenizer's model expects.

    Uses ``tokenizer.apply_chat_template(..., tokenize=False)`` when the tokenizer has a
    ``chat_template``; a template that rejects the system role is retried with the system prompt
    folded into the user message. Without a chat template, :func:`render_plain` is used, which
    equals the table's ``prompt`` column.

    Args:
        messages: a list of ``{role, content}`` dicts or the table's JSON ``messages`` string.
        tokenizer: any object with ``chat_template`` / ``apply_chat_template`` (HF tokenizers).
        add_generation_prompt: append the assistant-turn header (chat templates only).
    """
    msgs = parse_messages(messages)
    if not getattr(tokenizer, "chat_template", None):
        return render_plain(msgs)
    try:
        text = tokenizer.apply_chat_template(
            msgs, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except Exception:
        merged = _merge_system(msgs)
        if merged is msgs:
            raise
        text = tokenizer.apply_chat_template(
            merged, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    return str(text)


def render_prompts(
    messages_column: Sequence[str | Sequence[Mapping[str, str]]],
    tokenizer: Any,
    *,
    add_generation_prompt: bool = True,
) -> list[str]:
    """Render a whole ``messages`` column for ``tokenizer`` (see :func:`render_for_tokenizer`)."""
    return [
        render_for_tokenizer(m, tokenizer, add_generation_prompt=add_generation_prompt)
        for m in messages_column
    ]
