// The /try/ page: a small browser client of the public AAP v3 API (no build step).
// The API token lives in sessionStorage (this tab only) and travels in the Authorization
// header; a turn's re-attach after a reload uses its AAP-Events-Ticket in an EventSource URL.
"use strict";

const $ = (id) => document.getElementById(id);
const store = {
  get: (key) => { try { return JSON.parse(sessionStorage.getItem("aap." + key)); } catch { return null; } },
  set: (key, value) => sessionStorage.setItem("aap." + key, JSON.stringify(value)),
  drop: (key) => sessionStorage.removeItem("aap." + key),
};
const SAMPLE_TOOLS = [{
  name: "lookup",
  description: "Look something up in the application (this page answers it).",
  parameters: { type: "object", properties: { q: { type: "string" } } },
}];

let agents = [];
let running = null; // {sessionId, turnId, ticket, controller?, source?}
let view = null; // the assistant message being built

function status(text) { $("status").textContent = text || ""; }

async function api(method, path, body) {
  const headers = { Authorization: "Bearer " + store.get("token"), Accept: "application/json" };
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const response = await fetch("/v1" + path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
  if (!response.ok) {
    let message = response.status + " " + response.statusText;
    try { message = (await response.json()).error || message; } catch { /* not JSON */ }
    if (response.status === 401) forget();
    throw new Error(message);
  }
  return response;
}

// --- sign in, agents, options ------------------------------------------------------------

// A token the API refused (or a sign-out): nothing of it stays in this tab.
function forget() {
  for (const key of ["token", "session", "turn"]) store.drop(key);
  $("signin-form").hidden = false;
  $("signed-in").hidden = true;
  $("workspace").hidden = true;
}

function signOut() {
  forget();
  location.reload();
}

async function signIn(token) {
  store.set("token", token);
  const meta = await (await api("GET", "/meta")).json();
  agents = meta.agents || [];
  $("signin-form").hidden = true;
  $("signed-in").hidden = false;
  $("workspace").hidden = false;
  const select = $("agent");
  select.replaceChildren(...agents.map((a) => new Option(a.title ? `${a.name} — ${a.title}` : a.name, a.name)));
  const saved = store.get("session");
  if (saved && agents.some((a) => a.name === saved.agent)) select.value = saved.agent;
  showAgent();
}

function currentAgent() { return agents.find((a) => a.name === $("agent").value); }

function showAgent() {
  const agent = currentAgent();
  if (!agent) return;
  $("agent-description").textContent = agent.description || "";
  const options = $("options");
  options.replaceChildren(Object.assign(document.createElement("legend"), { textContent: "Options" }));
  for (const option of agent.options || []) {
    const label = document.createElement("label");
    label.textContent = option.title || option.name;
    let input;
    if (option.type === "select") {
      input = document.createElement("select");
      for (const choice of option.options || []) input.add(new Option(choice, choice));
      input.value = option.default;
    } else {
      input = document.createElement("input");
      input.type = option.type === "secret" ? "password" : "text";
      input.value = option.default || "";
      input.autocomplete = "off";
    }
    input.dataset.option = option.name;
    input.dataset.testid = "option-" + option.name;
    label.append(input);
    options.append(label);
  }
  const tools = $("server-tools");
  tools.replaceChildren(Object.assign(document.createElement("legend"), { textContent: "Server tools" }));
  for (const tool of agent.tools || []) {
    const row = document.createElement("label");
    const enable = Object.assign(document.createElement("input"), { type: "checkbox" });
    enable.dataset.tool = tool.name;
    enable.dataset.testid = "tool-" + tool.name;
    const trust = Object.assign(document.createElement("input"), { type: "checkbox" });
    trust.dataset.trust = tool.name;
    trust.dataset.testid = "trust-" + tool.name;
    row.append(enable, ` ${tool.name} `, trust, " trusted");
    row.title = tool.description || "";
    tools.append(row);
  }
  tools.hidden = !(agent.tools || []).length;
  // The session this tab re-attached to: its server tools as it was created with them.
  const saved = store.get("session");
  if (saved && saved.agent === agent.name) {
    for (const box of tools.querySelectorAll("[data-tool]")) {
      box.checked = Object.prototype.hasOwnProperty.call(saved.serverTools || {}, box.dataset.tool);
    }
    for (const box of tools.querySelectorAll("[data-trust]")) box.checked = (saved.serverTools || {})[box.dataset.trust] === true;
  }
  const caps = agent.capabilities || {};
  $("client-tools-box").hidden = !(caps.application && caps.application.tools);
  if (!$("client-tools").value) $("client-tools").value = JSON.stringify(SAMPLE_TOOLS, null, 2);
  const modes = Object.keys(caps.stream || { none: {} });
  $("stream").replaceChildren(...modes.map((m) => new Option(m, m)));
  if (modes.includes("delta")) $("stream").value = "delta";
}

// --- sessions ------------------------------------------------------------------------------

async function newSession() {
  const agent = currentAgent();
  const config = { name: agent.name, options: {} };
  for (const input of document.querySelectorAll("[data-option]")) config.options[input.dataset.option] = input.value;
  const enabled = [...document.querySelectorAll("[data-tool]")].filter((box) => box.checked);
  if ((agent.tools || []).length) {
    config.tools = enabled.map((box) => ({ name: box.dataset.tool, trust: [...document.querySelectorAll("[data-trust]")].some((t) => t.dataset.trust === box.dataset.tool && t.checked) }));
  }
  const body = { agent: config };
  if (!$("client-tools-box").hidden && $("client-tools").value.trim()) {
    try { body.tools = JSON.parse($("client-tools").value); } catch { throw new Error("The client tools are not valid JSON."); }
  }
  const { sessionId } = await (await api("POST", "/sessions", body)).json();
  const serverTools = Object.fromEntries((config.tools || []).map((t) => [t.name, t.trust]));
  const clientTools = (body.tools || []).map((t) => t.name);
  store.set("session", { id: sessionId, agent: agent.name, serverTools, clientTools });
  store.drop("turn");
  $("transcript").replaceChildren();
  showSession();
}

function showSession() {
  const session = store.get("session");
  $("session-id").textContent = session ? session.id : "none";
  $("send").disabled = !session || !!running;
  $("load-history").disabled = !session;
}

async function loadHistory(render) {
  const session = store.get("session");
  const body = await (await api("GET", `/sessions/${session.id}/history?type=full`)).json();
  const messages = body.history.full;
  $("history").textContent = JSON.stringify(messages, null, 2);
  if (render) {
    $("transcript").replaceChildren();
    for (const message of messages) renderMessage(message);
  }
  return messages;
}

// --- rendering -------------------------------------------------------------------------------

function bubble(role) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  div.dataset.testid = "msg-" + role;
  $("transcript").append(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

function renderMessage(message) {
  const div = bubble(message.role);
  const blocks = typeof message.content === "string" ? [{ type: "text", text: message.content }] : message.content || [];
  for (const block of blocks) {
    if (block.type === "text") div.append(part("text", block.text));
    else if (block.type === "thinking") div.append(part("thinking", block.thinking));
    else if (block.type === "tool_use") div.append(toolCall(block));
    else if (block.type === "image") div.append(part("text", "[image]"));
  }
}

function part(kind, text) {
  const span = document.createElement("div");
  span.className = kind;
  span.dataset.testid = kind;
  span.textContent = text;
  return span;
}

function toolCall(call) {
  const div = part("tool-call", `tool call ${call.name}(${JSON.stringify(call.input)})`);
  div.dataset.toolCallId = call.toolCallId;
  return div;
}

// Folds a turn's events into the transcript as they come (the AAP fold, on screen).
function onEvent(name, data) {
  if (name === "turn_start") { view = { div: null, last: null, calls: [], results: new Set() }; return; }
  if (!view) view = { div: null, last: null, calls: [], results: new Set() };
  const assistant = () => (view.div = view.div || bubble("assistant"));
  if (name === "text_delta" || name === "thinking_delta") {
    const kind = name === "text_delta" ? "text" : "thinking";
    if (view.last && view.last.className === kind && view.last.parentNode === view.div) view.last.textContent += data.delta;
    else assistant().append((view.last = part(kind, data.delta)));
  } else if (name === "text" || name === "thinking") {
    assistant().append((view.last = part(name, data[name])));
  } else if (name === "tool_call") {
    assistant().append((view.last = toolCall(data)));
    view.calls.push(data);
  } else if (name === "tool_result") {
    const tool = bubble("tool");
    tool.textContent = `${data.toolCallId} → ${typeof data.content === "string" ? data.content : JSON.stringify(data.content)}`;
    view.results.add(data.toolCallId);
    view.div = null; view.last = null;
  } else if (name === "turn_stop") {
    const meta = data._meta || {};
    const line = part("stop", `stop: ${data.stopReason}${meta.cancelled ? " (cancelled)" : ""}${meta.error ? " — " + meta.error : ""}`);
    if (data.stopReason === "error") line.classList.add("error");
    $("transcript").append(line);
    line.scrollIntoView({ block: "end" });
    const pending = data.stopReason === "tool_use" ? view.calls.filter((c) => !view.results.has(c.toolCallId)) : [];
    turnEnded(pending);
  }
}

// --- turns -----------------------------------------------------------------------------------

function turnBegan(sessionId, turnId, ticket, extra) {
  running = { sessionId, turnId, ticket, ...extra };
  store.set("turn", { sessionId, turnId, ticket });
  $("cancel").disabled = false;
  $("send").disabled = true;
}

function turnEnded(pending) {
  if (running && running.source) running.source.close();
  running = null;
  store.drop("turn");
  $("cancel").disabled = true;
  showSession();
  showPending(pending || []);
}

async function sendTurn(messages) {
  const session = store.get("session");
  const stream = $("stream").value;
  for (const message of messages) if (message.role === "user") renderMessage(message);
  const controller = new AbortController();
  const response = await fetch(`/v1/sessions/${session.id}/turns`, {
    method: "POST",
    headers: { Authorization: "Bearer " + store.get("token"), "Content-Type": "application/json", Accept: "text/event-stream" },
    body: JSON.stringify({ stream, messages }),
    signal: controller.signal,
  });
  if (!response.ok) {
    let message = `${response.status}`;
    try { message = (await response.json()).error || message; } catch { /* not JSON */ }
    throw new Error(message);
  }
  turnBegan(session.id, response.headers.get("AAP-Turn-Id"), response.headers.get("AAP-Events-Ticket"), { controller });
  if (stream === "none") {
    const body = await response.json();
    onEvent("turn_start", {});
    for (const message of body.messages) {
      if (message.role === "tool") onEvent("tool_result", message);
      else for (const block of message.content) {
        if (block.type === "tool_use") onEvent("tool_call", block);
        else onEvent(block.type, block);
      }
    }
    onEvent("turn_stop", { stopReason: body.stopReason, _meta: body._meta });
    return;
  }
  await readSSE(response.body, (name, data) => onEvent(name, data));
}

// Server-Sent Events over fetch: blocks split by a blank line; `event:` and `data:` fields.
async function readSSE(body, handle) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += value.replace(/\r\n/g, "\n");
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      let name = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith(":")) continue;
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        const val = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
        if (field === "event") name = val;
        else if (field === "data") data.push(val);
      }
      if (data.length) handle(name, JSON.parse(data.join("\n")));
    }
  }
}

