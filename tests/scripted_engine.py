"""A scripted engine: the real server with the "model" replaced by a script.

Everything but the weights is real: the dialects, the embedded model's chat template and tokenizer,
the incremental detokenizer and the output parser. The engine (the fake of tests/unit/fakes.py)
replays a scripted text as the model's reply, tokenized with the real tokenizer and emitted one
token per step, so a real client (Codex, Claude Code) can be walked through a tool loop whose
every turn is known. It lives in tests/ and is served only through
`dflash.app.serve(config, loader=scripted_loader(engine))`: no config a user writes reaches it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from functools import partial

import attrs

from dflash.api import ModelText
from dflash.chat.detokenize import IncrementalDetokenizer, token_bytes
from dflash.chat.template import chat_template_for
from dflash.config import Config
from dflash.engine.loading import DEFAULT_CACHE_DIR, EMBEDDED_DEFAULT, resolve_source
from tests.unit.fakes import FakeEngine

# Claude Code's first request is ~20K tokens of the embedded model's tokenizer.
SCRIPTED_MAX_CTX = 32768
# Prefill costs nothing here; big chunks keep a 20K-token prompt to a few steps.
SCRIPTED_PREFILL_CHUNK = 4096
# For requests the script does not cover (a client's side requests: titles, summaries).
DEFAULT_REPLY = "OK."


@attrs.frozen
class Step:
    """Reply `reply` to any prompt that contains `after`: the task's text for the first step, the
    tool result the step before asked for after that. Of several matching steps the last wins, so
    a script reads in order and a retried request gets the same reply."""

    after: str
    reply: str


@attrs.frozen
class Turn:
    """One generation the engine ran: the prompt as the server rendered it, and the reply given."""

    prompt: str
    reply: str
    scripted: bool  # the reply came from a step, not DEFAULT_REPLY


@functools.cache
def embedded_tokenizer():
    """The embedded model's tokenizer (converted from its GGUF file once, then read from the cache)."""
    from transformers import AutoTokenizer

    _, folder = resolve_source(EMBEDDED_DEFAULT, DEFAULT_CACHE_DIR)
    return AutoTokenizer.from_pretrained(folder)


class ScriptedEngine(FakeEngine):
    """The fake engine's contract (one generation at a time, stepwise, stats), with the embedded
    model's tokens: each reply is chosen from `steps` by the rendered prompt."""

    def __init__(self, steps: Sequence[Step], *, max_ctx: int = SCRIPTED_MAX_CTX):
        super().__init__(max_ctx=max_ctx, prefill_chunk=SCRIPTED_PREFILL_CHUNK)
        self.tokenizer = embedded_tokenizer()
        # The token the real model ends a turn with (<|im_end|>), which the real engine stops at.
        self.eos_token_id = self.tokenizer.eos_token_id
        self.steps = tuple(steps)
        self.turns: list[Turn] = []

    def reply_ids(self, prompt_ids: list[int]) -> list[int]:
        prompt = self.tokenizer.decode(prompt_ids)
        matching = [step.reply for step in self.steps if step.after in prompt]
        reply = matching[-1] if matching else DEFAULT_REPLY
        self.turns.append(Turn(prompt, reply, scripted=bool(matching)))
        return self.tokenizer.encode(reply, add_special_tokens=False)

    def scripted_turns(self) -> list[Turn]:
        return [turn for turn in self.turns if turn.scripted]


def scripted_loader(engine: ScriptedEngine):
    """A `dflash.app.serve` loader: `engine`, and the embedded model's real text side."""

    def load(config: Config) -> tuple[ScriptedEngine, ModelText]:
        tokenizer = engine.tokenizer
        text = ModelText(model_id=resolve_source(EMBEDDED_DEFAULT, DEFAULT_CACHE_DIR)[0], max_ctx=engine.max_ctx,
                         template=chat_template_for(tokenizer),
                         new_detokenizer=partial(IncrementalDetokenizer, tokenizer),
                         token_bytes=partial(token_bytes, tokenizer), vocab_size=len(tokenizer),
                         aliases=config.model.aliases)
        return engine, text

    return load
