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


def token_bytes(tokenizer, token_id: int) -> bytes:
    """One token's raw bytes (a token may hold part of a UTF-8 character, which text cannot show).

    Byte-level BPE vocabularies spell bytes with GPT-2's printable alphabet; SentencePiece ones
    use `<0xNN>` for bytes and `▁` for a space; anything else is taken as its decoded text."""
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if isinstance(piece, str):
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        alphabet = _byte_alphabet()
        if piece and all(char in alphabet for char in piece) and token_id not in tokenizer.all_special_ids:
            return bytes(alphabet[char] for char in piece)
    return tokenizer.decode([token_id], skip_special_tokens=False).encode()


_BYTE_ALPHABET: dict[str, int] = {}


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte -> printable character map, inverted."""
    if not _BYTE_ALPHABET:
        printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
        extra = 0
        for byte in range(256):
            if byte in printable:
                _BYTE_ALPHABET[chr(byte)] = byte
            else:
                _BYTE_ALPHABET[chr(256 + extra)] = byte
                extra += 1
    return _BYTE_ALPHABET
