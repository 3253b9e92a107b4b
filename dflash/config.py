"""The configuration tree, read from TOML with tomllib and structured into attrs classes by cattrs.

Every problem stops start-up with one line that names the key path, the value and what was
expected (`server.port: expected an integer from 0 to 65535, got 70000`). Types are checked
strictly: TOML already has types, so `port = "8000"` or `keepalive_s = true` is a mistake to
report, not a value to coerce.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import attrs
import cattrs
from cattrs.errors import AttributeValidationNote, ForbiddenExtraKeysError

MiB = 1024 * 1024


class ConfigError(Exception):
    """A configuration problem, already worded as the one line the operator sees."""


class _Invalid(Exception):
    """A leaf value that is wrong; the loader adds the key path it was found at."""

    def __init__(self, value: Any, expected: str, *, key: str | None = None):
        super().__init__(f"expected {expected}, got {value!r}")
        self.value = value
        self.expected = expected
        # Set by attrs validators, which run after cattrs has left the attribute's own scope.
        self.key = key


def _number_range(kind: str, low: float, high: float | None = None, *, low_inclusive: bool = True):
    """An attrs validator for `low <= value [<= high]` (or `low < value`) that words its own error."""

    def check(instance, attribute, value):
        too_low = value < low if low_inclusive else value <= low
        too_high = high is not None and value > high
        if too_low or too_high:
            if high is not None:
                expected = f"{kind} from {low:g} to {high:g}"
            else:
                expected = f"{kind} {'>=' if low_inclusive else '>'} {low:g}"
            raise _Invalid(value, expected, key=attribute.name)

    return check


def _one_of(*choices: str):
    def check(instance, attribute, value):
        if value not in choices:
            raise _Invalid(value, "one of " + ", ".join(repr(c) for c in choices), key=attribute.name)

    return check


def _ints(low: int, high: int | None = None):
    return _number_range("an integer", low, high)


def _zero_or_at_least_one(instance, attribute, value):
    if value != 0 and value < 1:
        raise _Invalid(value, "0 (derived) or a number >= 1", key=attribute.name)


def _zero_or_positive(instance, attribute, value):
    if value < 0:
        raise _Invalid(value, "0 (derived) or a positive number", key=attribute.name)


def _seconds(low: float = 0.0):
    return _number_range("a number of seconds", low, low_inclusive=False)


@attrs.frozen
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = attrs.field(default=8000, validator=_ints(0, 65535))
    api_keys: tuple[str, ...] = ()
    metrics_auth: bool = True  # with api_keys set, GET /metrics needs a key too; false opens it to scrapers
    cors_origins: tuple[str, ...] = ("*",)
    # Host names answered besides loopback ones while listening on a loopback address (DNS rebinding).
    allowed_hosts: tuple[str, ...] = ()
    max_header_bytes: int = attrs.field(default=64 * 1024, validator=_ints(1024))
    max_body_bytes: int = attrs.field(default=32 * MiB, validator=_ints(1))
    header_timeout_s: float = attrs.field(default=30.0, validator=_seconds())
    body_timeout_s: float = attrs.field(default=60.0, validator=_seconds())
    idle_timeout_s: float = attrs.field(default=60.0, validator=_seconds())
    keepalive_s: float = attrs.field(default=15.0, validator=_seconds())
    queue_max: int = attrs.field(default=32, validator=_ints(0))
    shutdown_grace_s: float = attrs.field(default=30.0, validator=_number_range("a number of seconds", 0.0))


@attrs.frozen
class ModelConfig:
    source: str = "embedded:smollm2-135m-instruct"
    dtype: str = attrs.field(default="bfloat16", validator=_one_of("bfloat16", "float32"))
    # auto = the fewest weight bytes that hold the quality bar on this model (engine/quant.py).
    weights: str = attrs.field(default="auto", validator=_one_of("auto", "bf16", "fp32", "int8", "int4"))
    # The KV cache: float = the activation dtype (fp32 where a bf16 one would be slow on this CPU);
    # int8 = int8 codes with a scale per token and head (half bf16's bytes; AVX512-VNNI only);
    # auto = int8 with int8/int4 weights on a CPU with AMX tiles for it, else float (loading.auto_kv_cache).
    kv_cache: str = attrs.field(default="auto", validator=_one_of("auto", "float", "int8"))
    # Past the model's trained context (8192 for the embedded model) positions use RoPE scaling.
    max_ctx: int = attrs.field(default=32768, validator=_ints(16))
    rope_scaling: str = attrs.field(default="auto", validator=_one_of("auto", "none", "yarn", "linear"))
    # 0 = max_ctx / the trained context.
    rope_scaling_factor: float = attrs.field(default=0.0, validator=_zero_or_at_least_one)
    # YaRN's attention temperature: 0 = its own, 0.1 ln(factor) + 1 (see README, Context length).
    rope_attention_factor: float = attrs.field(default=0.0, validator=_zero_or_positive)
    # false: a scaling the server chooses applies from the first position past the trained context
    # (a shorter sequence runs the model as trained); true: at every position. See README, Context length.
    rope_scaling_static: bool = False
    threads: int = attrs.field(default=2, validator=_ints(1))
    prefill_chunk: int = attrs.field(default=256, validator=_ints(1))
    cache_dir: str = "~/.cache/dflash"
    aliases: tuple[str, ...] = ()


@attrs.frozen
class SpeculativeConfig:
    drafter: str = attrs.field(default="auto", validator=_one_of("auto", "dflash", "ngram", "none"))
    # A DFlash checkpoint folder; "auto" = the drafter shipped for the embedded model (none for
    # other models); "" = none (the auto drafter mode then uses n-grams only).
    draft_model: str = "auto"
    max_draft_tokens: int = attrs.field(default=8, validator=_ints(1, 64))
    # DFlash's draft trees: at most this many rows a verification (the policy picks fewer where its
    # drafts are unlikely or rows cost more); 0: the chain of its first choices. At most 15: a
    # verification of 16 rows is the most the native decode loop runs (model.FEW_ROWS).
    tree_rows: int = attrs.field(default=15, validator=_ints(0, 15))
    ngram_min: int = attrs.field(default=2, validator=_ints(1, 16))
    ngram_max: int = attrs.field(default=4, validator=_ints(1, 16))
    adaptive: bool = True


@attrs.frozen
class CacheConfig:
    prefix_cache_slots: int = attrs.field(default=16, validator=_ints(0, 1024))
    prefill_cache_slots: int = attrs.field(default=4, validator=_ints(0, 1024))
    memory_budget_mib: int = attrs.field(default=2048, validator=_ints(1))
    disk_dir: str = ""  # "" keeps snapshots in memory only
    disk_max_mib: int = attrs.field(default=4096, validator=_ints(1))
    agent_turn_cache: bool = False
    # The KV state the last request left behind serves the next request's shared prefix without a
    # copy; false makes every request start from a snapshot or from scratch (for measuring).
    reuse_live_state: bool = True


def _scorer(instance, attribute, value):
    if value.startswith("self:") and not (value[5:].isdigit() and int(value[5:]) >= 1):
        raise _Invalid(value, "'self:N' (the model's first N layers, N >= 1) or a model source", key=attribute.name)
    if not value:
        raise _Invalid(value, "'self:N' or a model source", key=attribute.name)


@attrs.frozen
class PrefillConfig:
    # Speculative prefill (engine/pflash.py): "auto" compresses prompts with at least
    # threshold_tokens uncached tokens, "always" every prompt with something to drop, "fit" only
    # prompts longer than the context (instead of refusing them).
    compression: str = attrs.field(default="off", validator=_one_of("off", "auto", "always", "fit"))
    threshold_tokens: int = attrs.field(default=8192, validator=_ints(1))
    keep_ratio: float = attrs.field(default=0.2, validator=_number_range("a ratio", 0.0, 1.0, low_inclusive=False))
    chunk_tokens: int = attrs.field(default=32, validator=_ints(1, 4096))
    scorer: str = attrs.field(default="self:8", validator=_scorer)
    # The scorer's tokens attend over the prompt's first tokens and this many before their chunk
    # (its cost then grows linearly with the prompt); 0: over the whole prompt.
    scorer_window: int = attrs.field(default=1024, validator=_ints(0))


@attrs.frozen
class LoggingConfig:
    level: str = attrs.field(default="info", validator=_one_of("debug", "info", "warning", "error"))
    format: str = attrs.field(default="json", validator=_one_of("json", "console"))
    log_text: bool = False


def _ray_address(instance, attribute, value):
    if value not in ("auto", "local") and not value.startswith("ray://"):
        raise _Invalid(value, "'auto', 'local' or a 'ray://host:port' address", key=attribute.name)


@attrs.frozen
class ClusterConfig:
    """`dflash cluster`: engine replicas on Ray Serve behind one HTTP front (dflash/cluster/)."""

    replicas: int = attrs.field(default=2, validator=_ints(1))
    # "local" starts a Ray instance for this process; "auto" joins the one `ray start` began on
    # this machine; "ray://host:10001" reaches a cluster's head through Ray Client.
    address: str = attrs.field(default="local", validator=_ray_address)
    # Passed to Serve for each replica: num_cpus, num_gpus, resources, runtime_env...
    ray_actor_options: dict[str, Any] = attrs.field(factory=lambda: {"num_cpus": 1})
    router: str = attrs.field(default="affine", validator=_one_of("affine", "power_of_two"))
    # How many more generations in flight a conversation's replica may have than the least
    # loaded one before the conversation moves there.
    imbalance_threshold: int = attrs.field(default=2, validator=_ints(0))


@attrs.frozen
class Config:
    server: ServerConfig = attrs.Factory(ServerConfig)
    model: ModelConfig = attrs.Factory(ModelConfig)
    speculative: SpeculativeConfig = attrs.Factory(SpeculativeConfig)
    cache: CacheConfig = attrs.Factory(CacheConfig)
    prefill: PrefillConfig = attrs.Factory(PrefillConfig)
    logging: LoggingConfig = attrs.Factory(LoggingConfig)
    cluster: ClusterConfig = attrs.Factory(ClusterConfig)


def _strict(expected_type: type, expected: str):
    # `type(value) is int` rather than isinstance: TOML booleans are Python bools, and
    # `port = true` must not pass as 1.
    def structure(value, _type):
        if type(value) is not expected_type:
            raise _Invalid(value, expected)
        return value

    return structure


def _structure_float(value, _type) -> float:
    if type(value) not in (int, float):
        raise _Invalid(value, "a number")
    return float(value)


def _structure_strings(value, _type) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(type(item) is str for item in value):
        raise _Invalid(value, "a list of strings")
    return tuple(value)


def _converter() -> cattrs.Converter:
    converter = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)
    converter.register_structure_hook(int, _strict(int, "an integer"))
    converter.register_structure_hook(str, _strict(str, "a string"))
    converter.register_structure_hook(bool, _strict(bool, "true or false"))
    converter.register_structure_hook(float, _structure_float)
    converter.register_structure_hook_func(lambda t: t == tuple[str, ...], _structure_strings)
    return converter


_CONVERTER = _converter()


def config_from_dict(raw: dict[str, Any]) -> Config:
    """Structure an already-parsed TOML document; raises ConfigError naming the first bad key."""
    for section, value in raw.items():
        if section in attrs.fields_dict(Config) and not isinstance(value, dict):
            raise ConfigError(f"{section}: expected a table ([{section}]), got {value!r}")
    try:
        return _CONVERTER.structure(raw, Config)
    except Exception as exc:
        raise ConfigError(_describe(exc, (), raw)) from None


def load_config(path: str | Path) -> Config:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config file: {exc.strerror}") from None
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None
    try:
        return config_from_dict(raw)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def with_overrides(config: Config, *, host: str | None = None, port: int | None = None,
                   model: str | None = None) -> Config:
    """Apply command-line flags on top of the file; they go through the same validators."""
    server_changes = {k: v for k, v in (("host", host), ("port", port)) if v is not None}
    try:
        server = attrs.evolve(config.server, **server_changes)
    except _Invalid as exc:
        raise ConfigError(f"--port (server.port): {exc}") from None
    model_config = config.model if model is None else attrs.evolve(config.model, source=model)
    return attrs.evolve(config, server=server, model=model_config)


def _describe(exc: BaseException, path: tuple[str, ...], raw: Any) -> str:
    """Walk cattrs' exception tree down to the first leaf and word it as one line."""
    names = [note.name for note in getattr(exc, "__notes__", ()) if isinstance(note, AttributeValidationNote)]
    path = path + tuple(names)
    key = ".".join(path) or "config"
    if isinstance(exc, ForbiddenExtraKeysError):
        unknown = sorted(exc.extra_fields)[0]
        known = ", ".join(field.name for field in attrs.fields(exc.cl))
        value = _lookup(raw, path + (unknown,))
        return f"{'.'.join(path + (unknown,))}: unknown key (value {value!r}); expected one of: {known}"
    if isinstance(exc, BaseExceptionGroup):
        return _describe(exc.exceptions[0], path, raw)
    if isinstance(exc, _Invalid):
        return f"{'.'.join(path + (exc.key,)) if exc.key else key}: {exc}"
    return f"{key}: invalid value {_lookup(raw, path)!r}: {exc}"


def _lookup(raw: Any, path: tuple[str, ...]) -> Any:
    for name in path:
        if not isinstance(raw, dict):
            return None
        raw = raw.get(name)
    return raw
