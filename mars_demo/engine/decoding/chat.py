"""Chat templating: a prompt (a string or chat messages) as the token ids the model is fed."""

from __future__ import annotations


def user_turn_prefix(tokenizer) -> str:
    """The chat template rendered up to the point where the user's words begin."""
    sentinel = "\u2063SENTINEL\u2063"
    text = tokenizer.apply_chat_template([{"role": "user", "content": sentinel}], tokenize=False)
    return text[: text.index(sentinel)]


def prompt_ids(tokenizer, prompt: str | list[dict]) -> list[int]:
    """Token ids of a prompt (a string or chat messages) under the chat template."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    return tokenizer("\n".join(m["content"] for m in messages))["input_ids"]


def pad_id(tokenizer) -> int:
    """The id that fills padding: the tokenizer's pad token, else its EOS token, else 0.

    Padding is never attended and never a target, so any id is correct; one rule keeps
    every batch the same across the decoders, the benchmark, training and distillation.
    """
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if candidate is not None:
            return int(candidate)
    return 0
