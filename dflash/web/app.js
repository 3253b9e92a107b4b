// The dflash status page and chat panel: plain JavaScript, no build step, nothing from elsewhere.
// Status: polls GET / (JSON) every second. Chat: streams POST /v1/chat/completions; Stop aborts
// the fetch, and the server cancels the job when the connection closes.
"use strict";

const KEY_STORAGE = "dflash-api-key";
const POLL_MS = 1000;
const needsKey = document.querySelector('meta[name="dflash-auth"]').content === "api-key";
const $ = (id) => document.getElementById(id);

let modelId = null;
let conversation = []; // {role, content} messages sent with the next request
let streaming = null; // the AbortController of the reply being streamed
let pollTimer = null;

// ---- API key -------------------------------------------------------------------------------

function storedKey() {
  return sessionStorage.getItem(KEY_STORAGE) || "";
}

function authHeaders() {
  const key = storedKey();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

function showNotice(text) {
  const notice = $("notice");
  notice.textContent = text;
  notice.hidden = !text;
}

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const key = $("api-key").value.trim();
  if (key) sessionStorage.setItem(KEY_STORAGE, key);
  else sessionStorage.removeItem(KEY_STORAGE);
  $("api-key").value = "";
  $("api-key").placeholder = key ? "key set for this tab" : "kept in this tab only";
  showNotice("");
  schedulePoll(0);
});

// ---- status --------------------------------------------------------------------------------

function schedulePoll(delay) {
  clearTimeout(pollTimer);
  pollTimer = setTimeout(poll, delay);
}

async function poll() {
  if (needsKey && !storedKey()) {
    showNotice("This server needs an API key: enter it above.");
    return; // polled again once a key is entered
  }
  try {
    const response = await fetch("/", { headers: { Accept: "application/json", ...authHeaders() }, cache: "no-store" });
    if (response.status === 401) {
      showNotice("The server refused the API key: enter another one above.");
      return;
    }
    if (!response.ok) throw new Error(`GET / answered ${response.status}`);
    showNotice("");
    renderStatus(await response.json());
  } catch (error) {
    showNotice(`Cannot read the server's status: ${error.message}`);
  }
  schedulePoll(POLL_MS);
}

function formatUptime(seconds) {
  const s = Math.floor(seconds);
  const parts = [[Math.floor(s / 86400), "d"], [Math.floor(s / 3600) % 24, "h"], [Math.floor(s / 60) % 60, "m"], [s % 60, "s"]];
  const from = parts.findIndex(([value]) => value > 0);
  return parts.slice(from < 0 ? 3 : from).map(([value, unit]) => `${value}${unit}`).join(" ");
}

function renderStatus(status) {
  modelId = status.model;
  $("model").textContent = status.model;
  $("state").textContent = status.state;
  $("state").className = `state ${status.state}`;
  $("queue-depth").textContent = status.queue_depth;
  $("running").textContent = describeRunning(status.running);
  $("uptime").textContent = formatUptime(status.uptime_s);
  $("version").textContent = status.version;
  const build = status.build || {};
  $("build").textContent = [build.dtype, build.weights_format, build.cpu].filter(Boolean).join(", ");
  $("warnings").replaceChildren(...(status.warnings || []).map((text) => element("li", text)));
  renderSettings(status.settings || {});
  renderRequests(status.recent_requests || []);
}

function describeRunning(jobs) {
  if (!jobs || jobs.length === 0) return "nothing";
  return jobs.map((job) => {
    const computed = job.cached_tokens + job.prefilled_tokens;
    const phase = computed < job.prompt_tokens
      ? `prefill ${computed} / ${job.prompt_tokens} tokens`
      : `${job.generated_tokens} tokens generated`;
    return `${phase}, ${job.running_s.toFixed(0)} s`;
  }).join("; ");
}

function element(tag, text, className) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (className) node.className = className;
  return node;
}

function row(cells) {
  const tr = document.createElement("tr");
  tr.append(...cells.map((cell) => element("td", cell ?? "–")));
  return tr;
}

function renderSettings(settings) {
  const rows = [];
  for (const [section, values] of Object.entries(settings)) {
    for (const [key, value] of Object.entries(values)) {
      rows.push(row([`${section}.${key}`, typeof value === "object" ? JSON.stringify(value) : value]));
    }
  }
  $("settings").tBodies[0].replaceChildren(...rows);
}

function renderRequests(requests) {
  const rows = requests.map((request) => {
    const cached = request.prompt_tokens != null ? `${request.prompt_tokens} (${request.cached_tokens ?? 0})` : null;
    const tr = row([
      new Date(request.at * 1000).toTimeString().slice(0, 8),
      request.dialect,
      request.client_disconnected ? `${request.status ?? "–"} (left)` : request.status,
      cached,
      request.completion_tokens,
      request.ttft_ms,
      request.decode_tokens_per_s,
      request.acceptance_length || null,
      request.finish_reason,
    ]);
    tr.dataset.requestId = request.id;
    if (request.status >= 400) tr.className = "failed";
    return tr;
  });
  $("requests").tBodies[0].replaceChildren(...rows);
}

// ---- chat ----------------------------------------------------------------------------------

function addMessage(role) {
  const root = element("div", null, `message ${role}`);
  const view = {
    root,
    reasoning: element("div", null, "reasoning"),
    text: element("div", null, "text"),
    calls: element("div", null, "tool-calls"),
  };
  view.reasoning.hidden = true;
  root.append(element("div", role, "role"), view.reasoning, view.text, view.calls);
  $("messages").append(root);
  return view;
}

