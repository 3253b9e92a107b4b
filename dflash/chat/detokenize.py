"""Token ids -> text deltas, one step at a time.

Decoding a token alone is wrong for byte-level BPE (a character can span tokens) and for
SentencePiece (leading spaces depend on the neighbour), so each push decodes a short window of
recent tokens and emits only what extends the text already emitted. An incomplete UTF-8 sequence
(decoded as U+FFFD) is held back until the next token completes it.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, *, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # start of the context window decoded with each push
        self.read_offset = 0  # tokens before this have been emitted as text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_ids: list[int]) -> str:
        self.ids.extend(token_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        return self._emit(final=True)

    def _emit(self, *, final: bool) -> str:
        emitted = self._decode(self.ids[self.prefix_offset : self.read_offset])
        current = self._decode(self.ids[self.prefix_offset :])
        if len(current) <= len(emitted) or (current.endswith("\ufffd") and not final):
            return ""
        delta = current[len(emitted) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return delta
