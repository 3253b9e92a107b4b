"""The dialect-neutral request and output: what every dialect parses into and renders from.

A request is a conversation (messages with text, reasoning, tool calls and tool results), the
tools on offer, sampling, stop strings, output format, the reasoning switch and the token budget.
The output is a stream of events: reasoning and text deltas, tool calls (start, argument delta,
end), token logprobs, and one `Finished` with the reason and the numbers.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs

# The engine samples with the very object a dialect parses (see dflash/sampling_params.py).
from dflash.sampling_params import SamplingParams as Sampling

DEFAULT_MAX_TOKENS = 4096

Role = Literal["system", "user", "assistant", "tool"]
ToolKind = Literal["function", "custom"]
# "stop": the model ended its turn; "stop_sequence": a stop string cut it; "length": max tokens
# or the context ran out; "tool_calls": the turn ends in tool calls.
FinishReason = Literal["stop", "stop_sequence", "length", "tool_calls"]


# ---- request ---------------------------------------------------------------------------------

@attrs.frozen
class ToolCall:
    """A call the model made (in a reply) or made earlier (in history).

    `arguments` is JSON text for a function tool and the raw input for a custom (freeform) tool."""

    id: str
    name: str
    arguments: str
    kind: ToolKind = "function"


@attrs.frozen
class Message:
    role: Role
    content: str = ""
    reasoning: str | None = None  # an assistant turn's recorded reasoning
    tool_calls: tuple[ToolCall, ...] = ()  # assistant turns
    tool_call_id: str | None = None  # tool results
    name: str | None = None  # tool results: the tool that produced it


@attrs.frozen
class ToolGrammar:
    """The grammar a custom tool's raw input follows (Codex's `format: {type: "grammar"}`)."""

    syntax: Literal["lark", "regex"]
    definition: str


@attrs.frozen
class ToolSpec:
    """A tool the model may call. Custom tools take free text; they are shown to the model as a
    function with one string parameter `input`."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = attrs.field(factory=lambda: {"type": "object", "properties": {}})
    kind: ToolKind = "function"
    namespace: str | None = None  # Responses `namespace` tools are flattened; the name comes back with it
    grammar: ToolGrammar | None = None  # custom tools only


ToolChoiceMode = Literal["auto", "none", "required"]


@attrs.frozen
class ToolChoice:
    mode: ToolChoiceMode = "auto"
    name: str | None = None  # a named tool (mode "required")


@attrs.frozen
class OutputFormat:
    """Structured output, carried for the grammar engine; "text" is free text."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    schema: dict[str, Any] | None = None
    name: str | None = None
    # Where the dialect carries it ("response_format", "text.format", …): errors name that field.
    field: str = attrs.field(default="response_format", eq=False)


@attrs.frozen
class Thinking:
    """The reasoning switch. `enabled` None leaves the chat template's own default."""

    enabled: bool | None = None
    effort: str | None = None
    budget_tokens: int | None = None
    preserve: bool | None = None  # replay earlier turns' reasoning (templates that support it)


@attrs.frozen
class GenerationRequest:
    messages: tuple[Message, ...]
    model: str | None = None  # the name the client asked for; echoed back
    tools: tuple[ToolSpec, ...] = ()
    tool_choice: ToolChoice = ToolChoice()
    parallel_tool_calls: bool = True
    sampling: Sampling = Sampling()
    max_tokens: int = DEFAULT_MAX_TOKENS
    stop: tuple[str, ...] = ()
    stream: bool = False
    output_format: OutputFormat = OutputFormat()
    thinking: Thinking = Thinking()
    template_kwargs: dict[str, Any] = attrs.field(factory=dict)  # chat_template_kwargs, passed through
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0
    include_usage: bool = False  # a separate usage event at the end of a stream
    metadata: dict[str, Any] = attrs.field(factory=dict)  # user, metadata: tracing only

    @property
    def offered_tools(self) -> tuple[ToolSpec, ...]:
        """The tools the model is shown: none when tool_choice is "none"."""
        return () if self.tool_choice.mode == "none" else self.tools


# ---- output ----------------------------------------------------------------------------------

@attrs.frozen
class ReasoningDelta:
    text: str


@attrs.frozen
class TextDelta:
    text: str


@attrs.frozen
class ToolCallStart:
    index: int  # position among this reply's calls
    id: str
    name: str
    kind: ToolKind = "function"
    namespace: str | None = None


@attrs.frozen
class ToolCallDelta:
    index: int
    arguments: str  # a piece of the JSON arguments (function) or of the raw input (custom)


@attrs.frozen
class ToolCallEnd:
    index: int
    call: ToolCall  # the complete call


@attrs.frozen
class TokenLogprob:
    token: str
    logprob: float
    token_bytes: tuple[int, ...]
    top: tuple[tuple[str, float, tuple[int, ...]], ...] = ()  # (token, logprob, bytes), best first


@attrs.frozen
class Logprobs:
    tokens: tuple[TokenLogprob, ...]


@attrs.frozen
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV state was reused
    prefilled_tokens: int = 0  # prompt tokens computed
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    verification_steps: int = 0
    agent_turn_cache_hit: int = 0  # generations whose restored prefix included a generated turn
    compressed_from_tokens: int = 0  # speculative prefill: the prompt's tokens before compression (0: not compressed)
    scoring_ms: float = 0.0  # speculative prefill's scorer

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def acceptance_length(self) -> float:
        """Mean tokens committed per verification forward (accepted drafts + the target's token)."""
        if not self.verification_steps:
            return 0.0
        return (self.accepted_tokens + self.verification_steps) / self.verification_steps

    def __add__(self, other: Usage) -> Usage:
        """Several generations for one request (n > 1): every count adds up, the prompt's too, as OpenAI does."""
        return Usage(**{field.name: getattr(self, field.name) + getattr(other, field.name)
                        for field in attrs.fields(Usage)})


def timings(usage: Usage) -> dict[str, Any]:
    """The `usage.timings` object every dialect reports."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "agent_turn_cache_hit": bool(usage.agent_turn_cache_hit),
        "cached_prefix_tokens": usage.cached_tokens,
        "prefilled_tokens": usage.prefilled_tokens,
        "prefill_ms": round(usage.prefill_ms, 3),
        "decode_ms": round(usage.decode_ms, 3),
        "draft_tokens": usage.draft_tokens,
        "accepted_tokens": usage.accepted_tokens,
        "acceptance_length": round(usage.acceptance_length, 3),
        "compressed_from_tokens": usage.compressed_from_tokens,
        "scoring_ms": round(usage.scoring_ms, 3),
    }


@attrs.frozen
class Finished:
    reason: FinishReason
    usage: Usage
    stop_sequence: str | None = None  # the stop string that ended the reply


OutputEvent = (ReasoningDelta | TextDelta | ToolCallStart | ToolCallDelta | ToolCallEnd | Logprobs | Finished)

# What a dialect renders an event into: (SSE event name or None, payload). The payload is
# JSON-able, or a literal string such as Chat Completions' "[DONE]".
SSEEvent = tuple[str | None, Any]
