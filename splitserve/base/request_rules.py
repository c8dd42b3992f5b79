"""The request checks both services make, and their wording: the frontend for its callers, the core again for
clients that reach it directly. One definition, so a refusal reads the same from the Python API, the public gRPC
API and a core. A check returns a ``Violation`` (the field and what is wrong, without the field's name) or None;
each side raises its own error from it (``ValidationError`` in the frontend, ``InvalidRequestError`` in the
core, both ``splitserve.base.status.FieldError``). The sampling parameters' checks are in
``splitserve.base.sampling_rules``."""

from __future__ import annotations

from collections.abc import Iterable

from splitserve.base.status import Violation


def prompt_violation(
    prompt_token_ids: list[int], max_model_len: int, vocab_size: int, field: str, pooling: bool = False
) -> Violation | None:
    """A prompt the model cannot take (vLLM's ``InputProcessor`` checks): empty, no room for one output token
    within ``max_model_len``, or an id outside the vocabulary (``prompt_token_ids[i]``). ``field`` names the
    whole prompt as the caller sent it (``prompt`` in the frontend, ``prompt_token_ids`` in the core). A pooling
    request (``pooling``) samples no token but has the same limit here, max_model_len - 1 tokens, worded so."""
    if not prompt_token_ids:
        return Violation(field, "cannot be empty")
    if len(prompt_token_ids) >= max_model_len:
        if pooling:
            return Violation(field, pooling_prompt_too_long(len(prompt_token_ids), max_model_len))
        return Violation(field, prompt_leaves_no_room(len(prompt_token_ids), max_model_len))
    return token_ids_violation("prompt_token_ids", prompt_token_ids, vocab_size)


def max_tokens_violation(max_tokens: int, num_prompt_tokens: int, max_model_len: int) -> Violation | None:
    """prompt + ``max_tokens`` over ``max_model_len``: refused, as vLLM's servers refuse it (HTTP 400), rather
    than cut short with finish reason "length"."""
    if num_prompt_tokens + max_tokens <= max_model_len:
        return None
    return Violation("max_tokens", max_tokens_too_large(max_tokens, num_prompt_tokens, max_model_len))


def token_ids_violation(field: str, token_ids: Iterable[int], vocab_size: int) -> Violation | None:
    """The first id outside [0, vocab_size), named ``field[i]``."""
    for i, token_id in enumerate(token_ids):
        if not 0 <= token_id < vocab_size:
            return Violation(f"{field}[{i}]", token_id_outside_vocabulary(token_id, vocab_size))
    return None


# The words clients look for to tell a context overflow from other refusals (vLLM's servers and OpenAI's use them;
# LangChain's and crewAI's overflow handling match them).
CONTEXT_LENGTH_WORDS = "this model's maximum context length is"


def prompt_leaves_no_room(num_prompt_tokens: int, max_model_len: int) -> str:
    return (
        f"has {num_prompt_tokens} tokens, which leaves no room for an output token within "
        f"max_model_len={max_model_len} ({CONTEXT_LENGTH_WORDS} {max_model_len} tokens)"
    )


def pooling_prompt_too_long(num_prompt_tokens: int, max_model_len: int) -> str:
    return (
        f"has {num_prompt_tokens} tokens, more than the {max_model_len - 1} (max_model_len - 1, "
        f"max_model_len={max_model_len}) a pooling prompt may have ({CONTEXT_LENGTH_WORDS} {max_model_len} tokens); "
        f"truncate_prompt_tokens=-1 keeps the last {max_model_len - 1}"
    )


def max_tokens_too_large(max_tokens: int, num_prompt_tokens: int, max_model_len: int) -> str:
    """prompt + max_tokens over max_model_len, as vLLM's servers word it (HTTP 400)."""
    return (
        f"{max_tokens} is too large: {CONTEXT_LENGTH_WORDS} {max_model_len} tokens, and "
        f"{num_prompt_tokens + max_tokens} were requested ({num_prompt_tokens} in the prompt, {max_tokens} in the "
        f"completion); at most {max_model_len - num_prompt_tokens} fit after this prompt"
    )


def token_id_outside_vocabulary(token_id: int, vocab_size: int) -> str:
    return f"token id {token_id} is out of vocabulary [0, {vocab_size})"
