"""A fake model for server tests: the engine contract of dflash/engine/contract.py, and a
byte-level text side (token id = byte value, EOS = 256) with a ChatML template (the embedded
SmolLM2's), with configurable slow steps. The engine replies with scripted text, so a test can
make the "model" write reasoning, tool calls or stop strings, split one byte per token.

Also a launcher for bench/ and subprocess tests:
    python -m tests.unit.fakes CONFIG.toml [--prefill-step-ms MS] [--decode-step-ms MS] [--prefill-chunk N]
                               [--endless] [--reply TEXT]
"""

from __future__ import annotations

import argparse
import codecs
import sys
import threading
import time
from functools import partial

import attrs

from dflash.chat.template import ChatTemplate, Tokenized
from dflash.config import Config
from dflash.engine.contract import CacheStats, GenerationStats
from dflash.protocols.canonical import GenerationRequest, Message
from dflash.reply import ModelText

EOS = 256
VOCAB_SIZE = 257
REPLY = "Hello from the fake engine. "
# SmolLM2-135M-Instruct's template: ChatML with a default system turn, and no notion of tools.
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SCRIPTED_LOGIT = 5.0  # the scripted token's logit; every other token's is 0


class ScriptedSampler:
    """The sampler of a FakeGeneration: it "samples" the next byte of the script, and shows a
    distribution that favours that byte (for the scheduler's logprob recorder)."""

    def __init__(self, engine: FakeEngine, sampling, prompt_ids: list[int]):
        self._script = engine.reply_ids(prompt_ids)
        self._endless = engine.endless
        self._eos = engine.eos_token_id
        self.params = sampling

    def sample(self, logits, history: list[int]) -> int:
        index = len(history)
        if self._endless:
            return self._script[index % len(self._script)]
        return self._script[index] if index < len(self._script) else self._eos

    def process(self, logits, history: list[int]):
        import torch

        processed = torch.zeros(VOCAB_SIZE)
        processed[self.sample(logits, history)] = SCRIPTED_LOGIT
        return processed

    def probabilities(self, logits):
        import torch

        return torch.softmax(logits, dim=-1)


@attrs.define
class FakeStepOutput:
    tokens: list[int]
    finished: str | None


class FakeGeneration:
    def __init__(self, engine: FakeEngine, prompt_ids: list[int], sampling, max_tokens: int,
                 snapshot_at=()):
        self._engine = engine
        self.prompt_ids = list(prompt_ids)
        self.sampling = sampling
        self.max_tokens = max_tokens
        self.snapshot_at = tuple(snapshot_at)
        self.sampler = ScriptedSampler(engine, sampling, self.prompt_ids)
        self.output: list[int] = []
        self.finished: str | None = None
        self.stats = GenerationStats(prompt_tokens=len(prompt_ids))
        self.step_starts: list[float] = []  # time.monotonic() at the start of each step
        self.closed_at: float | None = None
        self.grammar: str | None = None
        self._prefilled = 0

    @property
    def closed(self) -> bool:
        return self.closed_at is not None

    def steps_started_after(self, moment: float) -> int:
        return sum(start > moment for start in self.step_starts)

    def step(self) -> FakeStepOutput:
        if self.finished is not None or self.closed:
            raise RuntimeError(f"step() on a finished or closed generation (finished={self.finished!r})")
        self.step_starts.append(time.monotonic())
        if self._engine.fail_on_step is not None and len(self.step_starts) == self._engine.fail_on_step:
            raise RuntimeError("fake engine failure")
        if self._prefilled < len(self.prompt_ids):
            return self._prefill_chunk()
        return self._decode_one()

    def _prefill_chunk(self) -> FakeStepOutput:
        began = time.monotonic()
        time.sleep(self._engine.prefill_step_s)
        chunk = min(self._engine.prefill_chunk, len(self.prompt_ids) - self._prefilled)
        self._prefilled += chunk
        self.stats.prefilled_tokens += chunk
        self.stats.prefill_ms += (time.monotonic() - began) * 1000
        return FakeStepOutput(tokens=[], finished=None)

    def _decode_one(self) -> FakeStepOutput:
        began = time.monotonic()
        time.sleep(self._engine.decode_step_s)
        token = self.sampler.sample(None, self.output)
        self.stats.generated_tokens += 1
        if token == self._engine.eos_token_id:
            self.finished = "stop"
        else:
            self.output.append(token)
            if self.stats.generated_tokens >= self.max_tokens:
                self.finished = "length"
        self.stats.decode_ms += (time.monotonic() - began) * 1000
        return FakeStepOutput(tokens=[token] if token != self._engine.eos_token_id else [], finished=self.finished)

    def close(self) -> None:
        if self.closed_at is None:
            self.closed_at = time.monotonic()
            self._engine._closed(self)


class FakeGrammarTokenizer:
    """Checks a grammar as the engine's GrammarTokenizer does, without a vocabulary."""

    def validate(self, grammar: str) -> None:
        import llguidance

        from dflash.engine.grammar import GrammarError

        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, None)
        if is_error:
            raise GrammarError(messages[0] if messages else "invalid grammar")


