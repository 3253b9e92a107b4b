"""Raw-socket tests of the HTTP layer: limits, malformed input, keep-alive, HEAD, OPTIONS, CORS."""

from __future__ import annotations

import h11
import trio

from tests.unit.rawhttp import RawClient, request

CHAT = "/v1/chat/completions"
HELLO = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def _refused(port: int, data: bytes) -> tuple[int, dict, bytes]:
    client = await RawClient.open(port)
    await client.send_raw(data)
    reply = await client.read_reply()
    assert reply.headers.get("connection") == "close", reply
    assert await client.is_closed_by_peer()
    return reply.status, reply.headers, reply.body


async def test_oversized_headers_get_431(start_server):
    served = await start_server(max_header_bytes=2048)
    status, _, _ = await _refused(served.port, b"GET / HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 4096 + b"\r\n\r\n")
    assert status == 431


async def test_body_over_limit_by_content_length_gets_413_without_reading_it(start_server):
    served = await start_server(max_body_bytes=1000)
    head = f"POST {CHAT} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 5000\r\n\r\n"
    status, _, body = await _refused(served.port, head.encode())  # the body is never sent
    assert status == 413
    assert b"5000" in body


async def test_chunked_body_over_limit_gets_413_at_the_crossing(start_server):
    served = await start_server(max_body_bytes=1000)
    client = await RawClient.open(served.port)
    await client.send_raw(f"POST {CHAT} HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n".encode())
    await client.send_raw(b"258\r\n" + b"a" * 600 + b"\r\n" + b"258\r\n" + b"a" * 600 + b"\r\n")
    # No terminating chunk: the answer must come from crossing the limit, not from the end.
    reply = await client.read_reply()
    assert reply.status == 413
    assert await client.is_closed_by_peer()


async def test_slow_headers_get_408(start_server):
    served = await start_server(header_timeout_s=0.3)
    client = await RawClient.open(served.port)
    await client.send_raw(b"GET / HTTP/1.1\r\nhost: x\r\n")
    with trio.fail_after(3):
        reply = await client.read_reply()
    assert reply.status == 408
    assert await client.is_closed_by_peer()


async def test_slow_body_gets_408(start_server):
    served = await start_server(body_timeout_s=0.3)
    client = await RawClient.open(served.port)
    await client.send_raw(f"POST {CHAT} HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{{".encode())
    with trio.fail_after(3):
        reply = await client.read_reply()
    assert reply.status == 408
    assert reply.json()["error"]["type"] == "invalid_request_error"


async def test_silent_connection_is_closed_quietly(start_server):
    served = await start_server(header_timeout_s=0.2)
    client = await RawClient.open(served.port)
    with trio.fail_after(3):
        assert await client.stream.receive_some(1000) == b""


async def test_malformed_request_gets_400(start_server):
    served = await start_server()
    status, _, _ = await _refused(served.port, b"THIS IS NOT HTTP\r\n\r\n")
    assert status == 400


async def test_bad_content_length_gets_400(start_server):
    served = await start_server()
    status, _, _ = await _refused(served.port, b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: -5\r\n\r\n")
    assert status == 400


async def test_a_slow_client_does_not_disturb_others(start_server):
    served = await start_server(header_timeout_s=1.0)
    slow = await RawClient.open(served.port)
    await slow.send_raw(b"GET / HTTP/1.1\r\n")
    with trio.fail_after(0.5):
        reply = await request(served.port, "GET", "/health")
    assert reply.status == 200
    await slow.aclose()


async def test_keep_alive_serves_several_requests_on_one_connection(start_server):
    served = await start_server()
    client = await RawClient.open(served.port)
    first = await client.request("GET", "/health")
    second = await client.request("POST", CHAT, json_body=HELLO)
    third = await client.request("GET", "/v1/models")
    assert [first.status, second.status, third.status] == [200, 200, 200]
    assert first.headers["x-request-id"] != second.headers["x-request-id"]


async def test_expect_100_continue(start_server):
    served = await start_server()
    client = await RawClient.open(served.port)
    body = b'{"messages":[{"role":"user","content":"hi"}],"max_tokens":2}'
    await client.send_raw(client.h11.send(h11.Request(method="POST", target=CHAT, headers=[
        ("host", "localhost"), ("expect", "100-continue"), ("content-type", "application/json"),
        ("content-length", str(len(body)))])))
    with trio.fail_after(3):
        interim = await client.next_event()  # sent before we send any body
    assert isinstance(interim, h11.InformationalResponse) and interim.status_code == 100
    await client.send_raw(client.h11.send(h11.Data(data=body)) + client.h11.send(h11.EndOfMessage()))
    reply = await client.read_reply()
    assert reply.status == 200


async def test_head_root_has_headers_and_no_body(start_server):
    served = await start_server()
    client = await RawClient.open(served.port)
    await client.send_request("HEAD", "/")
    reply = await client.read_reply()
    assert reply.status == 200
    assert reply.body == b""
    assert int(reply.headers["content-length"]) > 0  # what the GET would carry


async def test_options_preflight_answers_with_cors(start_server):
    served = await start_server(api_keys=["secret"])  # preflights carry no credentials
    reply = await request(served.port, "OPTIONS", "/v1/chat/completions", headers=[
        ("origin", "http://app.example"), ("access-control-request-method", "POST"),
        ("access-control-request-headers", "authorization, content-type")])
    assert reply.status == 204
    assert reply.headers["access-control-allow-origin"] == "*"
    assert "POST" in reply.headers["access-control-allow-methods"]
    assert reply.headers["access-control-allow-headers"] == "authorization, content-type"


async def test_cors_headers_on_every_response_including_refusals(start_server):
    served = await start_server(max_body_bytes=10)
    for reply in [
        await request(served.port, "GET", "/health"),
        await request(served.port, "GET", "/nowhere"),
        await request(served.port, "POST", CHAT, body=b"x" * 50),
    ]:
        assert reply.headers["access-control-allow-origin"] == "*", reply


async def test_listed_cors_origin_is_echoed_and_others_are_not(start_server):
    served = await start_server(cors_origins=["http://good.example"])
    good = await request(served.port, "GET", "/health", headers=[("origin", "http://good.example")])
    bad = await request(served.port, "GET", "/health", headers=[("origin", "http://bad.example")])
    assert good.headers["access-control-allow-origin"] == "http://good.example"
    assert "access-control-allow-origin" not in bad.headers


async def test_unknown_path_404_and_wrong_method_405(start_server):
    served = await start_server()
    missing = await request(served.port, "GET", "/v1/completions")
    wrong = await request(served.port, "GET", CHAT)
    assert missing.status == 404
    assert missing.json()["error"]["message"] == "unknown endpoint GET /v1/completions"
    assert wrong.status == 405
    assert "POST" in wrong.headers["allow"]


async def test_query_strings_do_not_change_the_route(start_server):
    served = await start_server()
    models = await request(served.port, "GET", "/v1/models?client_version=0.171.0")
    chat = await request(served.port, "POST", CHAT + "?beta=true", json_body=HELLO)
    assert models.status == 200 and models.json()["object"] == "list"
    assert chat.status == 200


async def test_an_unexpected_handler_error_is_a_500_in_the_error_shape_of_the_path(nursery):
    from dflash.api import error_response
    from dflash.app import limits_of
    from dflash.config import Config
    from dflash.http.server import HTTPServer

    async def broken(request, writer):
        raise RuntimeError("a bug")

    server = HTTPServer(broken, limits_of(Config()), error_response=error_response)
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    await nursery.start(server.serve, listeners)
    port = listeners[0].socket.getsockname()[1]
    anthropic = await request(port, "POST", "/v1/messages", json_body={})
    assert anthropic.status == 500 and anthropic.json() == {
        "type": "error", "error": {"type": "api_error", "message": "internal server error"}}
    openai = await request(port, "POST", CHAT, json_body={})
    assert openai.status == 500 and openai.json()["error"]["type"] == "server_error"
    server.stop_accepting()
