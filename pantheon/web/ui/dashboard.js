// The live dashboard at `/dashboard`: every second it reads `/` (the JSON status) and `/metrics`
// (Prometheus text) and plots, per model, generated and prefilled tokens/s, TTFT and time-per-token percentiles over
// the last 10 s, slots busy and queue depth, KV-cache use, speculative-decoding acceptance and compile
// progress; for the server, each memory pool's use. With an admin key it also loads and unloads models.

import { adminKey, api, clear, el, fmt, fmtBytes, keyBox, notice, parseMetrics, sampleValue, samples, setAdminKey } from "./common.js";
import { chart } from "./plot.js";

const $ = (id) => document.getElementById(id);
const PERIOD_MS = 1000;
const WINDOW_S = 10; // percentiles and acceptance over the samples of the last 10 s

const history = []; // [{t (s), parsed}] of the last scrapes, oldest first
const cards = new Map(); // model -> {node, charts, compile}
let memChart = null;
let memPools = [];

// ---- figures from the scrapes -----------------------------------------------------------------------
function histogram(parsed, name, model) {
  const rows = samples(parsed, name + "_bucket", { model })
    .map((s) => ({ le: s.labels.le === "+Inf" ? Infinity : Number(s.labels.le), n: s.value }))
    .sort((a, b) => a.le - b.le);
  return rows;
}

// The q-quantile of the observations between two cumulative histograms (Prometheus' histogram_quantile:
// linear inside the bucket). null when nothing was observed.
function quantile(q, now, then) {
  if (!now.length) return null;
  const before = new Map((then || []).map((r) => [r.le, r.n]));
  const d = now.map((r) => ({ le: r.le, n: r.n - (before.get(r.le) || 0) }));
  const total = d[d.length - 1].n;
  if (!(total > 0)) return null;
  const rank = q * total;
  let prevLe = 0;
  let prevN = 0;
  for (const r of d) {
    if (r.n >= rank) {
      if (r.le === Infinity) return prevLe;
      const inBucket = r.n - prevN;
      return inBucket > 0 ? prevLe + (r.le - prevLe) * ((rank - prevN) / inBucket) : r.le;
    }
    prevLe = r.le;
    prevN = r.n;
  }
  return prevLe;
}

// The scrape about WINDOW_S seconds before the newest (the oldest one kept when there is none as old).
function windowStart() {
  const newest = history[history.length - 1];
  let pick = history[0];
  for (const h of history) if (newest.t - h.t >= WINDOW_S) pick = h;
  return pick === newest ? null : pick;
}

function delta(name, model, a, b) {
  if (!a || !b) return null;
  const x = sampleValue(b.parsed, name, { model });
  const y = sampleValue(a.parsed, name, { model });
  if (x === null || y === null) return null;
  return x - y;
}

function modelsIn(parsed) {
  const names = new Set();
  for (const s of samples(parsed, "pantheon_batch_slots")) names.add(s.labels.model);
  return [...names].sort();
}

// ---- drawing ------------------------------------------------------------------------------------------
function card(model) {
  let c = cards.get(model);
  if (c) return c;
  const charts = {
    tps: chart({ id: "tokens_per_s", title: "Generated tokens/s", series: ["tok/s"] }),
    prefill: chart({ id: "prefill_per_s", title: "Prompt tokens/s (prefill)", series: ["tok/s"], digits: 0 }),
    ttft: chart({ id: "ttft", title: "Time to first token", unit: "s", series: ["p50", "p90", "p99"], digits: 3 }),
    tpot: chart({ id: "time_per_token", title: "Time per token", unit: "ms", series: ["p50", "p90", "p99"] }),
    slots: chart({ id: "slots", title: "Slots busy / queue", series: ["busy", "queued", "slots"], digits: 0 }),
    kv: chart({ id: "kv", title: "KV cache in use", unit: "%", series: ["used"], max: 100 }),
    spec: chart({ id: "speculation", title: "Speculation acceptance", unit: "%", series: ["accepted"], max: 100 }),
    compile: chart({ id: "compile", title: "Step programs compiled", series: ["compiled", "planned"], digits: 0 }),
  };
  const badges = el("span", { class: "badges" });
  const compile = el("div", { class: "compile" });
  const node = el("section", { class: "model-card", dataset: { model } },
    el("h2", {}, model, " ", badges), compile,
    el("div", { class: "plots" }, Object.values(charts).map((ch) => ch.node)));
  c = { node, charts, badges, compile };
  cards.set(model, c);
  $("models").appendChild(node);
  return c;
}

