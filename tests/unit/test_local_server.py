"""A server on a loopback address is for local clients: web pages that rebind their own name to
127.0.0.1 are refused by Host, CORS preflights from unlisted origins get no allow headers, an
exposed server without keys is called out, and one key's stored responses are not another's."""

from __future__ import annotations

import pytest

from dflash.api import exposure_warnings
from dflash.config import ServerConfig
from dflash.http.routing import host_name, is_loopback_host
from tests.unit.dialects import PLAIN, post
from tests.unit.fakes import FakeEngine
import trio

from tests.unit.rawhttp import RawClient, request
from tests.unit.wsclient import ResponsesClient

CHAT = "/v1/chat/completions"
BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "127.0.0.1.evil.example", "10.0.0.5:80"])
async def test_a_foreign_host_is_refused_on_a_loopback_server(start_server, host):
    served = await start_server()
    reply = await request(served.port, "POST", CHAT, json_body=BODY, headers=[("host", host)])
    assert reply.status == 403 and host in reply.json()["error"]["message"]
    assert not served.engine.generations


@pytest.mark.parametrize("host", ["127.0.0.1:{port}", "localhost:{port}", "localhost", "[::1]:{port}",
                                  "app.localhost:{port}", "127.0.0.2"])
async def test_loopback_hosts_are_served(start_server, host):
    served = await start_server()
    reply = await request(served.port, "POST", CHAT, json_body=BODY,
                          headers=[("host", host.format(port=served.port))])
    assert reply.status == 200


async def test_allowed_hosts_are_served_too(start_server):
    served = await start_server(allowed_hosts=["devbox.lan"])
    assert (await request(served.port, "GET", "/", headers=[("host", "devbox.lan:8000")])).status == 200
    assert (await request(served.port, "GET", "/", headers=[("host", "other.lan")])).status == 403


async def test_the_websocket_handshake_is_checked_by_host_too(start_server):
    served = await start_server()
    upgrade = [("upgrade", "websocket"), ("connection", "Upgrade"), ("sec-websocket-version", "13"),
               ("sec-websocket-key", "dGhlIHNhbXBsZSBub25jZQ==")]
    refused = await request(served.port, "GET", "/v1/responses", headers=[("host", "evil.example"), *upgrade])
    assert refused.status == 403
    client = await RawClient.open(served.port)  # a 101 has no body to read: only its head
    await client.send_request("GET", "/v1/responses", headers=[("host", "localhost"), *upgrade])
    with trio.fail_after(5):
        event = await client.next_event()
    assert event.status_code == 101
    await client.aclose()


def test_host_names_and_loopback():
    assert host_name("[::1]:8000") == "[::1]" and host_name("example.com:80") == "example.com"
    assert host_name("::1") == "::1" and host_name("example.com") == "example.com"
    assert all(is_loopback_host(name) for name in ("localhost", "127.0.0.1", "127.1.2.3", "::1", "[::1]", "a.localhost"))
    assert not any(is_loopback_host(name) for name in ("0.0.0.0", "::", "192.168.1.2", "localhost.evil.example"))


def test_an_exposed_server_without_keys_is_warned_about():
    assert list(exposure_warnings(ServerConfig(host="127.0.0.1"))) == []
    assert list(exposure_warnings(ServerConfig(host="0.0.0.0", api_keys=("k",)))) == []
    (warning,) = exposure_warnings(ServerConfig(host="0.0.0.0"))
    assert "0.0.0.0" in warning and "api_keys" in warning


async def test_root_lists_no_warning_on_loopback(start_server):
    served = await start_server()
    assert (await request(served.port, "GET", "/")).json()["warnings"] == []


async def test_a_preflight_from_an_unlisted_origin_gets_no_allow_headers(start_server):
    served = await start_server(cors_origins=["https://app.example"])
    preflight = [("access-control-request-method", "POST"), ("access-control-request-headers", "authorization")]
    refused = await request(served.port, "OPTIONS", CHAT, headers=[("origin", "https://evil.example"), *preflight])
    assert refused.status == 204
    assert not any(name.startswith("access-control-allow") for name in refused.headers)
    allowed = await request(served.port, "OPTIONS", CHAT, headers=[("origin", "https://app.example"), *preflight])
    assert allowed.headers["access-control-allow-origin"] == "https://app.example"
    assert allowed.headers["access-control-allow-headers"] == "authorization"


async def test_stored_responses_belong_to_their_api_key(start_server):
    served = await start_server(FakeEngine(reply=PLAIN), api_keys=["key-one", "key-two"])
    one, two = [("authorization", "Bearer key-one")], [("x-api-key", "key-two")]
    created = (await post(served.port, "/v1/responses", {"input": "hi", "store": True}, one)).json()
    path = f"/v1/responses/{created['id']}"
    assert (await request(served.port, "GET", path, headers=one)).status == 200
    assert (await request(served.port, "GET", path, headers=two)).status == 404
    chained = await post(served.port, "/v1/responses", {"input": "more", "previous_response_id": created["id"]}, two)
    assert chained.status == 404 and chained.json()["error"]["code"] == "previous_response_not_found"
    socket = await ResponsesClient.open(served.port, [("authorization", "Bearer key-two")])
    (error,) = await socket.create({"input": "more", "previous_response_id": created["id"]})
    assert error["error"]["code"] == "previous_response_not_found"
    await socket.aclose()
    socket = await ResponsesClient.open(served.port, one)
    events = await socket.create({"input": "more", "previous_response_id": created["id"]})
    assert events[-1]["type"] == "response.completed"
    await socket.aclose()
