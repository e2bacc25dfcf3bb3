// The chat page: a window onto this endpoint's /v1 routes. Model text is only ever inserted escaped
// (renderMarkdown escapes first, then adds a few tags of its own) or as textContent.
"use strict";

const KEY_STORAGE = "infemeral-api-key";  // this origin's sessionStorage: gone when the tab closes
const BYTES_STORAGE = "infemeral-bytes";

const state = {
  model: null,
  conversation: null,  // the saved session's name; null until the first answer is asked for
  messages: [],        // what the session holds: sent again whole with every request
  controller: null,    // the answer being streamed (AbortController)
  pod: null,
};

const $ = (id) => document.getElementById(id);

// -- the API ------------------------------------------------------------------------------------------
function headers(hasBody) {
  const h = {};
  if (hasBody) h["Content-Type"] = "application/json";
  const key = sessionStorage.getItem(KEY_STORAGE);
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

async function failure(response) {
  if (response.status === 401) {
    $("settings").open = true;
    $("api-key").focus();
  }
  let message = response.status + " " + response.statusText;
  try {
    const body = await response.json();
    if (body.error && body.error.message) message = body.error.message;
  } catch (e) { /* not JSON */ }
  return new Error(message);
}

async function api(method, path, body) {
  const response = await fetch(path, {method, headers: headers(body !== undefined),
                                      body: body === undefined ? undefined : JSON.stringify(body)});
  if (!response.ok) throw await failure(response);
  return response.json();
}

function showError(error) {
  $("error").textContent = error ? String(error.message || error) : "";
  $("error").hidden = !error;
}

// -- Markdown, safely ---------------------------------------------------------------------------------
function escapeHtml(text) {
  return text.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;")
    .replace(/"/g, "&quot;").replace(/'/g, "&#39;");
}

function inline(text) {  // code spans, then bold and italics on the escaped rest
  return text.split(/(`[^`\n]+`)/).map((part, i) => i % 2
    ? "<code>" + escapeHtml(part.slice(1, -1)) + "</code>"
    : escapeHtml(part).replace(/\*\*([^*]+)\*\*/g, "<strong>$1</strong>")
        .replace(/(^|[^*\w])\*([^*\s][^*]*)\*/g, "$1<em>$2</em>")
        .replace(/(^|\W)_([^_\s][^_]*)_(?=\W|$)/g, "$1<em>$2</em>")).join("");
}

const BULLET = /^\s*[-*+]\s+(.*)$/;
const NUMBERED = /^\s*(\d+)[.)]\s+(.*)$/;  // the item's own number, then its text

function renderMarkdown(text) {
  const lines = text.split("\n");
  const out = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    if (/^\s*```/.test(line)) {  // a code fence, closed or still streaming
      const code = [];
      for (i++; i < lines.length && !/^\s*```/.test(lines[i]); i++) code.push(lines[i]);
      i++;
      out.push("<pre><code>" + escapeHtml(code.join("\n")) + "</code></pre>");
    } else if (BULLET.test(line) || NUMBERED.test(line)) {
      // one list while items of its kind follow, blank lines between them included (models often write
      // "1. …\n\n2. …"); a numbered list starts at its first item's own number
      const numbered = !BULLET.test(line);
      const pattern = numbered ? NUMBERED : BULLET;
      const items = [];
      while (i < lines.length) {
        if (pattern.test(lines[i])) {
          const match = lines[i++].match(pattern);
          items.push("<li>" + inline(match[match.length - 1]) + "</li>");
          continue;
        }
        let next = i;
        while (next < lines.length && !lines[next].trim()) next++;
        if (next === i || next === lines.length || !pattern.test(lines[next])) break;
        i = next;
      }
      const start = numbered ? parseInt(line.match(NUMBERED)[1], 10) : 1;
      const tag = numbered ? "ol" : "ul";
      out.push("<" + tag + (start !== 1 ? ' start="' + start + '"' : "") + ">" + items.join("") + "</" + tag + ">");
    } else if (!line.trim()) {
      i++;
    } else {
      const paragraph = [];
      for (; i < lines.length && lines[i].trim() && !/^\s*```/.test(lines[i]) && !BULLET.test(lines[i])
             && !NUMBERED.test(lines[i]); i++) paragraph.push(inline(lines[i]));
      out.push("<p>" + paragraph.join("<br>") + "</p>");
    }
  }
  return out.join("");
}

// -- messages -----------------------------------------------------------------------------------------
function addMessage(role, text, index) {  // index: the message's place in state.messages, for Edit
  const node = document.createElement("article");
  node.className = "msg " + role;
  if (role === "user" && index !== undefined) {
    const edit = document.createElement("button");
    edit.type = "button";
    edit.className = "edit";
    edit.textContent = "Edit";
    edit.title = "Ask this again, changed, in a new conversation; this one stays as it is";
    edit.addEventListener("click", () => editMessage(index));
    node.appendChild(edit);
  }
  const content = document.createElement("div");
  content.className = "content";
  node.appendChild(content);
  setText(node, text);
  $("messages").appendChild(node);
  node.scrollIntoView({block: "end"});
  return node;
}

function setText(node, text) {
  const content = node.querySelector(".content");
  if (node.classList.contains("assistant")) content.innerHTML = renderMarkdown(text);  // escaped inside
  else content.textContent = text;
}

function showFigures(node, figures) {
  const line = document.createElement("p");
  line.className = "figures";
  line.textContent = figures.tokens_per_second.toFixed(1) + " tokens/s · "
    + figures.tokens_per_round_trip.toFixed(2) + " tokens per round trip · prompt "
    + figures.prompt_tokens_sent + " tokens, first token after " + figures.time_to_first_token.toFixed(2)
    + " s (upload + prefill) · " + kilobytes(figures.bytes_sent) + " sent, "
    + kilobytes(figures.bytes_received) + " received";
  node.appendChild(line);
}

function kilobytes(n) {
  return n < 1024 ? n + " B" : (n / 1024).toFixed(1) + " KiB";
}

function showConversation() {
  $("messages").replaceChildren();
  state.messages.forEach((m, i) => addMessage(m.role, m.content, i));
  $("conversation-name").textContent = state.conversation || "new chat";
  $("regenerate").disabled = !state.messages.some((m) => m.role === "user");
  $("fork").disabled = !state.messages.some((m) => m.role === "assistant");
  $("audit").disabled = !state.conversation;
  $("audit-result").replaceChildren();
  showBytes();
}

// -- answering ----------------------------------------------------------------------------------------
function newName() {
  const now = new Date();
  const pad = (n) => String(n).padStart(2, "0");
  const random = Array.from(crypto.getRandomValues(new Uint8Array(3)), (b) => pad(b.toString(16))).join("");
  return "chat-" + now.getFullYear() + pad(now.getMonth() + 1) + pad(now.getDate()) + "-" + pad(now.getHours())
    + pad(now.getMinutes()) + pad(now.getSeconds()) + "-" + random;
}

function request() {
  const body = {model: state.model, messages: state.messages, stream: true, stream_options: {include_usage: true},
                conversation: state.conversation};
  const temperature = $("temperature").value;
  if (temperature !== "") body.temperature = Number(temperature);
  const maxTokens = $("max-tokens").value;
  if (maxTokens !== "") body.max_tokens = Number(maxTokens);
  if ($("speculate").value) body.speculate = $("speculate").value;
  return body;
}

async function answer() {
  const node = addMessage("assistant", "");
  node.classList.add("streaming");
  const controller = new AbortController();
  state.controller = controller;
  setBusy(true);
  let text = "";
  let figures = null;
  try {
    const response = await fetch("/v1/chat/completions", {method: "POST", headers: headers(true),
                                                          body: JSON.stringify(request()), signal: controller.signal});
    if (!response.ok) throw await failure(response);
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, {stream: true});
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
          const chunk = JSON.parse(line.slice(6));
          if (chunk.error) throw new Error(chunk.error.message);
          const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
          if (delta && delta.content) {
            text += delta.content;
            setText(node, text);
          }
          if (chunk.usage && chunk.usage.infemeral) figures = chunk.usage.infemeral;
        }
      }
    }
    state.messages.push({role: "assistant", content: text});
    if (figures) {
      showFigures(node, figures);
      countBytes(figures);
    }
    refreshList();
  } catch (error) {
    if (error.name === "AbortError") {
      node.classList.add("stopped");  // the turn rolled back on the pod: nothing of it is kept
      node.title = "stopped: this answer was not kept";
    } else {
      node.remove();
      showError(error);
    }
  } finally {
    node.classList.remove("streaming");
    state.controller = null;
    setBusy(false);
  }
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  $("regenerate").disabled = busy || !state.messages.some((m) => m.role === "user");
  $("fork").disabled = busy || !state.messages.some((m) => m.role === "assistant");
  $("audit").disabled = busy || !state.conversation;
}

