// The chat playground at `/`: pick a loaded model, stream a conversation through
// /v1/chat/completions, see each answer's reasoning (folded), tool calls, tokens, time to first token,
// speed and cached prompt tokens. Conversations and settings live in this browser's localStorage only.
//
// Every string the model (or the server) produced is put into the page as text: `el` and `renderText`
// make text nodes and elements, never parse HTML.

import { api, apiKey, clear, el, errorOf, fmt, keyBox, notice, parseMetrics } from "./common.js";

const CONVS = "pantheon.conversations";
const CURRENT = "pantheon.current";
const SETTINGS = "pantheon.chatSettings";
const SETTING_IDS = ["system", "temperature", "top_p", "max_tokens", "seed", "tools", "tool_choice", "extra"];

const $ = (id) => document.getElementById(id);

const state = {
  convs: [],
  current: null,
  models: [], // [{id, vision}]
  pending: [], // attachments of the message being written: [{name, url}]
  controller: null, // the AbortController of the answer being streamed
  status: null,
};

// ---- storage --------------------------------------------------------------------------------------
function newId() {
  return Date.now().toString(36) + Math.random().toString(36).slice(2, 8);
}

function loadStored() {
  try {
    state.convs = JSON.parse(localStorage.getItem(CONVS) || "[]");
    if (!Array.isArray(state.convs)) state.convs = [];
  } catch (_) {
    state.convs = [];
  }
  state.current = localStorage.getItem(CURRENT);
  if (!state.convs.some((c) => c.id === state.current)) state.current = state.convs.length ? state.convs[0].id : null;
  try {
    const s = JSON.parse(localStorage.getItem(SETTINGS) || "{}");
    for (const id of SETTING_IDS) if (typeof s[id] === "string") $(id).value = s[id];
  } catch (_) {
    // keep the defaults
  }
}

function save() {
  localStorage.setItem(CURRENT, state.current || "");
  try {
    localStorage.setItem(CONVS, JSON.stringify(state.convs));
  } catch (_) {
    // Over the browser's quota (images are large): keep the text, drop the pictures from storage.
    const slim = state.convs.map((c) => ({
      ...c, messages: c.messages.map((m) => (m.images && m.images.length ? { ...m, images: [], imagesDropped: m.images.length } : m)),
    }));
    try {
      localStorage.setItem(CONVS, JSON.stringify(slim));
      notice("The images are too large for this browser's storage: the conversation is kept without them.", "info");
    } catch (_) {
      notice("This browser's storage is full: the conversation is not saved.");
    }
  }
}

function saveSettings() {
  const s = {};
  for (const id of SETTING_IDS) s[id] = $(id).value;
  localStorage.setItem(SETTINGS, JSON.stringify(s));
}

function conv() {
  let c = state.convs.find((x) => x.id === state.current);
  if (!c) {
    c = { id: newId(), title: "New chat", model: $("model").value || null, messages: [], updated: Date.now() };
    state.convs.unshift(c);
    state.current = c.id;
  }
  return c;
}

// ---- server status and models ---------------------------------------------------------------------
async function refreshStatus() {
  const box = $("server-status");
  try {
    const resp = await fetch("/", { headers: { Accept: "application/json" }, cache: "no-store" });
    const body = await resp.json();
    const was = state.status;
    state.status = body.status;
    let text = body.status === "ok" ? "ready" : body.status;
    if (body.progress) text += ` · ${body.progress}`;
    box.textContent = text;
    box.className = "status " + (body.status === "ok" ? "ok" : body.status === "loading" ? "warn" : "bad");
    box.title = body.error || "";
    if (body.status === "ok" && was !== "ok") await loadModels();
  } catch (_) {
    box.textContent = "server unreachable";
    box.className = "status bad";
  }
}

