"""Grammar-constrained decoding with llguidance: a matcher per request gives the allowed-token mask
for each position; tokens are committed to it as they are emitted.

Grammars come in llguidance's own form (a JSON object naming Lark, JSON-schema or regex grammars,
as produced by `grammar_from_*`). Compiling a client's schema checks it up front, so an invalid or
unsupported schema is a clear error before anything is generated.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

import numpy as np
import torch
from torch import Tensor


class GrammarError(ValueError):
    """An invalid or unsupported grammar or schema; the message says which part."""


def json_schema_grammar(schema: dict[str, Any] | bool) -> str:
    import llguidance

    try:
        return llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults={"whitespace_flexible": False}
        )
    except ValueError as exc:
        raise GrammarError(f"invalid JSON schema: {exc}") from None


def lark_grammar(lark: str) -> str:
    import llguidance

    return llguidance.LLMatcher.grammar_from_lark(lark)


def regex_grammar(regex: str) -> str:
    import llguidance

    return llguidance.LLMatcher.grammar_from_regex(regex)


class GrammarTokenizer:
    """The model's tokenizer as llguidance sees it (built once: it takes about a second)."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: Sequence[int]):
        import llguidance.hf

        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.ll = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=self.eos_token_ids[:1] or None)

    def validate(self, grammar: str) -> None:
        import llguidance

        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.ll)
        if is_error:
            raise GrammarError(messages[0] if messages else "invalid grammar")

    def matcher(self, grammar: str) -> "GrammarConstraint":
        return GrammarConstraint(self, grammar)


class GrammarConstraint:
    def __init__(self, tokenizer: GrammarTokenizer, grammar: str):
        import llguidance

        self.tokenizer = tokenizer
        self.matcher = llguidance.LLMatcher(tokenizer.ll, grammar, log_level=0)
        if self.matcher.is_error():
            raise GrammarError(self.matcher.get_error())

    def allowed(self) -> Tensor:
        """[V] bool: the tokens the grammar allows next (end of sequence only where it may end)."""
        words = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        bits = np.unpackbits(words, bitorder="little")[: self.tokenizer.vocab_size]
        allowed = torch.from_numpy(bits.astype(np.bool_))
        if allowed[self.tokenizer.eos_token_ids[:1]].any():
            allowed[self.tokenizer.eos_token_ids] = True  # any of the model's end tokens may end it
        return allowed

    def apply(self, logits: Tensor) -> Tensor:
        return logits.masked_fill(~self.allowed().to(logits.device), float("-inf"))

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens` the grammar would accept in a row from here (nothing is consumed)."""
        return self.matcher.validate_tokens(list(tokens))

    def consume(self, token: int) -> None:
        if token in self.tokenizer.eos_token_ids:
            token = self.tokenizer.eos_token_ids[0]
        if not self.matcher.consume_token(token):
            raise GrammarError(f"token {token} violates the grammar: {self.matcher.get_error()}")

    @property
    def is_stopped(self) -> bool:
        return self.matcher.is_stopped()