function drawModel(model, health) {
  const c = card(model);
  const now = history[history.length - 1];
  const prev = history.length > 1 ? history[history.length - 2] : null;
  const start = windowStart();
  const p = now.parsed;
  const g = (name) => sampleValue(p, name, { model });
  const dt = prev ? now.t - prev.t : null;

  const decoded = delta("pantheon_scheduler_decode_tokens_total", model, prev, now);
  c.charts.tps.push([decoded !== null && dt > 0 ? Math.max(0, decoded) / dt : null]);
  const prefilled = delta("pantheon_scheduler_prefill_tokens_total", model, prev, now);
  c.charts.prefill.push([prefilled !== null && dt > 0 ? Math.max(0, prefilled) / dt : null]);

  const ttftNow = histogram(p, "pantheon_time_to_first_token_seconds", model);
  const ttftThen = start ? histogram(start.parsed, "pantheon_time_to_first_token_seconds", model) : [];
  c.charts.ttft.push([0.5, 0.9, 0.99].map((q) => quantile(q, ttftNow, ttftThen)));
  const itlNow = histogram(p, "pantheon_inter_token_latency_seconds", model);
  const itlThen = start ? histogram(start.parsed, "pantheon_inter_token_latency_seconds", model) : [];
  c.charts.tpot.push([0.5, 0.9, 0.99].map((q) => {
    const v = quantile(q, itlNow, itlThen);
    return v === null ? null : v * 1000;
  }));

  const slots = g("pantheon_batch_slots");
  c.charts.slots.push([g("pantheon_running_requests"), g("pantheon_queued_requests"), slots]);
  const kv = g("pantheon_kv_cache_tokens");
  const cap = g("pantheon_kv_cache_capacity_tokens");
  c.charts.kv.push([kv !== null && cap ? (100 * kv) / cap : null]);

  const names = ["prompt_lookup", "draft_model"];
  let drafted = null;
  let accepted = 0;
  for (const n of names) {
    const d = delta(`pantheon_speculative_${n}_drafted_tokens_total`, model, start, now);
    const a = delta(`pantheon_speculative_${n}_accepted_tokens_total`, model, start, now);
    if (d !== null) drafted = (drafted || 0) + d;
    if (a !== null) accepted += a;
  }
  c.charts.spec.push([drafted ? (100 * accepted) / drafted : null]);

  const compiled = g("pantheon_compiled_programs");
  const planned = g("pantheon_planned_programs");
  c.charts.compile.push(planned ? [compiled, planned] : [null, null]); // no plan: nothing compiles in the background
  clear(c.compile);
  if (compiled !== null && planned) {
    const done = compiled >= planned;
    const bar = el("progress", { max: String(planned) });
    bar.value = compiled;
    c.compile.appendChild(el("span", {}, done ? `all ${planned} step programs compiled` :
      `compiling step programs: ${compiled}/${planned} (serving meanwhile)`));
    if (!done) c.compile.appendChild(bar);
  }
  const busy = health && health.compiling && health.compiling[model];
  if (busy && !c.compile.textContent) c.compile.appendChild(el("span", {}, busy));

  clear(c.badges);
  const tags = [];
  if (slots !== null) tags.push(`${slots} slot${slots === 1 ? "" : "s"}`);
  if (g("pantheon_model_vision") >= 1) tags.push("vision");
  if (g("pantheon_native_kernels") >= 1) tags.push("native CPU kernels");
  for (const t of tags) c.badges.appendChild(el("span", { class: "badge" }, t));
  c.badges.appendChild(el("span", { class: "meta" },
    ` completed ${fmt(g("pantheon_scheduler_completed_total"), 0)} · prefix hits ${fmt(g("pantheon_prefix_cache_hits_total"), 0)}`));
}

function drawServer(health, parsed) {
  const box = $("server-status");
  if (health) {
    let text = health.status === "ok" ? "ready" : health.status;
    if (health.progress) text += ` · ${health.progress}`;
    box.textContent = text;
    box.className = "status " + (health.status === "ok" ? "ok" : health.status === "loading" ? "warn" : "bad");
    box.title = health.error || "";
  }
  if (!parsed) return;
  const pools = samples(parsed, "pantheon_memory_total_bytes").map((s) => s.labels.pool).sort();
  if (!memChart || pools.join() !== memPools.join()) {
    memPools = pools;
    memChart = chart({ id: "memory", title: "Memory in use", unit: "%", series: pools.length ? pools : ["host"], max: 100 });
    const slot = $("memory");
    clear(slot);
    slot.appendChild(memChart.node);
  }
  memChart.push(memPools.map((pool) => {
    const t = sampleValue(parsed, "pantheon_memory_total_bytes", { pool });
    const u = sampleValue(parsed, "pantheon_memory_used_bytes", { pool });
    return t ? (100 * u) / t : null;
  }));
  const facts = $("server-facts");
  clear(facts);
  for (const pool of memPools) {
    facts.appendChild(el("div", {}, `${pool}: ${fmtBytes(sampleValue(parsed, "pantheon_memory_used_bytes", { pool }))} of ` +
      fmtBytes(sampleValue(parsed, "pantheon_memory_total_bytes", { pool }))));
  }
  for (const s of samples(parsed, "pantheon_die_budget_bytes")) {
    const used = sampleValue(parsed, "pantheon_die_used_bytes", { die: s.labels.die });
    facts.appendChild(el("div", {}, `die ${s.labels.die}: ${fmtBytes(used)} reserved by models of a ${fmtBytes(s.value)} budget`));
  }
  const compiles = sampleValue(parsed, "pantheon_jax_compilations_total");
  facts.appendChild(el("div", {}, `JAX compilations: ${fmt(compiles, 0)}`));
}