async function loadModels() {
  const select = $("model");
  try {
    const resp = await api("/v1/models");
    const list = (await resp.json()).data || [];
    const vision = new Set();
    try {
      const text = await (await api("/metrics", { accept: "text/plain" })).text();
      for (const s of parseMetrics(text)) if (s.name === "pantheon_model_vision" && s.value >= 1) vision.add(s.labels.model);
    } catch (_) {
      // no metrics: no attachments offered
    }
    state.models = list.map((m) => ({ id: String(m.id), vision: vision.has(String(m.id)) }));
    notice("");
  } catch (e) {
    state.models = [];
    notice(e.message);
  }
  const keep = (state.convs.find((c) => c.id === state.current) || {}).model || select.value;
  clear(select);
  if (!state.models.length) select.appendChild(el("option", { value: "" }, apiKey() ? "(no model)" : "(no model: API key?)"));
  for (const m of state.models) select.appendChild(el("option", { value: m.id }, m.id + (m.vision ? " (vision)" : "")));
  if (state.models.some((m) => m.id === keep)) select.value = keep;
  modelChanged(false);
}

function currentModel() {
  return state.models.find((m) => m.id === $("model").value) || null;
}

function modelChanged(store = true) {
  const m = currentModel();
  $("attach-label").hidden = !(m && m.vision);
  $("model-caps").textContent = m && m.vision ? "takes images" : "";
  if (m && m.vision === false && state.pending.length) {
    state.pending = [];
    renderAttachments();
  }
  if (store && state.current) {
    conv().model = $("model").value;
    save();
  }
}

// ---- rendering --------------------------------------------------------------------------------------
// Text with ``` fences as code blocks and `x` as inline code; everything else as plain text (pre-wrap).
export function renderText(text) {
  const frag = document.createDocumentFragment();
  const parts = String(text).split(/^```[^\n]*\n?/m);
  parts.forEach((part, i) => {
    if (i % 2 === 1) {
      frag.appendChild(el("pre", { class: "code" }, el("code", {}, part.replace(/\n$/, ""))));
    } else if (part) {
      const div = el("div", { class: "text" });
      part.split(/(`[^`\n]+`)/).forEach((piece, j) => {
        if (j % 2 === 1) div.appendChild(el("code", {}, piece.slice(1, -1)));
        else if (piece) div.appendChild(document.createTextNode(piece));
      });
      frag.appendChild(div);
    }
  });
  return frag;
}

function statsLine(m) {
  const s = m.stats;
  if (!s) return null;
  const bits = [];
  bits.push(`${s.approx ? "~" : ""}${s.tokens} tokens`);
  if (s.ttft !== null) bits.push(s.whole ? `answer after ${fmt(s.ttft, 2)} s` : `TTFT ${fmt(s.ttft, 2)} s`);
  if (s.tps !== null) bits.push(`${fmt(s.tps, 1)} tok/s${s.whole ? " overall" : ""}`);
  if (s.prompt !== null) bits.push(`prompt ${s.prompt}`);
  if (s.cached !== null) bits.push(`${s.cached} cached`);
  if (s.finish) bits.push(s.finish === "length" ? "cut at max tokens" : s.finish);
  return bits.join(" · ");
}

function copyText(text) {
  if (navigator.clipboard && window.isSecureContext) return navigator.clipboard.writeText(text);
  const area = el("textarea", { class: "offscreen" });
  area.value = text;
  document.body.appendChild(area);
  area.select();
  document.execCommand("copy");
  area.remove();
  return Promise.resolve();
}

function messageText(m) {
  if (m.role === "user") return m.text || "";
  let t = m.content || "";
  for (const c of m.tool_calls || []) t += (t ? "\n" : "") + `${c.name}(${c.arguments})`;
  return t;
}