async function send(event) {
  event.preventDefault();
  const text = $("prompt").value;
  if (!text.trim() || state.controller) return;
  showError(null);
  if (!state.conversation) {
    state.conversation = newName();
    const system = $("system").value.trim();
    state.messages = system ? [{role: "system", content: system}] : [];
    showConversation();
  }
  $("prompt").value = "";
  state.messages.push({role: "user", content: text});
  addMessage("user", text, state.messages.length - 1);
  await answer();
}

async function editMessage(index) {
  if (state.controller) return;
  const text = prompt("Edit your message. It is asked again in a new conversation; this one stays as it is.",
                      state.messages[index].content);
  if (text === null || !text.trim()) return;
  showError(null);
  const kept = state.messages.slice(0, index);
  const turns = kept.filter((m) => m.role === "assistant").length;
  if (state.pod && state.pod.fork && turns) {
    if (!await fork(turns)) return;  // the pod copies the turns before it: nothing of them is uploaded again
  } else {
    state.conversation = newName();  // the request sends what it keeps
    state.messages = kept;
    showConversation();
  }
  state.messages.push({role: "user", content: text});
  addMessage("user", text, state.messages.length - 1);
  await answer();
}

async function regenerate() {
  if (state.controller) return;
  showError(null);
  if (state.messages.length && state.messages[state.messages.length - 1].role === "assistant") state.messages.pop();
  showConversation();
  await answer();
}