// After a reload: replay the running turn's events from its start and follow it live.
function reattach(saved) {
  const url = `/v1/sessions/${saved.sessionId}/turns/${saved.turnId}/events?ticket=${encodeURIComponent(saved.ticket)}`;
  const source = new EventSource(url);
  turnBegan(saved.sessionId, saved.turnId, saved.ticket, { source });
  for (const name of ["turn_start", "text_delta", "thinking_delta", "text", "thinking", "tool_call", "tool_result", "turn_stop"]) {
    source.addEventListener(name, (event) => onEvent(name, JSON.parse(event.data)));
  }
  source.onerror = () => {
    if (source.readyState === EventSource.CLOSED && running && running.source === source) {
      status("The turn's events are no longer available; its result is in the history.");
      turnEnded([]);
      loadHistory(true).catch((error) => status(error.message));
    }
  };
}

async function cancelTurn() {
  if (!running) return;
  await api("POST", `/sessions/${running.sessionId}/turns/${running.turnId}/cancel`);
}

// Pending tool calls: the page answers client tools and asks the person for permissions.
function showPending(calls) {
  const box = $("pending");
  box.replaceChildren();
  box.hidden = !calls.length;
  if (!calls.length) return;
  const session = store.get("session");
  const answers = new Map();
  box.append(part("hint", "The agent is waiting for these tool calls:"));
  for (const call of calls) {
    const row = document.createElement("div");
    row.className = "pending-call";
    row.dataset.testid = "pending-call";
    row.append(part("tool-call", `${call.name}(${JSON.stringify(call.input)})`));
    const isServer = session && Object.prototype.hasOwnProperty.call(session.serverTools || {}, call.name);
    if (isServer) {
      for (const granted of [true, false]) {
        const button = document.createElement("button");
        button.type = "button";
        button.textContent = granted ? "Grant" : "Deny";
        button.dataset.testid = granted ? "grant" : "deny";
        button.onclick = () => answer(call, { role: "tool_permission", toolCallId: call.toolCallId, granted }, row);
        row.append(button);
      }
    } else {
      const input = document.createElement("input");
      input.placeholder = "the tool's result";
      input.dataset.testid = "tool-result";
      const button = document.createElement("button");
      button.type = "button";
      button.textContent = "Send result";
      button.dataset.testid = "send-result";
      button.onclick = () => answer(call, { role: "tool", toolCallId: call.toolCallId, content: input.value }, row);
      row.append(input, button);
    }
    box.append(row);
  }
  function answer(call, message, row) {
    answers.set(call.toolCallId, message);
    for (const control of row.querySelectorAll("button, input")) control.disabled = true;
    if (answers.size === calls.length) {
      box.hidden = true;
      sendTurn([...answers.values()]).catch((error) => { status(error.message); turnEnded([]); });
    }
  }
}