function messageNode(m, index, last) {
  const who = m.role === "user" ? "You" : m.model || "assistant";
  const actions = el("span", { class: "actions" });
  const copy = el("button", { type: "button", class: "small", title: "Copy the text" }, "Copy");
  copy.addEventListener("click", () => copyText(messageText(m)).then(() => { copy.textContent = "Copied"; }));
  actions.appendChild(copy);
  if (m.role === "user") {
    actions.appendChild(el("button", { type: "button", class: "small", title: "Edit and send again",
      onclick: () => startEdit(index) }, "Edit"));
  } else if (last && !state.controller) {
    actions.appendChild(el("button", { type: "button", class: "small", title: "Answer again",
      onclick: () => retry(index) }, "Retry"));
  }
  const node = el("article", { class: `msg ${m.role}`, dataset: { role: m.role, index: String(index) } },
    el("header", {}, el("span", { class: "role" }, who), actions));
  if (m.role === "user") {
    if (m.images && m.images.length) {
      const imgs = el("div", { class: "images" });
      for (const url of m.images) {
        if (typeof url !== "string" || !url.startsWith("data:image/")) continue; // only what the person attached
        const img = el("img", { alt: "attached image" });
        img.src = url;
        imgs.appendChild(img);
      }
      node.appendChild(imgs);
    }
    if (m.imagesDropped) node.appendChild(el("div", { class: "meta" }, `(${m.imagesDropped} image(s) not kept)`));
    node.appendChild(el("div", { class: "content" }, renderText(m.text || "")));
    return node;
  }
  fillAssistant(node, m);
  return node;
}

// (Re)draw an assistant message's body: reasoning, content, tool calls, error, stats.
function fillAssistant(node, m) {
  const header = node.querySelector("header");
  clear(node);
  node.appendChild(header);
  const streaming = node.dataset.streaming === "1";
  if (m.reasoning) {
    const details = el("details", { class: "reasoning" },
      el("summary", {}, streaming && !m.content ? "Thinking…" : `Reasoning (${m.reasoning.length} characters)`),
      el("div", { class: "reasoning-text" }, m.reasoning));
    if (m.reasoningOpen) details.open = true;
    details.addEventListener("toggle", () => { m.reasoningOpen = details.open; });
    node.appendChild(details);
  }
  const content = el("div", { class: "content" }, renderText(m.content || ""));
  if (streaming && !m.content && !m.reasoning && !(m.tool_calls || []).length) content.appendChild(el("span", { class: "meta" }, "…"));
  node.appendChild(content);
  if (m.tool_calls && m.tool_calls.length) {
    const box = el("div", { class: "tool-calls" });
    for (const call of m.tool_calls) {
      let args = call.arguments || "";
      try {
        args = JSON.stringify(JSON.parse(args), null, 2);
      } catch (_) {
        // not (yet) complete JSON: show it as it came
      }
      box.appendChild(el("div", { class: "tool-call" },
        el("div", { class: "tool-head" }, el("span", { class: "tag" }, "tool call"), " ",
          el("span", { class: "tool-name" }, call.name || "?"), call.id ? el("span", { class: "meta" }, ` ${call.id}`) : null),
        el("pre", { class: "tool-args" }, args)));
    }
    node.appendChild(box);
  }
  if (m.error) node.appendChild(el("div", { class: "error" }, m.error));
  if (m.stopped) node.appendChild(el("div", { class: "meta stopped" }, "stopped"));
  const line = statsLine(m);
  if (line) node.appendChild(el("footer", { class: "stats" }, line));
}

function renderConversations() {
  const list = $("conversations");
  clear(list);
  for (const c of state.convs) {
    const item = el("li", { class: c.id === state.current ? "active" : "" },
      el("button", { type: "button", class: "conv", title: c.title, onclick: () => switchTo(c.id) }, c.title || "New chat"),
      el("button", { type: "button", class: "small del", title: "Delete this conversation",
        onclick: () => removeConv(c.id) }, "×"));
    list.appendChild(item);
  }
}

function renderMessages() {
  const box = $("messages");
  clear(box);
  const c = state.convs.find((x) => x.id === state.current);
  if (!c || !c.messages.length) {
    box.appendChild(el("div", { class: "empty" }, "Send a message to start. Conversations stay in this browser."));
    return;
  }
  c.messages.forEach((m, i) => box.appendChild(messageNode(m, i, i === c.messages.length - 1)));
  box.scrollTop = box.scrollHeight;
}

function renderAll() {
  renderConversations();
  renderMessages();
}

function renderAttachments() {
  const box = $("attachments");
  clear(box);
  state.pending.forEach((a, i) => {
    const img = el("img", { alt: a.name });
    img.src = a.url;
    box.appendChild(el("span", { class: "chip" }, img, el("span", {}, a.name),
      el("button", { type: "button", class: "small", title: "Remove", onclick: () => {
        state.pending.splice(i, 1);
        renderAttachments();
      } }, "×")));
  });
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").hidden = !busy;
  document.body.dataset.streaming = busy ? "1" : "0";
}

