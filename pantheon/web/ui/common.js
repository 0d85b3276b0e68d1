// What both pages share: the keys the person typed, API calls with them, DOM building that only ever
// makes text nodes, and a parser of Prometheus' text format.
//
// Rule of these pages: nothing from the server or the model goes into the DOM as HTML. `el` builds
// elements with createElement and text with createTextNode; the Content-Security-Policy also requires
// Trusted Types, so an innerHTML assignment of a string would throw.

const KEY = "pantheon.apiKey";
const ADMIN_KEY = "pantheon.adminKey";

export function apiKey() {
  return localStorage.getItem(KEY) || "";
}

export function setApiKey(value) {
  if (value) localStorage.setItem(KEY, value);
  else localStorage.removeItem(KEY);
}

// The admin key is kept for this tab only (sessionStorage): it can load and unload models.
export function adminKey() {
  return sessionStorage.getItem(ADMIN_KEY) || "";
}

export function setAdminKey(value) {
  if (value) sessionStorage.setItem(ADMIN_KEY, value);
  else sessionStorage.removeItem(ADMIN_KEY);
}

export class ApiError extends Error {
  constructor(status, message, code) {
    super(message);
    this.status = status;
    this.code = code || null;
  }
}

// The message of an error answer: OpenAI's {"error": {"message"}} (or Anthropic's), else the status.
export async function errorOf(resp) {
  let message = `HTTP ${resp.status}`;
  let code = null;
  try {
    const body = await resp.json();
    const err = body && body.error;
    if (err && typeof err.message === "string") message = err.message;
    if (err && typeof err.code === "string") code = err.code;
  } catch (_) {
    // not JSON: keep the status
  }
  if (resp.status === 401) {
    message = "The server refused the API key (401). Enter the key the server was started with " +
      "(PANTHEON_API_KEY) in the key box above. Server said: " + message;
  }
  return new ApiError(resp.status, message, code);
}

// fetch() against this server with the bearer key; `admin`: the admin key instead. Throws ApiError on
// any non-2xx answer.
export async function api(path, { method = "GET", body, admin = false, signal, accept } = {}) {
  const headers = {};
  const key = admin ? adminKey() : apiKey();
  if (key) headers["Authorization"] = "Bearer " + key;
  if (body !== undefined) headers["Content-Type"] = "application/json";
  headers["Accept"] = accept || "application/json";
  const resp = await fetch(path, {
    method, headers, signal, cache: "no-store",
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  if (!resp.ok) throw await errorOf(resp);
  return resp;
}

// el("div", {class: "x", title: "..."}, "text", child, ...): children that are strings become text nodes.
export function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "class") node.className = v;
    else if (k === "dataset") Object.assign(node.dataset, v);
    else if (k.startsWith("on") && typeof v === "function") node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v === true ? "" : String(v));
  }
  append(node, children);
  return node;
}

function append(node, children) {
  for (const c of children) {
    if (c === undefined || c === null || c === false) continue;
    if (Array.isArray(c)) append(node, c);
    else if (c instanceof Node) node.appendChild(c);
    else node.appendChild(document.createTextNode(String(c)));
  }
}

export function clear(node) {
  while (node.firstChild) node.removeChild(node.firstChild);
}

// The notice bar under the header: kind "error" | "info"; empty text hides it.
export function notice(text, kind = "error") {
  const bar = document.getElementById("notice");
  if (!bar) return;
  bar.textContent = text || "";
  bar.className = "notice " + kind;
  bar.hidden = !text;
}

// The key box in the header: typed once, kept in localStorage, sent as a bearer by api().
export function keyBox(onChange) {
  const form = document.getElementById("key-form");
  const input = document.getElementById("api-key");
  if (!form || !input) return;
  input.value = apiKey();
  form.addEventListener("submit", (ev) => {
    ev.preventDefault();
    setApiKey(input.value.trim());
    onChange();
  });
}

// ---- Prometheus text format -----------------------------------------------------------------------
// parseMetrics(text) -> [{name, labels: {k: v}, value}] for every sample line (comments skipped).
export function parseMetrics(text) {
  const out = [];
  for (const raw of text.split("\n")) {
    const line = raw.trim();
    if (!line || line.startsWith("#")) continue;
    let i = 0;
    while (i < line.length && /[A-Za-z0-9_:]/.test(line[i])) i++;
    const name = line.slice(0, i);
    const labels = {};
    if (line[i] === "{") {
      i++;
      while (i < line.length && line[i] !== "}") {
        let j = i;
        while (j < line.length && line[j] !== "=") j++;
        const key = line.slice(i, j).trim();
        i = j + 2; // past ="
        let value = "";
        while (i < line.length && line[i] !== '"') {
          if (line[i] === "\\" && i + 1 < line.length) {
            const nx = line[i + 1];
            value += nx === "n" ? "\n" : nx;
            i += 2;
          } else {
            value += line[i++];
          }
        }
        labels[key] = value;
        i++; // past the closing quote
        if (line[i] === ",") i++;
      }
      i++; // past }
    }
    const rest = line.slice(i).trim().split(/\s+/);
    const value = rest[0] === "+Inf" ? Infinity : rest[0] === "-Inf" ? -Infinity : Number(rest[0]);
    if (name) out.push({ name, labels, value });
  }
  return out;
}

// The samples of one metric name, optionally filtered by labels.
export function samples(parsed, name, where = {}) {
  return parsed.filter((s) => s.name === name &&
    Object.entries(where).every(([k, v]) => s.labels[k] === v));
}

export function sampleValue(parsed, name, where = {}) {
  const s = samples(parsed, name, where);
  return s.length ? s.reduce((a, b) => a + b.value, 0) : null;
}

export function fmt(x, digits = 1) {
  if (x === null || x === undefined || !Number.isFinite(x)) return "–";
  return x.toFixed(digits);
}

export function fmtBytes(n) {
  if (n === null || n === undefined || !Number.isFinite(n)) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}