function scrollToEnd() {
  const messages = $("messages");
  messages.scrollTop = messages.scrollHeight;
}

function setChatStatus(text, isError = false) {
  $("chat-status").textContent = text;
  $("chat-status").className = isError ? "chat-status error" : "chat-status";
}

function setStreaming(controller) {
  streaming = controller;
  $("send").disabled = controller !== null;
  $("stop").disabled = controller === null;
}

// Yields the data of each server-sent event of a fetch response.
async function* sseData(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true }).replace(/\r\n/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = block.split("\n").filter((line) => line.startsWith("data:")).map((line) => line.slice(5).trimStart());
      if (data.length) yield data.join("\n");
    }
  }
}

// One streamed delta into the reply: text and reasoning go to the view at the next frame
// (showReply), tool calls at once.
function applyDelta(delta, reply, view) {
  reply.content += delta.content || "";
  reply.reasoning += delta.reasoning_content || "";
  for (const call of delta.tool_calls || []) {
    const known = reply.calls[call.index] || (reply.calls[call.index] = { name: "", arguments: "", node: element("pre", null, "tool-call") });
    const part = call.function || call.custom || {};
    known.name += part.name || "";
    known.arguments += part.arguments || part.input || "";
    known.node.textContent = `${known.name}(${known.arguments})`;
    if (!known.node.isConnected) view.calls.append(known.node);
  }
}

// The reply's text and reasoning into its view, scrolled to the end. Once a frame at most: writing
// the whole text and reading the scroll height for every delta made the page lay out its growing
// text a few hundred times a second where speculation streams fast (a count at ~200 tok/s), and a
// busy CI machine's browser fell seconds behind the stream, so Stop was handled after the end.
function showReply(reply, view) {
  if (view.text.textContent !== reply.content) view.text.textContent = reply.content;
  if (reply.reasoning && view.reasoning.textContent !== reply.reasoning) {
    view.reasoning.hidden = false;
    view.reasoning.textContent = reply.reasoning;
  }
  scrollToEnd();
}

// The tools field's JSON array, or undefined when it is empty.
function offeredTools() {
  const text = $("tools").value.trim();
  if (!text) return undefined;
  let tools;
  try {
    tools = JSON.parse(text);
  } catch (error) {
    throw new Error(`the tools are not JSON: ${error.message}`);
  }
  if (!Array.isArray(tools)) throw new Error(`the tools must be a JSON array, not ${text.slice(0, 40)}`);
  return tools;
}

async function send(text) {
  const maxTokens = Number.parseInt($("max-tokens").value, 10);
  const temperature = Number.parseFloat($("temperature").value);
  if (!(maxTokens >= 1)) return setChatStatus(`max tokens must be a whole number >= 1, not ${JSON.stringify($("max-tokens").value)}`, true);
  if (!(temperature >= 0)) return setChatStatus(`temperature must be a number >= 0, not ${JSON.stringify($("temperature").value)}`, true);
  let tools;
  try {
    tools = offeredTools();
  } catch (error) {
    return setChatStatus(error.message, true);
  }
  conversation.push({ role: "user", content: text });
  addMessage("user").text.textContent = text;
  const view = addMessage("assistant");
  const reply = { content: "", reasoning: "", calls: [] };
  const controller = new AbortController();
  setStreaming(controller);
  setChatStatus("waiting for the model…");
  const began = performance.now();
  let firstTokenMs = null;
  let finish = null;
  let usage = null;
  let frame = 0; // a showReply waiting for the next frame
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST",
      signal: controller.signal,
      headers: { "Content-Type": "application/json", ...authHeaders() },
      body: JSON.stringify({
        model: modelId || "default", messages: conversation, stream: true, temperature,
        max_tokens: maxTokens, stream_options: { include_usage: true }, ...(tools ? { tools } : {}),
      }),
    });
    view.root.dataset.requestId = response.headers.get("x-request-id") || "";
    if (!response.ok) {
      const body = await response.json().catch(() => null);
      throw new Error(body?.error?.message || `the server answered ${response.status}`);
    }
    setChatStatus("streaming…");
    for await (const data of sseData(response)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      for (const choice of chunk.choices || []) {
        const delta = choice.delta || {};
        if (firstTokenMs === null && (delta.content || delta.reasoning_content || delta.tool_calls)) {
          firstTokenMs = performance.now() - began;
        }
        applyDelta(delta, reply, view);
        finish = choice.finish_reason || finish;
      }
      usage = chunk.usage || usage;
      frame ||= requestAnimationFrame(() => {
        frame = 0;
        showReply(reply, view);
      });
    }
    const generated = usage ? `, ${usage.completion_tokens} tokens` : "";
    const ttft = firstTokenMs !== null ? `, first token after ${Math.round(firstTokenMs)} ms` : "";
    setChatStatus(`done (${finish || "end"}${generated}${ttft})`);
  } catch (error) {
    if (error.name === "AbortError") setChatStatus("stopped");
    else setChatStatus(`error: ${error.message}`, true);
  } finally {
    cancelAnimationFrame(frame);
    showReply(reply, view);
    setStreaming(null);
    view.root.dataset.done = "true";
    if (reply.content) conversation.push({ role: "assistant", content: reply.content });
    schedulePoll(0); // the table shows this request now, not at the next tick
  }
}

$("chat-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || streaming) return;
  $("prompt").value = "";
  send(text);
});

$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    $("chat-form").requestSubmit();
  }
});

$("stop").addEventListener("click", () => streaming?.abort());

$("clear").addEventListener("click", () => {
  streaming?.abort();
  conversation = [];
  $("messages").replaceChildren();
  setChatStatus("");
});

poll();