// ---- conversations ------------------------------------------------------------------------------------
function switchTo(id) {
  if (state.controller) return;
  state.current = id;
  const c = conv();
  if (c.model && state.models.some((m) => m.id === c.model)) $("model").value = c.model;
  modelChanged(false);
  save();
  renderAll();
}

function removeConv(id) {
  if (state.controller && id === state.current) return;
  state.convs = state.convs.filter((c) => c.id !== id);
  if (state.current === id) state.current = state.convs.length ? state.convs[0].id : null;
  save();
  renderAll();
}

function newChat() {
  if (state.controller) return;
  const c = { id: newId(), title: "New chat", model: $("model").value || null, messages: [], updated: Date.now() };
  state.convs.unshift(c);
  state.current = c.id;
  save();
  renderAll();
  $("prompt").focus();
}

function startEdit(index) {
  if (state.controller) return;
  const c = conv();
  const m = c.messages[index];
  const node = $("messages").querySelector(`article[data-index="${index}"]`);
  if (!node) return;
  const area = el("textarea", { class: "edit", rows: "4" });
  area.value = m.text || "";
  const send = el("button", { type: "button", class: "primary" }, "Send");
  const cancel = el("button", { type: "button" }, "Cancel");
  const body = node.querySelector(".content");
  body.replaceWith(el("div", { class: "editing" }, area, el("div", { class: "row" }, send, cancel)));
  area.focus();
  cancel.addEventListener("click", renderMessages);
  send.addEventListener("click", () => {
    c.messages = c.messages.slice(0, index);
    c.messages.push({ ...m, text: area.value });
    if (index === 0) c.title = titleOf(area.value);
    generate(c);
  });
}

function retry(index) {
  const c = conv();
  c.messages = c.messages.slice(0, index);
  generate(c);
}

function titleOf(text) {
  const t = text.trim().replace(/\s+/g, " ");
  return t ? (t.length > 48 ? t.slice(0, 47) + "…" : t) : "New chat";
}

// ---- the request ----------------------------------------------------------------------------------------
function apiMessages(c) {
  const out = [];
  const system = $("system").value;
  if (system.trim()) out.push({ role: "system", content: system });
  for (const m of c.messages) {
    if (m.role === "user") {
      if (m.images && m.images.length) {
        const parts = [];
        if (m.text) parts.push({ type: "text", text: m.text });
        for (const url of m.images) parts.push({ type: "image_url", image_url: { url } });
        out.push({ role: "user", content: parts });
      } else {
        out.push({ role: "user", content: m.text || "" });
      }
    } else if (m.role === "assistant") {
      const calls = m.tool_calls || [];
      if (!m.content && !calls.length) continue; // a failed or empty turn is not replayed
      const a = { role: "assistant", content: m.content || (calls.length ? null : "") };
      if (calls.length) {
        a.tool_calls = calls.map((t) => ({ ...(t.id ? { id: t.id } : {}), type: "function",
          function: { name: t.name, arguments: t.arguments || "{}" } }));
      }
      out.push(a);
    }
  }
  return out;
}

function numberSetting(id, integer) {
  const raw = $(id).value.trim();
  if (raw === "") return undefined;
  const v = Number(raw);
  if (!Number.isFinite(v) || (integer && !Number.isInteger(v))) throw new Error(`${id}: not a ${integer ? "whole " : ""}number`);
  return v;
}

// The JSON typed into a settings box (undefined when empty); `check(value)` holds for what it must be.
function jsonSetting(id, label, check, what) {
  const raw = $(id).value.trim();
  if (!raw) return undefined;
  let value;
  try {
    value = JSON.parse(raw);
  } catch (e) {
    throw new Error(`${label}: not valid JSON (${e.message})`);
  }
  if (!check(value)) throw new Error(`${label}: must be ${what}`);
  return value;
}

