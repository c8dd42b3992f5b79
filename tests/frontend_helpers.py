"""Drive the OutputProcessor with fake engine-core outputs, one token per step; an independent reference for the
text of token ids."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from frontend_svc.engine_types import EngineCoreOutput, FinishReason, PositionLogprobs
from frontend_svc.output_processor import OutputProcessor
from frontend_svc.outputs import RequestOutput
from frontend_svc.sampling_params import SamplingParams


@dataclass
class Stream:
    outputs: list[RequestOutput] = field(default_factory=list)
    reqs_to_abort: list[str] = field(default_factory=list)
    steps: int = 0  # engine outputs consumed before the request ended


def stream(
    tokenizer: Any,
    output_ids: list[int],
    params: SamplingParams,
    prompt_ids: list[int] | None = None,
    final_reason: FinishReason = FinishReason.LENGTH,
    with_logprobs: bool = False,
    candidates: tuple[int, ...] = (),
) -> Stream:
    """Feed ``output_ids`` as a core would (the core finishes on the last one with ``final_reason``). With
    logprobs, each position carries the sampled id then ``candidates`` as its top-k."""
    processor = OutputProcessor(tokenizer)
    processor.add_request("req-internal", "req", params, None, list(prompt_ids or []))
    result = Stream()
    for i, token_id in enumerate(output_ids):
        last = i == len(output_ids) - 1
        ids = [token_id, *candidates]
        logprobs = [PositionLogprobs(ids, [-0.5 - k for k in range(len(ids))], 1)] if with_logprobs else []
        core_output = EngineCoreOutput(
            "req-internal", [token_id], new_logprobs=logprobs, finish_reason=final_reason if last else None
        )
        processed = processor.process_outputs([core_output])
        result.outputs.extend(processed.request_outputs)
        result.reqs_to_abort.extend(processed.reqs_to_abort)
        result.steps = i + 1
        if not processor.has_unfinished_requests():
            break
    return result


def delta_text(outputs: list[RequestOutput]) -> str:
    return "".join(o.outputs[0].text for o in outputs)


@cache
def _gpt2_byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted (its ``bytes_to_unicode``): printable Latin-1 bytes stand for
    themselves, the other bytes, in order, for U+0100 onwards."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    char_of = {b: chr(b) for b in printable}
    shifted = [b for b in range(256) if b not in char_of]
    char_of.update({b: chr(256 + i) for i, b in enumerate(shifted)})
    return {c: b for b, c in char_of.items()}


def byte_token_ids(tokenizer: Any, data: bytes) -> list[int]:
    """Ids of the single-byte tokens that spell ``data``: SentencePiece's ``<0xXX>``, or byte-level BPE's
    one-character tokens."""
    if is_byte_level(tokenizer):
        char_of = {b: c for c, b in _gpt2_byte_of_char().items()}
        return tokenizer.convert_tokens_to_ids([char_of[b] for b in data])
    return tokenizer.convert_tokens_to_ids([f"<0x{b:02X}>" for b in data])


class PythonOnlyTokenizer:
    """A tokenizer seen without its Rust backend, so the frontend takes the slow detokenization path."""

    backend_tokenizer = None

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


def is_byte_level(tokenizer: Any) -> bool:
    """Byte-level BPE (gpt2, the builtin tokenizer); else SentencePiece with byte fallback (llama2)."""
    return type(tokenizer.backend_tokenizer.decoder).__name__ == "ByteLevel"


def token_bytes(tokenizer: Any, token_id: int, skip_special_tokens: bool, byte_level: bool) -> bytes:
    """The bytes a token stands for, read off its vocabulary entry: a byte-level token's characters each stand for
    one byte; SentencePiece's ``<0xXX>`` is that byte, another piece its text with ``▁`` as a space. A special
    token is its content, or nothing when skipped."""
    token = tokenizer.convert_ids_to_tokens(token_id)
    if token_id in tokenizer.all_special_ids:
        return b"" if skip_special_tokens else token.encode()
    if byte_level:
        byte_of = _gpt2_byte_of_char()
        return bytes(byte_of[c] for c in token)
    match = re.fullmatch(r"<0x([0-9A-F]{2})>", token)
    return bytes([int(match.group(1), 16)]) if match else token.replace("▁", " ").encode()


def reference_text(tokenizer: Any, ids: list[int], skip_special_tokens: bool = True) -> str:
    """The text of ``ids`` computed without the tokenizer's decoder: all their bytes decoded as one UTF-8 string,
    with U+FFFD per maximal subpart of invalid bytes (``errors="replace"``, as Rust's ``from_utf8_lossy``, which
    gpt2's ByteLevel decoder uses; llama2's ByteFallback decoder would give one U+FFFD per byte of a whole run,
    which a stream cannot do once it has sent a character of that run). SentencePiece's decoder also drops the
    one leading space of the text (its ``Strip`` step)."""
    byte_level = is_byte_level(tokenizer)
    data = b"".join(token_bytes(tokenizer, i, skip_special_tokens, byte_level) for i in ids)
    text = data.decode("utf-8", errors="replace")
    return text[1:] if not byte_level and text.startswith(" ") else text


def reference_output_text(tokenizer: Any, prompt_ids: list[int], ids: list[int], skip: bool = True) -> str:
    """What ``ids`` add to the text of a prompt that ends at a character boundary."""
    prompt_text = reference_text(tokenizer, prompt_ids, skip)
    full = reference_text(tokenizer, prompt_ids + ids, skip)
    if not full.startswith(prompt_text):
        raise ValueError("the prompt does not end at a character boundary")
    return full[len(prompt_text) :]


def bytes_are_valid(tokenizer: Any, ids: list[int], skip_special_tokens: bool = True) -> bool:
    byte_level = is_byte_level(tokenizer)
    try:
        b"".join(token_bytes(tokenizer, i, skip_special_tokens, byte_level) for i in ids).decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
