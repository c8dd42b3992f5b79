"""Incremental decoders: token ids to text, one id at a time, for the detokenizer (``frontend_svc/detokenizer.py``).

- ``StreamDecoder``: tokenizers' ``DecodeStream`` over the tokenizer's Rust backend.
- ``OffsetDecoder``: the prefix/read offset algorithm of TGI / vLLM ``detokenize_incrementally`` over
  ``convert_ids_to_tokens`` and ``convert_tokens_to_string``, for tokenizers without a Rust backend.

Both also decode ids standalone and look up the vocabulary; ``repaired_ids`` makes the tokenizer's decode give
invalid UTF-8 as U+FFFD per maximal subpart.
"""

from __future__ import annotations

import codecs
from typing import Any

REPLACEMENT_CHAR = "\ufffd"


class DecoderDesyncError(Exception):
    """A decoder's text for its ids no longer extends the text it already gave (tokenizers' "Invalid prefix")."""


class TokenDecoder:
    """One request's incremental decoder. ``step`` feeds an id and returns its new text, or None while there is
    none yet (an unfinished character, a token without text); ``reset`` starts over."""

    def __init__(self, skip_special_tokens: bool) -> None:
        self.skip_special_tokens = skip_special_tokens
        self._byte_values: dict[int, int] | None = None
        self._byte_ids: dict[int, int] = {}  # byte -> its byte-fallback token id
        self._anchor_ids: list[int] | None = None

    def reset(self) -> None:
        raise NotImplementedError

    def step(self, token_id: int) -> str | None:
        """Raises DecoderDesyncError when the text of the ids read so far no longer extends what it gave."""
        raise NotImplementedError

    def decode(self, token_ids: list[int]) -> str:
        """The ids' text on their own (the tokenizer's decode)."""
        raise NotImplementedError

    def in_vocab(self, token_id: int) -> bool:
        raise NotImplementedError

    def token_string(self, token_id: int) -> str:
        """The vocabulary entry (a special token's content)."""
        raise NotImplementedError

    def token_id(self, token: str) -> int | None:
        raise NotImplementedError

    def encode(self, text: str) -> list[int]:
        """The ids of ``text``, without special tokens."""
        raise NotImplementedError

    def anchor_ids(self) -> list[int]:
        """Ids of a one-letter text ("a"), for a restart that has no settled text to start from but must not begin
        the text: SentencePiece's decoder strips the leading space of the first token of a text."""
        if self._anchor_ids is None:
            self._anchor_ids = self.encode("a")
        return self._anchor_ids

    def byte_values(self) -> dict[int, int]:
        """Byte-fallback token id -> its byte (SentencePiece's ``<0x00>`` .. ``<0xFF>``); empty unless the
        tokenizer decodes them as bytes and has all 256. Built on first use."""
        if self._byte_values is None:
            table: dict[int, int] = {}
            probe = self.token_id("<0xF0>")  # a lead byte: alone it is invalid UTF-8
            if probe is not None and self.decode([probe]) == REPLACEMENT_CHAR:
                for value in range(256):
                    token_id = self.token_id(f"<0x{value:02X}>")
                    if token_id is not None:
                        table[token_id] = value
            self._byte_values = table if len(table) == 256 else {}
            self._byte_ids = {value: token_id for token_id, value in self._byte_values.items()}
        return self._byte_values

    def reads_nothing(self, token_id: int) -> bool:
        """Whether the decode reads no text from ``token_id``: outside the vocabulary, or a special token that
        skip_special_tokens leaves out."""
        return not self.in_vocab(token_id) or token_id in self._skipped_ids()

    def _skipped_ids(self) -> frozenset[int]:
        """The special tokens the decode leaves out (none unless skip_special_tokens)."""
        raise NotImplementedError

    def repaired_ids(self, token_ids: list[int]) -> list[int]:
        """``token_ids`` with each run of byte-fallback tokens spelled again as the UTF-8 of its text with U+FFFD
        per maximal subpart of invalid bytes (Python's ``errors="replace"``), so that the tokenizer's decode
        gives that text: tokenizers' ByteFallback decoder gives one U+FFFD per byte of a run with an invalid byte.
        Byte-level BPE decodes per maximal subpart already: its ids come back as they are. Ids the decode reads
        no text from (``reads_nothing``) are left out: a run goes on across them, as in the decode."""
        byte_values = self.byte_values()
        if not byte_values:
            return list(token_ids)
        repaired: list[int] = []
        run = bytearray()
        for token_id in [*token_ids, None]:
            value = byte_values.get(token_id) if token_id is not None else None
            if value is not None:
                run.append(value)
                continue
            if token_id is not None and self.reads_nothing(token_id):
                continue
            if run:
                repaired.extend(self._byte_ids[b] for b in run.decode("utf-8", errors="replace").encode())
                run.clear()
            if token_id is not None:
                repaired.append(token_id)
        return repaired

    def ends_in_invalid_bytes(self, token_ids: list[int]) -> bool:
        """Whether ``token_ids`` end in byte-fallback tokens whose bytes hold invalid UTF-8 and leave no character
        unfinished. ByteFallback decodes such a run as one U+FFFD per byte, so an incremental decoder gives it no
        text until a token that is no byte, though its text is known. Ids the decode reads no text from do not end
        a run."""
        byte_values = self.byte_values()
        if not byte_values or token_ids[-1] not in byte_values:
            return False
        data = bytearray()
        for token_id in reversed(token_ids):
            value = byte_values.get(token_id)
            if value is not None:
                data.append(value)
            elif not self.reads_nothing(token_id):
                break
        data.reverse()
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        return REPLACEMENT_CHAR in decoder.decode(bytes(data)) and not decoder.getstate()[0]