// -- conversations ------------------------------------------------------------------------------------
async function refreshList() {
  let listed;
  try {
    listed = await api("GET", "/v1/conversations");
  } catch (error) {
    showError(error);
    return;
  }
  const list = $("conversations");
  list.replaceChildren();
  for (const c of listed.data) {
    const item = document.createElement("li");
    item.dataset.name = c.name;
    if (c.name === state.conversation) item.classList.add("current");
    const open = document.createElement("button");
    open.className = "open";
    open.textContent = c.title || c.name;
    open.title = c.name + " (" + c.messages + " messages)";
    open.addEventListener("click", () => resume(c.name));
    const rename = document.createElement("button");
    rename.className = "rename";
    rename.textContent = "Rename";
    rename.addEventListener("click", () => renameConversation(c.name));
    const remove = document.createElement("button");
    remove.className = "delete";
    remove.textContent = "Delete";
    remove.addEventListener("click", () => deleteConversation(c.name));
    item.append(open, rename, remove);
    list.appendChild(item);
  }
}

async function resume(name) {
  if (state.controller) return;
  showError(null);
  try {
    const saved = await api("GET", "/v1/conversations/" + encodeURIComponent(name));
    state.conversation = saved.name;
    state.messages = saved.messages;
    showConversation();
    refreshList();
  } catch (error) {
    showError(error);
  }
}

async function renameConversation(name) {
  const newName = prompt("New name (letters, digits, '.', '_', '-')", name);
  if (!newName || newName === name) return;
  try {
    await api("PATCH", "/v1/conversations/" + encodeURIComponent(name), {name: newName});
    moveBytes(name, newName);
    if (state.conversation === name) {
      state.conversation = newName;
      $("conversation-name").textContent = newName;
    }
    refreshList();
  } catch (error) {
    showError(error);
  }
}

async function deleteConversation(name) {
  if (!confirm("Delete " + name + " here and on the pod?")) return;
  try {
    await api("DELETE", "/v1/conversations/" + encodeURIComponent(name));
    moveBytes(name, null);
    if (state.conversation === name) newChat();
    refreshList();
  } catch (error) {
    showError(error);
  }
}

async function fork(atTurn) {  // atTurn: the turns the new conversation keeps (null: all); whether it was made
  if (state.controller) return false;
  showError(null);
  try {
    const forked = await api("POST", "/v1/conversations/" + encodeURIComponent(state.conversation) + "/fork",
                             atTurn ? {at_turn: atTurn} : {});
    state.conversation = forked.name;
    state.messages = forked.messages;
    showConversation();
    refreshList();
    return true;
  } catch (error) {
    showError(error);
    describePod().catch(() => {});  // a pod that cannot fork says so from now on: the button goes
    return false;
  }
}

