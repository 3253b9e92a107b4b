"""GET / from a browser: the page shipped in the package (and its two files), served without an
API key because it holds no data; JSON clients of / keep their answer, with the status page's
fields added. The page's own same-origin requests pass the Host check and CORS rules."""

from __future__ import annotations

from dflash.api import KEY_AUTH_MARK, NO_AUTH_MARK
from tests.unit.conftest import wait_until
from tests.unit.fakes import FakeEngine
from tests.unit.rawhttp import request

KEY = "sk-page"
BROWSER_ACCEPT = "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"


async def get_page(port: int, path: str = "/", **kwargs):
    return await request(port, "GET", path, headers=[("accept", BROWSER_ACCEPT), *kwargs.get("headers", [])])


async def test_a_browser_gets_the_page_and_json_clients_keep_json(start_server):
    served = await start_server()
    page = await get_page(served.port)
    assert page.status == 200
    assert page.headers["content-type"] == "text/html; charset=utf-8"
    assert page.headers["vary"] == "Accept"
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert b'<script src="/web/app.js">' in page.body and NO_AUTH_MARK in page.body
    for accept in (None, "*/*", "application/json"):
        headers = [("accept", accept)] if accept else []
        root = await request(served.port, "GET", "/", headers=headers)
        assert root.headers["content-type"] == "application/json"
        assert {"status", "model", "weights", "kv_cache", "cpu", "state", "queue_depth", "uptime_s", "version",
                "warnings"} <= set(root.json())


async def test_the_page_files_are_served_with_their_types(start_server):
    served = await start_server()
    script = await request(served.port, "GET", "/web/app.js")
    style = await request(served.port, "GET", "/web/style.css")
    assert script.status == 200 and script.headers["content-type"].startswith("text/javascript")
    assert b"/v1/chat/completions" in script.body
    assert style.status == 200 and style.headers["content-type"].startswith("text/css")
    assert (await request(served.port, "GET", "/web/other.js")).status == 404


async def test_the_page_is_open_with_api_keys_and_asks_for_the_key(start_server):
    served = await start_server(api_keys=[KEY])
    page = await get_page(served.port)
    assert page.status == 200 and KEY_AUTH_MARK in page.body
    assert (await request(served.port, "GET", "/web/app.js")).status == 200
    # the data is not: JSON needs the key, whatever Accept says
    assert (await request(served.port, "GET", "/", headers=[("accept", "application/json")])).status == 401
    keyed = await request(served.port, "GET", "/", headers=[("authorization", f"Bearer {KEY}")])
    assert keyed.status == 200 and keyed.json()["model"] == "fake-model"


async def test_status_json_carries_settings_build_and_the_last_requests(start_server):
    served = await start_server(FakeEngine(), api_keys=[KEY])
    auth = [("authorization", f"Bearer {KEY}")]
    chat = await request(served.port, "POST", "/v1/chat/completions", headers=auth,
                         json_body={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert chat.status == 200
    await wait_until(lambda: served.engine.idle)
    status = (await request(served.port, "GET", "/", headers=auth)).json()
    assert status["settings"]["server"]["api_keys"] == 1  # how many, never the keys
    assert KEY not in str(status)
    assert status["settings"]["model"]["max_ctx"] == served.engine.max_ctx
    assert status["build"]["model"] == "fake-model" and status["build"]["cpu"]
    (last,) = status["recent_requests"]  # generation requests only: not the status polls
    assert last["id"] == chat.headers["x-request-id"]
    assert last["dialect"] == "openai_chat" and last["status"] == 200
    assert last["completion_tokens"] == 4 and last["prompt_tokens"] == chat.json()["usage"]["prompt_tokens"]
    assert last["ttft_ms"] > 0 and last["decode_tokens_per_s"] > 0
    assert last["client_disconnected"] is False


async def test_the_pages_same_origin_requests_pass_host_and_cors_rules(start_server):
    served = await start_server(cors_origins=["https://elsewhere.example"])
    origin = f"http://127.0.0.1:{served.port}"
    same_origin = [("host", f"127.0.0.1:{served.port}"), ("origin", origin)]
    page = await get_page(served.port, headers=[("host", f"localhost:{served.port}")])
    assert page.status == 200
    reply = await request(served.port, "POST", "/v1/chat/completions", headers=same_origin,
                          json_body={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True})
    assert reply.status == 200 and b"[DONE]" in reply.body
    assert (await request(served.port, "GET", "/", headers=same_origin)).status == 200
