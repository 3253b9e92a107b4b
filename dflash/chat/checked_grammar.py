"""A reply's constraint (chat/constraints.py) compiled to the engine's grammar form and checked,
so that an invalid schema or grammar is a 400 that names the piece at fault, before anything is
sent.

Compiling uses dflash.engine.grammar (text in, grammar text out, no model state); the check runs
in the engine, which holds the tokenizer tables it needs, so it is handed in as a function (the
scheduler's `check_grammar`) rather than imported: this module stays below the scheduler.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Awaitable, Callable

from dflash.chat.constraints import Constraint, GrammarPart
from dflash.engine.grammar import GrammarError, json_schema_grammar, lark_grammar, regex_grammar
from dflash.protocols.errors import APIError

CHECKED_GRAMMARS_KEPT = 256  # grammars known valid; an agent sends the same tools and schema every turn


class CheckedGrammars:
    def __init__(self, check: Callable[[str], Awaitable[None]]):
        self._check = check  # raises GrammarError for an invalid or unsupported grammar
        self._known_valid: OrderedDict[str, None] = OrderedDict()

    async def compiled(self, constraint: Constraint | None) -> str | None:
        """The constraint compiled for the engine, and checked: each piece the client wrote on its
        own first, so that a 400 names the schema or grammar at fault."""
        if constraint is None:
            return None
        grammar = constraint.grammar()
        if grammar in self._known_valid:
            self._known_valid.move_to_end(grammar)
            return grammar
        for part in constraint.parts:
            try:
                await self._check(part_grammar(part))
            except GrammarError as exc:
                raise _invalid_part(part, exc) from None
        try:
            await self._check(grammar)
        except GrammarError as exc:
            raise APIError(400, f"the request's output constraints cannot be combined: {exc}") from None
        self._known_valid[grammar] = None
        if len(self._known_valid) > CHECKED_GRAMMARS_KEPT:
            self._known_valid.popitem(last=False)
        return grammar


def part_grammar(part: GrammarPart) -> str:
    try:
        if part.kind == "json_schema":
            return json_schema_grammar(part.source)
        return lark_grammar(part.source) if part.kind == "lark" else regex_grammar(part.source)
    except ValueError as exc:  # llguidance refuses some schemas while converting them
        raise _invalid_part(part, exc) from None


def _invalid_part(part: GrammarPart, problem: Exception) -> APIError:
    return APIError(400, f"{part.where} is invalid or unsupported for constrained decoding: {problem}",
                    param=part.param)