function newChat() {
  if (state.controller) return;
  state.conversation = null;
  state.messages = [];
  showError(null);
  showConversation();
  refreshList();
}

// -- what the pod sees --------------------------------------------------------------------------------
function bytesByConversation() {
  try {
    return JSON.parse(sessionStorage.getItem(BYTES_STORAGE) || "{}");
  } catch (e) {
    return {};
  }
}

function countBytes(figures) {
  const all = bytesByConversation();
  const mine = all[state.conversation] || {sent: 0, received: 0, answers: 0};
  mine.sent += figures.bytes_sent;
  mine.received += figures.bytes_received;
  mine.answers += 1;
  all[state.conversation] = mine;
  sessionStorage.setItem(BYTES_STORAGE, JSON.stringify(all));
  showBytes();
}

function moveBytes(from, to) {
  const all = bytesByConversation();
  if (to && all[from]) all[to] = all[from];
  delete all[from];
  sessionStorage.setItem(BYTES_STORAGE, JSON.stringify(all));
}

function showBytes() {
  const mine = bytesByConversation()[state.conversation];
  $("pod-bytes").textContent = mine
    ? kilobytes(mine.sent) + " sent, " + kilobytes(mine.received) + " received over " + mine.answers
      + " answer(s) in this tab"
    : "nothing sent from this tab yet";
}

async function describePod() {
  const pod = await api("GET", "/v1/pod");
  state.pod = pod;
  $("pod-address").textContent = pod.address + (pod.reachable ? " (" + pod.model_type + ", layers "
    + pod.served_layers + " on " + pod.device + ")" : " (not reachable: " + pod.error + ")");
  $("pod-tls").textContent = pod.tls ? (pod.mutual_tls ? "TLS, mutual" : "TLS") : "no TLS: plaintext gRPC";
  $("pod-tls").className = pod.tls ? "" : "warning";
  $("pod-sent").textContent = pod.sent.join("; ");
  $("pod-never").textContent = pod.never_sent.join(", ");
  $("speculate").replaceChildren($("speculate").options[0]);
  for (const mode of pod.speculate) {
    const option = document.createElement("option");
    option.value = option.textContent = mode;
    $("speculate").appendChild(option);
  }
  $("fork").hidden = !pod.fork;  // until the pod refused a fork
}

async function audit() {
  const result = $("audit-result");
  result.textContent = "auditing (this takes a while)…";
  $("audit").disabled = true;
  try {
    const report = await api("POST", "/v1/conversations/" + encodeURIComponent(state.conversation) + "/audit");
    result.replaceChildren();
    for (const row of report.rows) {
      const title = document.createElement("h3");
      title.textContent = row.attack + ": " + row.user_text;
      const line = document.createElement("p");
      line.className = "tokens";
      report.tokens.forEach((token, i) => {
        const span = document.createElement("span");
        span.className = row.recovered[i] ? "recovered" : "hidden-token";
        span.textContent = token;
        line.appendChild(span);
      });
      result.append(title, line);
    }
    const verdict = document.createElement("p");
    verdict.className = "hint";
    verdict.textContent = report.verdict.join(" ") + " (" + report.seconds + " s)";
    result.appendChild(verdict);
  } catch (error) {
    result.textContent = "";
    showError(error);
  } finally {
    $("audit").disabled = !state.conversation || !!state.controller;
  }
}

// -- start --------------------------------------------------------------------------------------------
async function start() {
  $("composer").addEventListener("submit", send);
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) send(event);
  });
  $("stop").addEventListener("click", () => state.controller && state.controller.abort());
  $("regenerate").addEventListener("click", regenerate);
  $("fork").addEventListener("click", () => fork(null));
  $("new-chat").addEventListener("click", newChat);
  $("audit").addEventListener("click", audit);
  $("api-key").value = sessionStorage.getItem(KEY_STORAGE) || "";
  $("api-key").addEventListener("change", () => {
    sessionStorage.setItem(KEY_STORAGE, $("api-key").value.trim());
    loadEndpoint();
  });
  showConversation();
  await loadEndpoint();
}

async function loadEndpoint() {
  try {
    const models = await api("GET", "/v1/models");
    state.model = models.data[0].id;
    $("model").textContent = state.model;
    showError(null);
    await Promise.all([refreshList(), describePod()]);
  } catch (error) {
    showError(error);
  }
}

document.addEventListener("DOMContentLoaded", start);
