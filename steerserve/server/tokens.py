"""How answers show a single token: its bytes and its text (logprobs).

A token's bytes are what it adds to the output, which its decoded text cannot always say: a
byte-level token holding half of a UTF-8 character decodes to U+FFFD. Bytes come from the
vocabulary piece: byte-level BPE pieces map back through GPT-2's byte alphabet; SentencePiece
pieces are text with ``▁`` for a space or ``<0xNN>`` for one byte. A token whose bytes are not
UTF-8 on their own is shown as ``bytes:\\xNN...``, as OpenAI does, so that distinct tokens get
distinct texts (completions' ``top_logprobs`` is keyed by text).
"""

from __future__ import annotations

import functools
import re
from typing import Any

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class Tokens:
    """Bytes and display text of token ids, for one tokenizer (cached per id)."""

    def __init__(self, tokenizer: Any) -> None:
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = getattr(backend, "decoder", None)
        self.byte_level = decoder is not None and b'"ByteLevel"' in decoder.__getstate__()
        self._byte = {ch: b for b, ch in bytes_to_unicode().items()}
        self._special = set(tokenizer.all_special_ids)
        self._added = {i for i in getattr(tokenizer, "added_tokens_decoder", {})}
        self.bytes = functools.lru_cache(maxsize=1 << 16)(self._bytes)
        self.text = functools.lru_cache(maxsize=1 << 16)(self._text)

    def _bytes(self, token_id: int) -> bytes:
        if token_id in self._special:  # <eos> and the like add nothing to the text
            return b""
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            return self.tokenizer.decode([token_id]).encode()
        if token_id in self._added:  # matched literally, never byte-encoded
            return piece.encode()
        if self.byte_level and all(ch in self._byte for ch in piece):
            return bytes(self._byte[ch] for ch in piece)
        if m := _BYTE_PIECE.fullmatch(piece):
            return bytes([int(m.group(1), 16)])
        return piece.replace("▁", " ").encode()

    def _text(self, token_id: int) -> str:
        raw = self.bytes(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
