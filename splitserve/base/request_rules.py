"""The wording of the request checks both services make: the frontend for its callers, the core again for clients
that reach it directly. One wording, so a refusal reads the same from the Python API, the public gRPC API and a
core. Each function returns the message without the field name, which each side puts in front
(``ValidationError(field, message)`` in the frontend, ``f"{field}: {message}"`` in the core)."""

from __future__ import annotations


def prompt_leaves_no_room(num_prompt_tokens: int, max_model_len: int) -> str:
    return (
        f"has {num_prompt_tokens} tokens, which leaves no room for an output token within max_model_len={max_model_len}"
    )


def max_tokens_too_large(max_tokens: int, num_prompt_tokens: int, max_model_len: int) -> str:
    """prompt + max_tokens over max_model_len, as vLLM's servers word it (HTTP 400)."""
    return (
        f"{max_tokens} is too large: this model's maximum context length is {max_model_len} tokens, and "
        f"{num_prompt_tokens + max_tokens} were requested ({num_prompt_tokens} in the prompt, {max_tokens} in the "
        f"completion); at most {max_model_len - num_prompt_tokens} fit after this prompt"
    )


def token_id_outside_vocabulary(token_id: int, vocab_size: int) -> str:
    return f"token id {token_id} is outside the vocabulary [0, {vocab_size})"
