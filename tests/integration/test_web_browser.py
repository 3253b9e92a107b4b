"""The page at / in a real browser (headless Chromium, browser.py) against the real server on the
embedded model, with api_keys set: the page asks for the key, shows the server's status without
console errors, streams a chat reply, stops a reply (the server cancels the job) and lists the
finished request in its table."""

from __future__ import annotations

import base64
import json
import re
import time
from pathlib import Path

import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from tests.integration.browser import headless_chromium
from tests.integration.conftest import MAX_CTX, running_server
from tests.integration.thread_server import serving
from tests.unit.fakes import FakeEngine, fake_loader

KEY = "sk-browser-test"
WAIT_S = 90
WEATHER_TOOL = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
# What the fake model writes: reasoning, text, then a tool call.
SCRIPTED = ('<think>The user wants the weather.</think>Let me look that up.'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>')


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(base URL, the server's log file) of a server with an API key."""
    folder = tmp_path_factory.mktemp("browser-server")
    config = (f'[server]\nport = 0\nshutdown_grace_s = 5\napi_keys = ["{KEY}"]\n[model]\nmax_ctx = {MAX_CTX}\n'
              '[logging]\nformat = "json"\n')
    with running_server(folder, config) as started:
        yield started["listening"], folder / "server.log"


@pytest.fixture(scope="module")
def page(served):
    """The browser on the page, the key entered."""
    base_url, _ = served
    driver = headless_chromium()
    try:
        driver.get(base_url + "/")
        WebDriverWait(driver, 10).until(lambda d: "API key" in d.find_element(By.ID, "notice").text)
        driver.find_element(By.ID, "api-key").send_keys(KEY)
        driver.find_element(By.ID, "save-key").click()
        yield driver
    finally:
        driver.quit()


def console_errors(driver) -> list[dict]:
    return [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


def chat(driver, prompt: str, max_tokens: int):
    """Type a prompt in the chat panel and send it; returns the assistant's message element."""
    tokens = driver.find_element(By.ID, "max-tokens")
    tokens.clear()
    tokens.send_keys(str(max_tokens))
    driver.find_element(By.ID, "prompt").send_keys(prompt)
    driver.find_element(By.ID, "send").click()
    return WebDriverWait(driver, 5).until(
        lambda d: d.find_elements(By.CSS_SELECTOR, ".message.assistant")[-1])


def server_events(log_path: Path) -> list[dict]:
    return [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]


def wait_for_event(log_path: Path, matches, timeout_s: float = 20) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = [event for event in server_events(log_path) if matches(event)]
        if found:
            return found[-1]
        time.sleep(0.2)
    raise AssertionError(f"no such event in the server log within {timeout_s}s")


def distinct_colours(driver, png: bytes) -> int:
    """Colours in a PNG, counted by the browser's own decoder (no imaging library needed)."""
    return driver.execute_async_script("""
        const [data, done] = arguments;
        const image = new Image();
        image.onload = () => {
          const canvas = document.createElement("canvas");
          canvas.width = image.width; canvas.height = image.height;
          const context = canvas.getContext("2d");
          context.drawImage(image, 0, 0);
          const pixels = new Uint32Array(context.getImageData(0, 0, image.width, image.height).data.buffer);
          done(new Set(pixels).size);
        };
        image.onerror = () => done(-1);
        image.src = "data:image/png;base64," + data;
    """, base64.b64encode(png).decode())


def test_the_page_shows_the_server_without_console_errors(page, served):
    WebDriverWait(page, 10).until(lambda d: d.find_element(By.ID, "state").text in ("idle", "busy"))
    assert page.find_element(By.ID, "model").text == "smollm2-135m-instruct"
    assert page.find_element(By.ID, "queue-depth").text == "0"
    assert page.find_element(By.ID, "uptime").text.endswith("s")
    assert not page.find_element(By.ID, "notice").is_displayed()
    assert console_errors(page) == []


def watch_reply_texts(driver) -> None:
    """Record in the page every text the next assistant reply shows, however fast it streams: each
    delta replaces the reply's text node, and a mutation record keeps the node it added (polling
    over WebDriver misses states when a short reply streams faster than a round trip)."""
    driver.execute_script("""
        window.replyTexts = [];
        new MutationObserver((records) => {
          for (const record of records) {
            if (!record.target.classList?.contains("text")) continue;
            if (!record.target.closest(".message.assistant")) continue;
            for (const node of record.addedNodes) window.replyTexts.push(node.textContent);
          }
        }).observe(document.getElementById("messages"), { childList: true, subtree: true });
    """)


def test_a_prompt_streams_a_reply_into_the_page(page, served, tmp_path):
    watch_reply_texts(page)
    reply = chat(page, "Write a short poem about the sea.", max_tokens=32)
    WebDriverWait(page, WAIT_S).until(lambda d: reply.get_attribute("data-done"))
    partial = [text for text in page.execute_script("return window.replyTexts") if text]
    assert partial, "no text appeared while the reply streamed"
    assert len(set(partial)) > 1, f"the reply arrived at once, not streamed: {partial[-1]!r}"
    shown = page.execute_script("return arguments[0].textContent", reply.find_element(By.CLASS_NAME, "text"))
    assert partial[-1] == shown and all(shown.startswith(text) for text in partial), partial
    assert re.search("[A-Za-z]{2}", reply.find_element(By.CLASS_NAME, "text").text)
    status = page.find_element(By.ID, "chat-status").text
    assert re.fullmatch(r"done \((stop|length), \d+ tokens, first token after \d+ ms\)", status), status
    png = page.get_screenshot_as_png()
    (tmp_path / "page-after-chat.png").write_bytes(png)
    assert png.startswith(b"\x89PNG") and distinct_colours(page, png) > 20


def test_stop_cancels_the_job_on_the_server(page, served):
    _, log_path = served
    # A reply that cannot end on its own before the click: a story could end (EOS) in ~1 s at this
    # server's speed, and a loaded CI machine once clicked after it had ("done", not "stopped").
    reply = chat(page, "Count from 1 to 5000, one number per line.", max_tokens=4000)
    WebDriverWait(page, WAIT_S, poll_frequency=0.05).until(
        lambda d: reply.find_element(By.CLASS_NAME, "text").text)
    request_id = reply.get_attribute("data-request-id")
    page.find_element(By.ID, "stop").click()
    WebDriverWait(page, 5).until(lambda d: d.find_element(By.ID, "chat-status").text == "stopped")
    line = wait_for_event(log_path, lambda e: e.get("event") == "request" and e.get("id") == request_id)
    assert line["client_disconnected"] is True and line["completion_tokens"] < 4000
    cancelled = wait_for_event(log_path, lambda e: e.get("event") == "job_cancelled"
                               and e.get("request_id") == request_id)
    assert cancelled["queued"] is False and cancelled["reason"] == "abandoned"
    # the table marks it as left, and the page has logged no error for the aborted stream
    WebDriverWait(page, 10).until(
        lambda d: "(left)" in d.find_element(By.CSS_SELECTOR, f'tr[data-request-id="{request_id}"]').text)
    assert console_errors(page) == []


def test_the_status_table_shows_the_finished_request(page, served):
    reply = chat(page, "Name a colour.", max_tokens=4)
    WebDriverWait(page, WAIT_S).until(lambda d: reply.get_attribute("data-done"))
    request_id = reply.get_attribute("data-request-id")
    row = WebDriverWait(page, 10).until(
        lambda d: d.find_elements(By.CSS_SELECTOR, f'#requests tr[data-request-id="{request_id}"]'))[0]
    cells = [cell.text for cell in row.find_elements(By.TAG_NAME, "td")]
    assert cells[1:3] == ["openai_chat", "200"]
    assert cells[4] == "4" and float(cells[5]) > 0 and float(cells[6]) > 0  # generated, TTFT ms, tok/s
    assert cells[8] == "length"


def test_reasoning_and_tool_calls_are_shown_apart_from_the_text():
    """On the fake engine, which writes SCRIPTED whatever the prompt."""
    engine = FakeEngine(reply=SCRIPTED, decode_step_s=0.001)
    with serving(fake_loader(engine), max_ctx=engine.max_ctx) as server:
        driver = headless_chromium()
        try:
            driver.get(server.base_url + "/")
            WebDriverWait(driver, 10).until(lambda d: d.find_element(By.ID, "state").text == "idle")
            driver.find_element(By.CSS_SELECTOR, ".tools summary").click()
            driver.find_element(By.ID, "tools").send_keys(json.dumps(WEATHER_TOOL))
            reply = chat(driver, "What is the weather in Paris?", max_tokens=500)
            WebDriverWait(driver, 30).until(lambda d: reply.get_attribute("data-done"))
            assert reply.find_element(By.CLASS_NAME, "reasoning").text == "The user wants the weather."
            assert reply.find_element(By.CLASS_NAME, "text").text == "Let me look that up."
            (call,) = reply.find_elements(By.CLASS_NAME, "tool-call")
            assert call.text == 'get_weather({"city":"Paris"})'
            assert driver.find_element(By.ID, "chat-status").text.startswith("done (tool_calls")
            assert console_errors(driver) == []
        finally:
            driver.quit()