function requestBody(c) {
  const body = {};
  const extra = jsonSetting("extra", "Extra request fields", (v) => v && typeof v === "object" && !Array.isArray(v),
    "a JSON object");
  if (extra) Object.assign(body, extra);
  const num = { temperature: numberSetting("temperature"), top_p: numberSetting("top_p"),
    max_tokens: numberSetting("max_tokens", true), seed: numberSetting("seed", true) };
  for (const [k, v] of Object.entries(num)) if (v !== undefined) body[k] = v;
  const tools = jsonSetting("tools", "Tools", Array.isArray, "a JSON list of {\"type\": \"function\", \"function\": {...}}");
  if (tools) body.tools = tools;
  const choice = $("tool_choice").value.trim();
  if (choice) {
    body.tool_choice = ["auto", "none", "required"].includes(choice) ? choice : { type: "function", function: { name: choice } };
  }
  body.model = c.model || $("model").value;
  body.messages = apiMessages(c);
  body.stream = true;
  body.stream_options = { include_usage: true };
  return body;
}

// Read an SSE body: yields each event's data (a string) as it arrives.
async function* sseData(resp) {
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buf.search(/\r?\n\r?\n/)) >= 0) {
      const block = buf.slice(0, cut);
      buf = buf.slice(cut).replace(/^\r?\n\r?\n/, "");
      const data = block.split(/\r?\n/).filter((l) => l.startsWith("data:")).map((l) => l.slice(5).replace(/^ /, "")).join("\n");
      if (data) yield data;
    }
  }
}

async function generate(c) {
  const model = c.model || $("model").value;
  if (!model) {
    notice(apiKey() ? "No model is loaded on this server." : "No model to talk to: is an API key needed? Enter it above.");
    renderAll();
    return;
  }
  c.model = model;
  let body;
  try {
    body = requestBody(c);
  } catch (e) {
    notice(e.message);
    renderAll();
    return;
  }
  notice("");
  const m = { role: "assistant", model, content: "", reasoning: "", tool_calls: [], stats: null };
  c.messages.push(m);
  c.updated = Date.now();
  save();
  renderAll();
  const node = $("messages").lastElementChild;
  node.dataset.streaming = "1";
  fillAssistant(node, m);
  const controller = new AbortController();
  state.controller = controller;
  setBusy(true);
  const t0 = performance.now();
  let tFirst = null;
  let tLast = null;
  let pieces = 0;
  let usage = null;
  let drawn = false;
  const redraw = () => {
    if (drawn) return;
    drawn = true;
    requestAnimationFrame(() => {
      drawn = false;
      const box = $("messages");
      const stick = box.scrollHeight - box.scrollTop - box.clientHeight < 80;
      fillAssistant(node, m);
      if (stick) box.scrollTop = box.scrollHeight;
    });
  };
  try {
    const resp = await api("/v1/chat/completions", { method: "POST", body, signal: controller.signal, accept: "text/event-stream" });
    for await (const data of sseData(resp)) {
      if (data === "[DONE]") break;
      let chunk;
      try {
        chunk = JSON.parse(data);
      } catch (_) {
        continue;
      }
      if (chunk.error) {
        m.error = String(chunk.error.message || "the generation failed");
        continue;
      }
      if (chunk.usage) usage = chunk.usage;
      const choice = (chunk.choices || []).find((ch) => (ch.index || 0) === 0);
      if (!choice) continue;
      const d = choice.delta || {};
      let got = false;
      if (typeof d.reasoning_content === "string" && d.reasoning_content) {
        m.reasoning += d.reasoning_content;
        got = true;
      }
      if (typeof d.content === "string" && d.content) {
        m.content += d.content;
        got = true;
      }
      for (const tc of d.tool_calls || []) {
        const i = Number.isInteger(tc.index) ? tc.index : m.tool_calls.length;
        const slot = m.tool_calls[i] || (m.tool_calls[i] = { id: "", name: "", arguments: "" });
        if (tc.id) slot.id = String(tc.id);
        if (tc.function && typeof tc.function.name === "string") slot.name += tc.function.name;
        if (tc.function && tc.function.arguments !== undefined) {
          slot.arguments += typeof tc.function.arguments === "string" ? tc.function.arguments : JSON.stringify(tc.function.arguments);
        }
        got = true;
      }
      if (choice.finish_reason) m.finish = choice.finish_reason;
      if (got) {
        const now = performance.now();
        if (tFirst === null) tFirst = now;
        tLast = now;
        pieces += 1;
        redraw();
      }
    }
  } catch (e) {
    if (e.name === "AbortError") m.stopped = true;
    else {
      m.error = e.message;
      if (e.status === 401) notice(e.message);
    }
  } finally {
    const end = tLast || performance.now();
    const tokens = usage && Number.isInteger(usage.completion_tokens) ? usage.completion_tokens : pieces;
    const details = (usage && usage.prompt_tokens_details) || {};
    // An answer that came as one piece (a tool call is sent whole once its last token is parsed) tells
    // nothing of when its first token was made: it gets its total time and overall rate instead.
    const whole = pieces <= 1 && tokens > 1;
    m.stats = (tFirst === null && !usage) ? null : {
      tokens,
      approx: !usage,
      whole,
      ttft: tFirst === null ? null : (tFirst - t0) / 1000,
      tps: whole ? tokens / ((end - t0) / 1000) :
        tFirst !== null && tokens > 1 && end > tFirst ? (tokens - 1) / ((end - tFirst) / 1000) : null,
      prompt: usage && Number.isInteger(usage.prompt_tokens) ? usage.prompt_tokens : null,
      cached: usage ? (Number.isInteger(details.cached_tokens) ? details.cached_tokens : 0) : null,
      finish: m.stopped ? null : m.finish || null,
    };
    if (c.title === "New chat") c.title = titleOf((c.messages.find((x) => x.role === "user") || {}).text || "");
    state.controller = null;
    setBusy(false);
    save();
    renderAll();
  }
}

