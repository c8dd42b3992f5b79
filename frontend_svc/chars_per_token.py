"""How many characters of text one token can cover at most: with it, a text prompt too long to fit within
max_model_len is refused by its length alone, before the tokenizer spends seconds and memory on it.

The bound is the longest string in the vocabulary (added tokens included), computed once. It is sound (a text of
more than ``(max_model_len - 1) * bound`` characters always has at least max_model_len tokens) only when no
step of the tokenizer's pipeline can make text vanish; this module returns a bound only for pipelines it can
check for that (Hugging Face ``tokenizers`` JSON), and None for the rest, which are then tokenized as before:

- normalizers that never shorten text (Prepend, Replace of a string by one at least as long, Lowercase, NFD,
  NFKD, ByteLevel), and NFC / NFKC, which join at most ``MAX_CANONICAL_DECOMPOSITION`` code points into one;
- pre-tokenizers that keep every character (ByteLevel, Metaspace, Digits, UnicodeScripts, Split and Punctuation
  unless they remove the delimiter);
- a BPE model that covers every character: byte-fallback (SentencePiece-style, e.g. Llama 2), byte-level (GPT-2,
  Llama 3, Qwen; every byte is a token whose string is one character per byte), or one unknown token per unknown
  character (no fuse_unk);
- no added token that strips the whitespace beside it.

Byte-level token strings have one character per byte, and a character is at least one byte, so their lengths
bound characters too; a byte-fallback token (``<0x0A>``) is longer than the character it helps spell.
"""

from __future__ import annotations

import json
import logging
from typing import Any

logger = logging.getLogger(__name__)

# The longest canonical decomposition of a Unicode code point (e.g. U+1F82 is 4 code points in NFD): composition
# (NFC, NFKC) joins at most this many code points into one.
MAX_CANONICAL_DECOMPOSITION = 4

_LENGTH_KEEPING_NORMALIZERS = {"Prepend", "Lowercase", "NFD", "NFKD", "ByteLevel"}
_COMPOSING_NORMALIZERS = {"NFC", "NFKC"}
_CHAR_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts"}
_SPLITTING_PRE_TOKENIZERS = {"Split", "Punctuation"}  # keep characters unless behavior is "Removed"


def max_chars_per_token(tokenizer: Any) -> int | None:
    """The most characters (code points) of input text one token of ``tokenizer`` can stand for, or None when
    the tokenizer's pipeline can drop text (see the module docstring), so no sound bound exists.

    Args:
        tokenizer: a transformers tokenizer backed by Hugging Face ``tokenizers`` (``backend_tokenizer``); any
            other gets None.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        pipeline = json.loads(backend.to_str())
        vocab = tokenizer.get_vocab()
    except Exception:  # a tokenizer that cannot describe itself: no bound, tokenize as before
        logger.debug("cannot read the tokenizer's pipeline; text prompts are not bounded by length")
        return None
    shrink = _normalizer_shrink(pipeline.get("normalizer"))
    if shrink is None or not _keeps_characters(pipeline.get("pre_tokenizer")):
        return None
    if not _covers_every_character(pipeline.get("model") or {}, pipeline, vocab):
        return None
    if any(t.get("lstrip") or t.get("rstrip") for t in pipeline.get("added_tokens") or []):
        return None
    longest = max((len(token) for token in vocab), default=0)
    return longest * shrink if longest else None


def _normalizer_shrink(normalizer: dict[str, Any] | None) -> int | None:
    """By how much the normalizer can shorten text at most (1: never), or None: without bound."""
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        factor = 1
        for step in normalizer.get("normalizers", []):
            step_factor = _normalizer_shrink(step)
            if step_factor is None:
                return None
            factor *= step_factor
        return factor
    if kind in _LENGTH_KEEPING_NORMALIZERS:
        return 1
    if kind in _COMPOSING_NORMALIZERS:
        return MAX_CANONICAL_DECOMPOSITION
    if kind == "Replace":
        pattern = normalizer.get("pattern") or {}
        # A regex can match a run of any length; a plain string of n characters is replaced by the content.
        if "String" in pattern and len(normalizer.get("content", "")) >= len(pattern["String"]):
            return 1
    return None


def _keeps_characters(pre_tokenizer: dict[str, Any] | None) -> bool:
    if pre_tokenizer is None:
        return True
    kind = pre_tokenizer.get("type")
    if kind == "Sequence":
        return all(_keeps_characters(step) for step in pre_tokenizer.get("pretokenizers", []))
    if kind in _CHAR_KEEPING_PRE_TOKENIZERS:
        return True
    if kind in _SPLITTING_PRE_TOKENIZERS:
        return pre_tokenizer.get("behavior") != "Removed"
    return False  # Whitespace, WhitespaceSplit, BertPreTokenizer, CharDelimiterSplit drop characters


def _covers_every_character(model: dict[str, Any], pipeline: dict[str, Any], vocab: dict[str, int]) -> bool:
    if model.get("type") != "BPE":
        return False  # WordPiece, WordLevel and Unigram map a run of unknown text to one token
    if model.get("byte_fallback"):
        return True
    if _is_byte_level(pipeline):
        from tokenizers.pre_tokenizers import ByteLevel

        return all(char in vocab for char in ByteLevel.alphabet())
    return model.get("unk_token") is not None and not model.get("fuse_unk")


def _is_byte_level(pipeline: dict[str, Any]) -> bool:
    def kinds(step: dict[str, Any] | None) -> list[str]:
        if step is None:
            return []
        nested = step.get("pretokenizers") or step.get("normalizers") or []
        return [step.get("type", "")] + [k for s in nested for k in kinds(s)]

    return "ByteLevel" in kinds(pipeline.get("pre_tokenizer")) + kinds(pipeline.get("normalizer"))
