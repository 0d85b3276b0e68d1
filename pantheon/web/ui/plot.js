// A small line chart in plain SVG: a title, a legend with each series' latest value, a y axis from 0 to
// a round maximum, and the last `span` samples of each series (null = no value: a gap). No library.

import { el } from "./common.js";

const NS = "http://www.w3.org/2000/svg";
const W = 320;
const H = 110;
const PAD_L = 38;
const PAD_R = 6;
const PAD_T = 6;
const PAD_B = 14;

function svg(tag, attrs) {
  const node = document.createElementNS(NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  return node;
}

// The smallest of 1, 2, 2.5, 5 x 10^k at or above x.
function niceMax(x) {
  if (!(x > 0)) return 1;
  const p = Math.pow(10, Math.floor(Math.log10(x)));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= x * 1.0001) return m * p;
  return 10 * p;
}

function label(v) {
  if (v === 0) return "0";
  if (Math.abs(v) >= 1e6) return (v / 1e6).toFixed(1) + "M";
  if (Math.abs(v) >= 1e4) return (v / 1e3).toFixed(0) + "k";
  if (Math.abs(v) >= 100) return v.toFixed(0);
  if (Math.abs(v) >= 1) return String(Math.round(v * 10) / 10);
  return String(Math.round(v * 1000) / 1000);
}

// chart({id, title, unit, series: ["p50", "p90"], span: 120, max: fixed y max or undefined, digits})
// -> {node, push(values)}: push one sample per series (numbers or null) and redraw.
export function chart({ id, title, unit = "", series, span = 120, max, digits = 1 }) {
  const data = series.map(() => []);
  const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, class: "plot", role: "img", "aria-label": title });
  const grid = svg("g", { class: "grid" });
  const lines = series.map((_, i) => svg("path", { class: `line s${i}`, d: "" }));
  root.appendChild(grid);
  lines.forEach((l) => root.appendChild(l));
  const legend = el("div", { class: "legend" });
  const values = series.map((name, i) => {
    const v = el("span", { class: "v" }, "–");
    legend.appendChild(el("span", { class: `key s${i}` }, el("i", {}), `${name} `, v));
    return v;
  });
  const node = el("figure", { class: "chart", dataset: { chart: id, last: "", samples: "0" } },
    el("figcaption", {}, title, unit ? el("span", { class: "unit" }, ` (${unit})`) : null), root, legend);

  function draw() {
    while (grid.firstChild) grid.removeChild(grid.firstChild);
    let top = 0;
    for (const d of data) for (const v of d) if (v !== null && Number.isFinite(v)) top = Math.max(top, v);
    const ymax = max !== undefined ? max : niceMax(top);
    const x = (i) => PAD_L + (W - PAD_L - PAD_R) * (i / (span - 1));
    const y = (v) => PAD_T + (H - PAD_T - PAD_B) * (1 - Math.min(v, ymax) / ymax);
    for (const frac of [0, 0.5, 1]) {
      const yy = y(ymax * frac);
      grid.appendChild(svg("line", { x1: PAD_L, x2: W - PAD_R, y1: yy, y2: yy }));
      const t = svg("text", { x: PAD_L - 4, y: yy + 3, "text-anchor": "end" });
      t.textContent = label(ymax * frac);
      grid.appendChild(t);
    }
    const t = svg("text", { x: W - PAD_R, y: H - 2, "text-anchor": "end" });
    t.textContent = `last ${span} s`;
    grid.appendChild(t);
    data.forEach((d, s) => {
      const offset = span - d.length;
      const segs = [];
      let cur = [];
      d.forEach((v, i) => {
        if (v === null || !Number.isFinite(v)) {
          if (cur.length) segs.push(cur);
          cur = [];
        } else {
          cur.push(`${x(offset + i).toFixed(1)},${y(v).toFixed(1)}`);
        }
      });
      if (cur.length) segs.push(cur);
      // one path per series; a gap (no value) starts a new subpath, a lone point is a dot
      lines[s].setAttribute("d", segs.map((seg) => "M" + seg[0] + (seg.length === 1 ? " h0.1" : " L" + seg.slice(1).join(" L"))).join(" "));
      const last = [...d].reverse().find((v) => v !== null && Number.isFinite(v));
      values[s].textContent = last === undefined ? "–" : last.toFixed(digits);
    });
    const first = [...data[0]].reverse().find((v) => v !== null && Number.isFinite(v));
    node.dataset.last = first === undefined ? "" : String(first);
    node.dataset.samples = String(data[0].filter((v) => v !== null).length);
  }

  function push(vals) {
    vals.forEach((v, i) => {
      data[i].push(v === undefined ? null : v);
      if (data[i].length > span) data[i].shift();
    });
    draw();
  }

  draw();
  return { node, push, data };
}