// The tool calls a history ends with that have no tool message yet (what the agent waits for).
function unanswered(history) {
  for (let i = history.length - 1; i >= 0; i--) {
    const message = history[i];
    const calls = message.role === "assistant" && Array.isArray(message.content)
      ? message.content.filter((block) => block.type === "tool_use") : [];
    if (calls.length) {
      const answered = new Set(history.slice(i + 1).filter((m) => m.role === "tool").map((m) => m.toolCallId));
      return calls.filter((call) => !answered.has(call.toolCallId));
    }
    if (message.role === "user") return [];
  }
  return [];
}

// --- wiring ------------------------------------------------------------------------------------

document.addEventListener("DOMContentLoaded", async () => {
  $("signin-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const token = $("token").value.trim();
    $("token").value = "";
    status("");
    signIn(token).catch((error) => status(error.message));
  });
  $("sign-out").onclick = signOut;
  $("agent").onchange = showAgent;
  $("new-session").onclick = () => { status(""); newSession().catch((error) => status(error.message)); };
  $("load-history").onclick = () => { $("history-box").open = true; loadHistory(false).catch((error) => status(error.message)); };
  $("cancel").onclick = () => cancelTurn().catch((error) => status(error.message));
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("message").value;
    if (!text.trim() || running) return;
    $("message").value = "";
    status("");
    sendTurn([{ role: "user", content: text }]).catch((error) => { status(error.message); turnEnded([]); });
  });
  if (!store.get("token")) return;
  try {
    await signIn(store.get("token"));
  } catch (error) {
    status(error.message);
    return;
  }
  showSession();
  if (store.get("session")) {
    const history = await loadHistory(true).catch((error) => { status(error.message); return []; });
    const saved = store.get("turn");
    if (saved && saved.sessionId === store.get("session").id) reattach(saved);
    else showPending(unanswered(history));
  }
});
