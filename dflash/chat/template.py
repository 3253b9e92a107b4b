"""Conversation -> prompt tokens, through the model's own chat template.

This first version renders plain role/content messages; tools, reasoning switches and the
built-in tool prompt arrive with the dialect work.
"""

from __future__ import annotations

from typing import Any


def render_text(tokenizer, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True) -> str:
    if not tokenizer.chat_template:
        raise ValueError("the model's tokenizer has no chat template")
    normalized = [{**m, "content": m.get("content") or ""} for m in messages]
    return tokenizer.apply_chat_template(normalized, tokenize=False, add_generation_prompt=add_generation_prompt)


def render_prompt(tokenizer, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True) -> list[int]:
    text = render_text(tokenizer, messages, add_generation_prompt=add_generation_prompt)
    # The template already wrote any BOS it wants; adding special tokens again would double it.
    return tokenizer.encode(text, add_special_tokens=False)
