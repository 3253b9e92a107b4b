"""API keys: both header forms, constant-time compare, 401 in the dialect's shape, /health open."""

from __future__ import annotations

from tests.unit.rawhttp import request

KEY = "sk-local-123"


async def test_bearer_and_x_api_key_are_both_accepted(start_server):
    served = await start_server(api_keys=["other", KEY])
    bearer = await request(served.port, "GET", "/v1/models", headers=[("authorization", f"Bearer {KEY}")])
    x_api_key = await request(served.port, "GET", "/v1/models", headers=[("x-api-key", KEY)])
    assert bearer.status == 200
    assert x_api_key.status == 200


async def test_missing_or_wrong_key_gets_401_in_openai_shape(start_server):
    served = await start_server(api_keys=[KEY])
    for headers in ([], [("authorization", "Bearer nope")], [("x-api-key", KEY + "x")], [("authorization", KEY)]):
        reply = await request(served.port, "POST", "/v1/chat/completions", headers=headers, body=b"{}")
        assert reply.status == 401, headers
        assert reply.headers["www-authenticate"] == "Bearer"
        error = reply.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["code"] == "invalid_api_key"


async def test_401_on_anthropic_paths_has_the_anthropic_shape(start_server):
    served = await start_server(api_keys=[KEY])
    reply = await request(served.port, "POST", "/v1/messages?beta=true", body=b"{}")
    assert reply.status == 401
    body = reply.json()
    assert body["type"] == "error"
    assert body["error"]["type"] == "authentication_error"
    assert body["error"]["message"]


async def test_health_stays_open(start_server):
    served = await start_server(api_keys=[KEY])
    assert (await request(served.port, "GET", "/health")).status == 200
    assert (await request(served.port, "GET", "/")).status == 401


async def test_no_keys_configured_means_no_auth(start_server):
    served = await start_server()
    assert (await request(served.port, "GET", "/v1/models")).status == 200