class StreamDecoder(TokenDecoder):
    """tokenizers' ``DecodeStream`` over the tokenizer's Rust backend. With special tokens kept and
    ``spaces_between_special_tokens`` off, an added token right after another is its content, without the space
    a decoder may put before it (WordPiece's, or none's), as vLLM's ``FastIncrementalDetokenizer``."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool, spaces_between_special_tokens: bool = True) -> None:
        super().__init__(skip_special_tokens)
        from tokenizers import Tokenizer
        from tokenizers.decoders import DecodeStream

        self._decode_stream_class = DecodeStream
        self.backend: Tokenizer = tokenizer.backend_tokenizer
        self.stream: Any = None
        self._added_tokens: dict[int, str] = {}  # added token id -> content, when spaces between them are off
        if not skip_special_tokens and not spaces_between_special_tokens:
            self._added_tokens = {i: t.content for i, t in self.backend.get_added_tokens_decoder().items()}
        self._last_is_added = False  # the last id read is an added token
        self._skipped: frozenset[int] | None = None
        self.reset()

    def reset(self) -> None:
        self.stream = self._decode_stream_class(skip_special_tokens=self.skip_special_tokens)
        self._last_is_added = False

    def step(self, token_id: int) -> str | None:
        try:
            text = self.stream.step(self.backend, token_id)
        except Exception as e:  # tokenizers raises a plain Exception ("Invalid prefix encountered ...")
            raise DecoderDesyncError(str(e)) from e
        if self._added_tokens:
            content = self._added_tokens.get(token_id)
            if content is not None and self._last_is_added and text is not None:
                text = content
            self._last_is_added = content is not None
        return text

    def decode(self, token_ids: list[int]) -> str:
        return self.backend.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def in_vocab(self, token_id: int) -> bool:
        return token_id >= 0 and self.backend.id_to_token(token_id) is not None

    def token_string(self, token_id: int) -> str:
        return self.backend.id_to_token(token_id) or ""

    def token_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def _skipped_ids(self) -> frozenset[int]:
        if self._skipped is None:
            added = self.backend.get_added_tokens_decoder().items() if self.skip_special_tokens else []
            self._skipped = frozenset(token_id for token_id, token in added if token.special)
        return self._skipped

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids


class OffsetDecoder(TokenDecoder):
    """The prefix/read offset algorithm (TGI, vLLM ``detokenize_incrementally``) over python tokenizers: decode
    the tokens from ``prefix_offset``, emit what they add to those before ``read_offset``, then slide."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool, spaces_between_special_tokens: bool) -> None:
        super().__init__(skip_special_tokens)
        self.tokenizer = tokenizer
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.added_vocab = set(tokenizer.get_added_vocab())
        self.all_special_tokens = set(tokenizer.all_special_tokens)
        self._skipped = frozenset(tokenizer.all_special_ids if skip_special_tokens else [])
        self.tokens: list[str] = []
        self.prefix_offset = self.read_offset = 0

    def reset(self) -> None:
        self.tokens = []
        self.prefix_offset = self.read_offset = 0

    def step(self, token_id: int) -> str | None:
        self.tokens.extend(self._to_tokens([token_id]))
        prefix_text = self._tokens_to_string(self.tokens[self.prefix_offset : self.read_offset])
        new_text = self._tokens_to_string(self.tokens[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return None
        if not new_text.startswith(prefix_text):
            raise DecoderDesyncError("the text of the tokens read changed")
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        return new_text[len(prefix_text) :]

    def decode(self, token_ids: list[int]) -> str:
        return self._tokens_to_string(self._to_tokens(token_ids))

    def in_vocab(self, token_id: int) -> bool:
        try:
            return token_id >= 0 and self.tokenizer.convert_ids_to_tokens([token_id])[0] is not None
        except (IndexError, KeyError, OverflowError):
            return False

    def token_string(self, token_id: int) -> str:
        return self.tokenizer.convert_ids_to_tokens([token_id])[0] or ""

    def token_id(self, token: str) -> int | None:
        token_id = self.tokenizer.convert_tokens_to_ids(token)
        return token_id if token_id is not None and self.token_string(token_id) == token else None

    def _skipped_ids(self) -> frozenset[int]:
        return self._skipped

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _to_tokens(self, token_ids: list[int]) -> list[str]:
        tokens = self.tokenizer.convert_ids_to_tokens(token_ids, skip_special_tokens=self.skip_special_tokens)
        return [t for t in tokens if t is not None]  # ids outside the vocabulary have no token

    def _tokens_to_string(self, tokens: list[str]) -> str:
        """vLLM ``_convert_tokens_to_string_with_added_encoders``: added tokens stand alone, optionally
        separated by spaces; the rest goes through ``convert_tokens_to_string``."""
        if not self.added_vocab:
            return self.tokenizer.convert_tokens_to_string(tokens)
        sub_texts: list[str] = []
        current: list[str] = []
        for token in tokens:
            if self.skip_special_tokens and token in self.all_special_tokens:
                continue
            if token in self.added_vocab:
                if current:
                    sub_texts.append(self.tokenizer.convert_tokens_to_string(current))
                    current = []
                sub_texts.append(token)
            else:
                current.append(token)
        if current:
            sub_texts.append(self.tokenizer.convert_tokens_to_string(current))
        return (" " if self.spaces_between_special_tokens else "").join(sub_texts)