// ---- the loop ----------------------------------------------------------------------------------------
async function tick() {
  let health = null;
  try {
    const r = await fetch("/", { headers: { Accept: "application/json" }, cache: "no-store" });
    health = await r.json();
  } catch (_) {
    $("server-status").textContent = "server unreachable";
    $("server-status").className = "status bad";
  }
  let parsed = null;
  try {
    const r = await api("/metrics", { accept: "text/plain" });
    parsed = parseMetrics(await r.text());
    notice("");
  } catch (e) {
    notice(e.message);
  }
  if (parsed) {
    history.push({ t: performance.now() / 1000, parsed });
    while (history.length > WINDOW_S + 5) history.shift();
    const models = modelsIn(parsed);
    for (const [name, c] of cards) {
      if (!models.includes(name)) {
        c.node.remove();
        cards.delete(name);
      }
    }
    for (const m of models) drawModel(m, health);
    $("no-models").hidden = models.length > 0;
  }
  drawServer(health, parsed);
  document.body.dataset.ticks = String(Number(document.body.dataset.ticks || "0") + 1);
}

async function loop() {
  const t0 = performance.now();
  try {
    await tick();
  } finally {
    setTimeout(loop, Math.max(100, PERIOD_MS - (performance.now() - t0)));
  }
}

// ---- admin: load and unload -------------------------------------------------------------------------------
function adminMessage(text, kind = "info") {
  const box = $("admin-message");
  box.textContent = text;
  box.className = "admin-message " + kind;
}

async function refreshAdmin() {
  const on = Boolean(adminKey());
  $("admin-body").hidden = !on;
  $("admin-key").value = adminKey();
  if (!on) return;
  const table = $("admin-models");
  try {
    const resp = await api("/admin/dies", { admin: true });
    const body = await resp.json();
    clear(table);
    const seen = new Set();
    for (const die of body.data || []) {
      for (const m of die.models || []) {
        if (seen.has(m.instance_id)) continue;
        seen.add(m.instance_id);
        const unload = el("button", { type: "button", class: "small danger" }, "Unload");
        unload.addEventListener("click", () => {
          if (unload.dataset.armed !== "1") {
            unload.dataset.armed = "1";
            unload.textContent = "Confirm unload";
            return;
          }
          unloadModel(m.name);
        });
        table.appendChild(el("tr", { dataset: { model: m.name } }, el("td", {}, m.name), el("td", {}, m.instance_id || ""),
          el("td", {}, String(m.state || "")), el("td", {}, `die ${die.die ?? die.id}`), el("td", {}, fmtBytes(m.bytes ?? m.reserved_bytes)),
          el("td", {}, unload)));
      }
    }
    if (!seen.size) table.appendChild(el("tr", {}, el("td", { colspan: "6" }, "no model loaded")));
  } catch (e) {
    adminMessage(e.status === 401 ? "The server refused the admin key (401): enter PANTHEON_ADMIN_KEY." :
      e.status === 403 ? "The admin API is off on this server (start it with PANTHEON_ADMIN_KEY)." : e.message, "error");
  }
}

async function loadModel(ev) {
  ev.preventDefault();
  const model = $("load-model").value.trim();
  if (!model) return;
  const body = { model };
  const name = $("load-name").value.trim();
  const mmproj = $("load-mmproj").value.trim();
  if (name) body.name = name;
  if (mmproj) body.mmproj = mmproj;
  const button = $("load-button");
  button.disabled = true;
  adminMessage(`loading ${model}… (this waits until the model is ready)`);
  try {
    const resp = await api("/admin/models/load", { method: "POST", body, admin: true });
    const info = await resp.json();
    adminMessage(`loaded ${info.name || name || model}`, "ok");
  } catch (e) {
    adminMessage(`load failed: ${e.message}`, "error");
  } finally {
    button.disabled = false;
    refreshAdmin();
  }
}

async function unloadModel(name) {
  adminMessage(`unloading ${name}… (in-flight requests finish first)`);
  try {
    await api("/admin/models/unload", { method: "POST", body: { name }, admin: true });
    adminMessage(`unloaded ${name}`, "ok");
  } catch (e) {
    adminMessage(`unload failed: ${e.message}`, "error");
  }
  refreshAdmin();
}

function wire() {
  keyBox(() => tick());
  $("admin-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    setAdminKey($("admin-key").value.trim());
    adminMessage("");
    refreshAdmin();
  });
  $("load-form").addEventListener("submit", loadModel);
  setInterval(refreshAdmin, 5000);
}

wire();
refreshAdmin();
loop();
