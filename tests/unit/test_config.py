"""Config errors stop start-up with one line naming the key path, the value and what was expected."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash.cli import main
from dflash.config import Config, ConfigError, config_from_dict, load_config, with_overrides

EXAMPLE = Path(__file__).parents[2] / "examples" / "default.toml"


def error_of(raw: dict) -> str:
    with pytest.raises(ConfigError) as caught:
        config_from_dict(raw)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_empty_file_gives_the_defaults():
    config = config_from_dict({})
    assert config == Config()
    assert config.server.host == "127.0.0.1"
    assert config.server.port == 8000
    assert config.server.cors_origins == ("*",)
    assert config.server.max_body_bytes == 32 * 1024 * 1024
    assert config.server.keepalive_s == 15.0
    assert config.model.source == "embedded:smollm2-135m-instruct"
    assert (config.model.max_ctx, config.model.rope_scaling, config.model.rope_scaling_factor) == (32768, "auto", 0.0)
    assert config.logging.format == "json"


def test_the_example_documents_exactly_the_defaults():
    assert load_config(EXAMPLE) == Config()


@pytest.mark.parametrize("raw, expected", [
    ({"server": {"prot": 8000}}, "server.prot: unknown key (value 8000)"),
    ({"pflash": {}}, "pflash: unknown key"),
    ({"server": {"port": "8000"}}, "server.port: expected an integer, got '8000'"),
    ({"server": {"port": 70000}}, "server.port: expected an integer from 0 to 65535, got 70000"),
    ({"server": {"keepalive_s": 0}}, "server.keepalive_s: expected a number of seconds > 0, got 0.0"),
    ({"server": {"keepalive_s": True}}, "server.keepalive_s: expected a number, got True"),
    ({"server": {"api_keys": "secret"}}, "server.api_keys: expected a list of strings, got 'secret'"),
    ({"server": {"queue_max": -1}}, "server.queue_max: expected an integer >= 0, got -1"),
    ({"model": {"dtype": "fp8"}}, "model.dtype: expected one of 'bfloat16', 'float32', got 'fp8'"),
    ({"model": {"max_ctx": 1.5}}, "model.max_ctx: expected an integer, got 1.5"),
    ({"model": {"kv_cache": "int4"}}, "model.kv_cache: expected one of 'auto', 'float', 'int8', got 'int4'"),
    ({"model": {"rope_scaling": "ntk"}}, "model.rope_scaling: expected one of 'auto', 'none', 'yarn', 'linear', got 'ntk'"),
    ({"model": {"rope_scaling": 4}}, "model.rope_scaling: expected a string, got 4"),
    ({"model": {"rope_scaling_factor": 0.5}}, "model.rope_scaling_factor: expected 0 (derived) or a number >= 1, got 0.5"),
    ({"model": {"rope_attention_factor": -1}}, "model.rope_attention_factor: expected 0 (derived) or a positive number, got -1.0"),
    ({"model": {"rope_attention_factor": "1"}}, "model.rope_attention_factor: expected a number, got '1'"),
    ({"model": {"rope_scaling_static": "yes"}}, "model.rope_scaling_static: expected true or false, got 'yes'"),
    ({"speculative": {"tree_rows": 16}}, "speculative.tree_rows: expected an integer from 0 to 15, got 16"),
    ({"logging": {"format": "xml"}}, "logging.format: expected one of 'json', 'console', got 'xml'"),
    ({"logging": {"log_text": 1}}, "logging.log_text: expected true or false, got 1"),
    ({"server": 5}, "server: expected a table ([server]), got 5"),
    ({"prefill": {"compression": "sometimes"}},
     "prefill.compression: expected one of 'off', 'auto', 'always', 'fit', got 'sometimes'"),
    ({"prefill": {"keep_ratio": 0}}, "prefill.keep_ratio: expected a ratio from 0 to 1, got 0.0"),
    ({"prefill": {"scorer": "self:0"}}, "prefill.scorer: expected 'self:N' (the model's first N layers, N >= 1)"),
    ({"prefill": {"chunk_tokens": 0}}, "prefill.chunk_tokens: expected an integer from 1 to 4096, got 0"),
    ({"prefill": {"scorer_window": -1}}, "prefill.scorer_window: expected an integer >= 0, got -1"),
])
def test_errors_name_the_key_the_value_and_the_expectation(raw, expected):
    assert error_of(raw).startswith(expected)


def test_toml_syntax_errors_name_the_file(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[server\nport = 1\n")
    with pytest.raises(ConfigError, match=r"bad\.toml: invalid TOML"):
        load_config(path)


def test_flags_override_the_file():
    config = with_overrides(Config(), host="0.0.0.0", port=9000, model="/models/x.gguf")
    assert (config.server.host, config.server.port, config.model.source) == ("0.0.0.0", 9000, "/models/x.gguf")
    with pytest.raises(ConfigError, match=r"server\.port\): expected an integer from 0 to 65535, got 99999"):
        with_overrides(Config(), port=99999)


def test_cli_prints_one_line_and_exits_2(tmp_path, capsys):
    path = tmp_path / "bad.toml"
    path.write_text("[server]\nport = 99999\n")
    assert main(["run", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "server.port" in err and "99999" in err


def test_tree_rows_reach_the_engine_and_zero_means_chains():
    from dflash.app import speculation_settings
    from dflash.config import SpeculativeConfig

    assert speculation_settings(SpeculativeConfig()).tree_rows == 15
    assert speculation_settings(SpeculativeConfig(tree_rows=0)).tree_rows == 0
    assert speculation_settings(SpeculativeConfig(tree_rows=6)).tree_rows == 6