class FakeEngine:
    """Follows dflash.engine.contract.Engine, as dflash.engine.generate.Engine does. Checks the
    scheduler keeps to it: one live generation at a time, every call from one thread, no step
    after the end."""

    eos_token_id = EOS

    def __init__(self, *, max_ctx: int = 4096, prefill_chunk: int = 16, prefill_step_s: float = 0.0,
                 decode_step_s: float = 0.0, reply: str = REPLY, endless: bool = False,
                 fail_on_step: int | None = None):
        self.max_ctx = max_ctx
        self.prefill_chunk = prefill_chunk
        self.prefill_step_s = prefill_step_s
        self.decode_step_s = decode_step_s
        self.reply = reply
        self.endless = endless
        self.fail_on_step = fail_on_step  # the n-th step of every generation raises
        self.generations: list[FakeGeneration] = []
        self.live: FakeGeneration | None = None
        self.threads: set[str] = set()
        self.checkpoints: list[list[int]] = []  # agent turn checkpoints asked of the engine
        self.closed = False  # at shutdown

    def start(self, prompt_ids: list[int], sampling, max_tokens: int, *, snapshot_at=(),
              grammar: str | None = None, protected=()) -> FakeGeneration:
        self.threads.add(threading.current_thread().name)
        if self.live is not None:
            raise RuntimeError("start() while another generation is live")
        if len(prompt_ids) > self.max_ctx:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens is longer than max_ctx {self.max_ctx}")
        self.live = FakeGeneration(self, prompt_ids, sampling, max_tokens, snapshot_at)
        self.live.grammar = grammar  # recorded, not followed: the reply is scripted
        self.live.protected = tuple(protected)  # recorded: the fake never compresses
        self.generations.append(self.live)
        return self.live

    def reply_ids(self, prompt_ids: list[int]) -> list[int]:
        """The tokens of the reply to this prompt: here `reply`'s bytes, whatever the prompt."""
        return list(self.reply.encode())

    def checkpoint_prefix(self, tokens: list[int]) -> int:
        self.threads.add(threading.current_thread().name)
        if self.live is not None:
            raise RuntimeError("checkpoint_prefix() while a generation is live")
        self.checkpoints.append(list(tokens))
        return len(tokens)

    def grammar_tokenizer(self) -> FakeGrammarTokenizer:
        self.threads.add(threading.current_thread().name)
        return FakeGrammarTokenizer()

    def cache_stats(self) -> CacheStats:
        """The live state holds the last generation's prompt and output, as the real engine's does."""
        self.threads.add(threading.current_thread().name)
        last = self.generations[-1] if self.generations else None
        held = len(last.prompt_ids) + len(last.output) if last is not None else 0
        return CacheStats(kv_tokens=held, kv_capacity=self.max_ctx)

    def close(self) -> None:
        self.threads.add(threading.current_thread().name)
        if self.live is not None:
            raise RuntimeError("close() while a generation is live")
        self.closed = True

    @property
    def idle(self) -> bool:
        return self.live is None

    def _closed(self, generation: FakeGeneration) -> None:
        if self.live is generation:
            self.live = None


def byte_tokenize(text: str) -> Tokenized:
    """One token per UTF-8 byte; each token starts at the text offset of its character."""
    ids: list[int] = []
    starts: list[int] = []
    for offset, char in enumerate(text):
        encoded = char.encode()
        ids += encoded
        starts += [offset] * len(encoded)
    return Tokenized(ids, starts)


FAKE_TEMPLATE = ChatTemplate(CHATML_TEMPLATE, tokenize=byte_tokenize)


def prompt_tokens(*contents: str) -> int:
    """The fake prompt's length for user messages with these contents (no tools)."""
    messages = tuple(Message("user", content) for content in contents)
    return len(FAKE_TEMPLATE.render(GenerationRequest(messages)).token_ids)


class FakeDetokenizer:
    """Bytes to text, holding back incomplete UTF-8 like the real one; EOS and other ids > 255 vanish."""

    def __init__(self):
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_ids: list[int]) -> str:
        return self._decoder.decode(bytes(token for token in token_ids if token < 256))

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


def fake_text(max_ctx: int, aliases: tuple[str, ...] = ()) -> ModelText:
    return ModelText(model_id="fake-model", max_ctx=max_ctx, template=FAKE_TEMPLATE, new_detokenizer=FakeDetokenizer,
                     token_bytes=lambda token_id: bytes([token_id]) if token_id < 256 else b"",
                     vocab_size=VOCAB_SIZE, aliases=aliases)


def fake_loader(engine: FakeEngine):
    """A `dflash.app.serve` loader that serves `engine`."""

    def load(config: Config):
        return engine, fake_text(engine.max_ctx, config.model.aliases)

    return load


def main(argv: list[str] | None = None) -> int:
    import trio

    from dflash import logs
    from dflash.app import serve
    from dflash.config import ConfigError, load_config

    parser = argparse.ArgumentParser(prog="python -m tests.unit.fakes", description="serve the fake engine")
    parser.add_argument("config")
    parser.add_argument("--prefill-step-ms", type=float, default=20.0)
    parser.add_argument("--decode-step-ms", type=float, default=5.0)
    parser.add_argument("--prefill-chunk", type=int, default=16)
    parser.add_argument("--endless", action="store_true", help="never emit EOS (replies end at max_tokens)")
    parser.add_argument("--reply", default=REPLY, help="what the fake model writes, e.g. a <tool_call> block")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    logs.configure(config.logging.level, config.logging.format)
    engine = FakeEngine(max_ctx=config.model.max_ctx, prefill_chunk=args.prefill_chunk,
                        prefill_step_s=args.prefill_step_ms / 1000, decode_step_s=args.decode_step_ms / 1000,
                        reply=args.reply, endless=args.endless)
    trio.run(partial(serve, config, loader=fake_loader(engine)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