// ---- wiring ---------------------------------------------------------------------------------------------
function readImage(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(String(reader.result));
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

async function addFiles(files) {
  const m = currentModel();
  if (!m || !m.vision) {
    notice("This model does not take images (it was loaded without a vision projector).");
    return;
  }
  for (const f of files) {
    if (!f.type.startsWith("image/")) {
      notice(`${f.name}: not an image`);
      continue;
    }
    state.pending.push({ name: f.name, url: await readImage(f) });
  }
  renderAttachments();
}

function submit() {
  if (state.controller) return;
  const text = $("prompt").value;
  if (!text.trim() && !state.pending.length) return;
  try {
    requestBody({ model: null, messages: [] }); // a settings box that does not parse: say so, keep the message
  } catch (e) {
    notice(e.message);
    return;
  }
  const c = conv();
  c.model = $("model").value || c.model;
  c.messages.push({ role: "user", text, images: state.pending.map((a) => a.url) });
  if (c.title === "New chat") c.title = titleOf(text);
  state.pending = [];
  renderAttachments();
  $("prompt").value = "";
  generate(c);
}

function wire() {
  $("composer").addEventListener("submit", (ev) => {
    ev.preventDefault();
    submit();
  });
  $("prompt").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
      ev.preventDefault();
      submit();
    }
  });
  $("prompt").addEventListener("paste", (ev) => {
    const files = [...(ev.clipboardData ? ev.clipboardData.files : [])].filter((f) => f.type.startsWith("image/"));
    if (files.length) {
      ev.preventDefault();
      addFiles(files);
    }
  });
  $("composer").addEventListener("dragover", (ev) => ev.preventDefault());
  $("composer").addEventListener("drop", (ev) => {
    ev.preventDefault();
    if (ev.dataTransfer && ev.dataTransfer.files.length) addFiles([...ev.dataTransfer.files]);
  });
  $("attach").addEventListener("change", async () => {
    await addFiles([...$("attach").files]);
    $("attach").value = "";
  });
  $("stop").addEventListener("click", () => state.controller && state.controller.abort());
  $("new-chat").addEventListener("click", newChat);
  $("model").addEventListener("change", () => modelChanged(true));
  for (const id of SETTING_IDS) $(id).addEventListener("change", saveSettings);
  keyBox(loadModels);
}

loadStored();
wire();
renderAll();
setBusy(false);
refreshStatus().then(() => (state.status === "ok" ? null : loadModels()));
setInterval(refreshStatus, 5000);
