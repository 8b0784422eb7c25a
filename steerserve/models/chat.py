"""Chat messages -> token ids: the one rendering the server and the research code share.

A vector calibrated on chat prompts only transfers to served chats if both see the same tokens,
so the template is applied here and nowhere else.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

#: Roles a chat may hold ("developer" is OpenAI's newer name for "system").
ROLES: tuple[str, ...] = ("system", "developer", "user", "assistant")


def chat_ids(tokenizer: Any, messages: Sequence[Mapping[str, str]]) -> list[int]:
    """Token ids of a chat with the model's template, ending where the assistant's reply starts.

    Base models without a template get a plain transcript (a lone user message is sent as is,
    so few-shot prompts work through chat)."""
    messages = [dict(m) for m in messages]
    if getattr(tokenizer, "chat_template", None):
        enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(enc["input_ids"] if hasattr(enc, "keys") else enc)
    turns = [m for m in messages if m["role"] != "system"]
    system = "\n\n".join(m["content"] for m in messages if m["role"] == "system")
    if len(turns) == 1 and turns[0]["role"] == "user":
        text = turns[0]["content"]
    else:
        text = "".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in turns)
        text += "Assistant:"
    return list(tokenizer.encode(f"{system}\n\n{text}" if system else text))


def reply_separator(tokenizer: Any) -> str:
    """What precedes a reply's first word after :func:`chat_ids`: nothing after a template's
    assistant header, a space after the plain transcript's ``Assistant:``."""
    return "" if getattr(tokenizer, "chat_template", None) else " "


def check_messages(messages: Any) -> list[dict[str, str]]:
    """``messages`` as plain ``{"role", "content"}`` dicts with ``developer`` read as
    ``system``; ``ValueError`` for anything a chat cannot be (unknown role, no user turn,
    empty content), so a bad record fails before a model runs."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or set(m) - {"role", "content"}:
            raise ValueError(f"messages[{i}] must be {{role, content}}, got {m!r}")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise ValueError(f"messages[{i}].role {role!r} is unknown; known: {', '.join(ROLES)}")
        if not isinstance(content, str) or not content.strip():
            raise ValueError(f"messages[{i}].content is empty")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    if not any(m["role"] == "user" for m in out):
        raise ValueError("messages hold no user turn")
    return out
