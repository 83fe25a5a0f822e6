// Draws planner plans as SVG: one row per rank, shards as blocks coloured by document,
// KV that must move to other ranks highlighted, metrics beside. No dependencies.
"use strict";

const SAMPLE = [4099, 37, 1023, 8191, 1, 511, 2047, 3001, 17, 6143, 733, 97, 5000];
const SVG_NS = "http://www.w3.org/2000/svg";
const $ = (id) => document.getElementById(id);
const STRATEGY_OPTIONS = new Set();  // option names some strategy declares
const ROW_H = 26, ROW_GAP = 6, LABEL_W = 64, LOAD_W = 90;

function token() { return sessionStorage.getItem("planner-token") || ""; }

async function api(method, path, body) {
  const headers = { "Content-Type": "application/json" };
  if (token()) headers.Authorization = "Bearer " + token();
  const res = await fetch(path, { method, headers, body: body && JSON.stringify(body) });
  const text = await res.text();
  let data = null;
  try { data = JSON.parse(text); } catch (e) { data = { detail: text }; }
  if (res.status === 401) { $("token-row").hidden = false; }
  if (!res.ok) { throw new Error(`${res.status}: ${(data && data.detail) || text}`); }
  return { data, res };
}

function status(text, isError) {
  const el = $("status");
  el.textContent = text;
  el.className = isError ? "error" : "";
}

function parseLengths() {
  const parts = $("lengths").value.split(/[\s,;\[\]]+/).filter((s) => s.length);
  const out = parts.map((s) => Number(s));
  const bad = out.findIndex((x) => !Number.isInteger(x) || x < 1);
  if (!out.length) throw new Error("doc_lengths: enter at least one document length");
  if (bad >= 0) throw new Error(`doc_lengths[${bad}]: ${parts[bad]} is not a positive integer`);
  return out;
}

function request() {
  return { doc_lengths: parseLengths(), cp_size: Number($("cp").value), strategy: $("strategy").value };
}

function docColour(doc) { return `hsl(${(doc * 137.508) % 360} 62% 62%)`; }

function el(name, attrs, parent) {
  const node = document.createElementNS(SVG_NS, name);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (parent) parent.appendChild(node);
  return node;
}

// Tokens of shard (d, s, e) on rank r that another rank needs: those ranks attend keys
// [0, end') of doc d, so r sends [s, min(e, max end' of d elsewhere)). With a full
// exchange (or a ring) every token's KV moves.
function sentRanges(group, commMode) {
  const everything = commMode === "full" || commMode === "p2p_ring";
  const ends = new Map();  // doc -> [[rankIndex, end], ...]
  group.shards.forEach((shards, i) => shards.forEach((s) => {
    if (!ends.has(s.doc)) ends.set(s.doc, []);
    ends.get(s.doc).push([i, s.end]);
  }));
  return group.shards.map((shards, i) => shards.map((s) => {
    if (everything) return group.ranks.length > 1 ? [s.start, s.end] : null;
    let need = 0;
    for (const [j, end] of ends.get(s.doc)) if (j !== i) need = Math.max(need, end);
    const hi = Math.min(s.end, need);
    return hi > s.start ? [s.start, hi] : null;
  }));
}

function drawPlan(plan, opts) {
  const compact = opts && opts.compact;
  const rows = plan.groups.reduce((n, g) => n + g.ranks.length, 0);
  const width = compact ? 560 : 860;
  const gapGroups = (plan.groups.length - 1) * 10;
  const height = rows * (ROW_H + ROW_GAP) + gapGroups + 18;
  const svg = el("svg", { viewBox: `0 0 ${width} ${height}`, width: "100%", role: "img",
    "data-plan-id": plan.plan_id, "data-strategy": plan.strategy, class: "plan-svg",
    "aria-label": `${plan.strategy} plan over ${plan.cp_size} ranks` });
  const barW = width - LABEL_W - LOAD_W - 12;
  let y = 4;
  const maxLoad = Math.max(...plan.groups.flatMap((g) => g.rank_stats.workload), 1);
  for (const group of plan.groups) {
    const perRank = group.shards.map((sh, i) => sh.reduce((n, s) => n + s.end - s.start, 0) + group.padding[i]);
    const scale = barW / Math.max(...perRank, 1);
    const sent = sentRanges(group, plan.comm_mode);
    group.ranks.forEach((rank, i) => {
      const t = el("text", { x: 0, y: y + ROW_H * 0.7 }, svg);
      t.textContent = `rank ${rank}`;
      let x = LABEL_W;
      group.shards[i].forEach((s, k) => {
        const w = (s.end - s.start) * scale;
        const r = el("rect", { x, y, width: Math.max(w, 0.5), height: ROW_H, fill: docColour(s.doc),
          stroke: "#fff", "stroke-width": 0.6, class: "shard", "data-rank": rank, "data-doc": s.doc }, svg);
        el("title", {}, r).textContent = `rank ${rank}: doc ${s.doc} [${s.start}, ${s.end}) · ${s.end - s.start} tokens`;
        const moved = sent[i][k];
        if (moved) {
          const sx = x + (moved[0] - s.start) * scale;
          const m = el("rect", { x: sx, y, width: Math.max((moved[1] - moved[0]) * scale, 0.5),
            height: ROW_H * 0.3, fill: "#c2185b", class: "sent" }, svg);
          el("title", {}, m).textContent = `KV of doc ${s.doc} [${moved[0]}, ${moved[1]}) sent to other ranks`;
        }
        if (w > 26 && !compact) {
          const label = el("text", { x: x + 3, y: y + ROW_H * 0.8, class: "doc-label" }, svg);
          label.textContent = `d${s.doc}`;
        }
        x += w;
      });
      if (group.padding[i] > 0) {
        const p = el("rect", { x, y, width: Math.max(group.padding[i] * scale, 0.5), height: ROW_H,
          fill: "url(#pad)", class: "pad" }, svg);
        el("title", {}, p).textContent = `${group.padding[i]} padding tokens`;
      }
      const load = group.rank_stats.workload[i] / maxLoad;
      el("rect", { x: width - LOAD_W, y: y + 4, width: Math.max(load * (LOAD_W - 8), 0.5),
        height: ROW_H - 8, fill: "#8696a7", class: "load" }, svg);
      y += ROW_H + ROW_GAP;
    });
    y += 10;
  }
  const defs = el("defs", {}, svg);
  const pat = el("pattern", { id: "pad", width: 6, height: 6, patternUnits: "userSpaceOnUse",
    patternTransform: "rotate(45)" }, defs);
  el("rect", { width: 6, height: 6, fill: "#eee" }, pat);
  el("rect", { width: 2, height: 6, fill: "#bbb" }, pat);
  const cap = el("text", { x: width - LOAD_W, y: height - 4 }, svg);
  cap.textContent = "attention load";
  return svg;
}

const METRICS = [
  ["imbalance", (m) => m.imbalance.toFixed(3)],
  ["comm mode", (m) => m.comm_mode],
  ["comm tokens", (m) => m.comm_tokens.toLocaleString()],
  ["full-exchange tokens", (m) => m.full_comm_tokens.toLocaleString()],
  ["comm saving", (m) => (100 * m.comm_saving).toFixed(1) + " %"],
  ["est. step (ms/layer)", (m) => m.est_step_ms.toFixed(3)],
  ["tokens per rank", (m) => m.tokens_per_rank.toLocaleString()],
  ["padding tokens", (m) => m.padding_tokens.toLocaleString()],
  ["shards", (m) => m.num_shards],
  ["split docs", (m) => m.num_split_docs],
];

function metricsTable(plan, solveMs) {
  const table = document.createElement("table");
  table.className = "metrics";
  const rows = METRICS.map(([name, f]) => [name, f(plan.metrics)]);
  rows.push(["solve (ms)", Number.isFinite(solveMs) ? solveMs.toFixed(2) : "–"]);
  rows.push(["docs", plan.doc_lengths.length]);
  rows.push(["plan_id", plan.plan_id.slice(0, 12)]);
  for (const [k, v] of rows) {
    const tr = table.insertRow();
    tr.insertCell().textContent = k;
    tr.insertCell().textContent = v;
  }
  return table;
}

function showPlan(plan, solveMs) {
  const card = document.createElement("div");
  card.className = "card";
  card.id = "plan-card";
  const h = document.createElement("h2");
  h.textContent = `${plan.strategy} · N = ${plan.cp_size} · ${plan.groups.length} group(s)`;
  const body = document.createElement("div");
  body.className = "plan-body";
  body.append(drawPlan(plan), metricsTable(plan, solveMs));
  card.append(h, body);
  $("plan-view").replaceChildren(card);
  $("compare-view").replaceChildren();
}

function solveMsOf(res) {
  const m = /dur=([0-9.]+)/.exec(res.headers.get("Server-Timing") || "");
  return m ? Number(m[1]) : NaN;
}

async function plan() {
  let body;
  try { body = request(); } catch (e) { status(e.message, true); return; }
  status("planning…");
  try {
    const { data, res } = await api("POST", "/v1/plan", body);
    showPlan(data, solveMsOf(res));
    status(`${data.strategy}: imbalance ${data.metrics.imbalance.toFixed(3)}, ` +
      `comm saving ${(100 * data.metrics.comm_saving).toFixed(1)} % (${data.doc_lengths.length} docs)`);
  } catch (e) { status(e.message, true); }
}

async function compare() {
  let body;
  try { body = request(); } catch (e) { status(e.message, true); return; }
  delete body.strategy;
  // Keep slow exact solvers (ilp) short and single-threaded in the side-by-side view.
  const opts = {};
  if (STRATEGY_OPTIONS.has("time_limit_s")) opts.time_limit_s = 2;
  if (STRATEGY_OPTIONS.has("workers")) opts.workers = 1;
  if (Object.keys(opts).length) body.options = opts;
  status("comparing…");
  try {
    const { data } = await api("POST", "/v1/compare", body);
    const best = Math.min(...data.results.map((r) => r.plan.metrics.est_step_ms));
    const table = document.createElement("table");
    table.className = "metrics compare";
    const head = table.createTHead().insertRow();
    for (const k of ["strategy", "imbalance", "comm saving", "est. step ms", "solve ms"]) {
      const th = document.createElement("th"); th.textContent = k; head.appendChild(th);
    }
    const grid = document.createElement("div");
    grid.className = "grid";
    for (const r of data.results) {
      const m = r.plan.metrics;
      const tr = table.insertRow();
      if (m.est_step_ms === best) tr.className = "best";
      for (const v of [r.strategy, m.imbalance.toFixed(3), (100 * m.comm_saving).toFixed(1) + " %",
        m.est_step_ms.toFixed(3), r.solve_ms.toFixed(2)]) tr.insertCell().textContent = v;
      const card = document.createElement("div");
      card.className = "card";
      const h = document.createElement("h2");
      h.textContent = `${r.strategy} · imbalance ${m.imbalance.toFixed(3)}`;
      card.append(h, drawPlan(r.plan, { compact: true }));
      grid.appendChild(card);
    }
    for (const [name, why] of Object.entries(data.errors)) {
      const tr = table.insertRow();
      tr.insertCell().textContent = name;
      const td = tr.insertCell(); td.colSpan = 4; td.textContent = why;
    }
    const summary = document.createElement("div");
    summary.className = "card";
    summary.id = "compare-card";
    const h = document.createElement("h2");
    h.textContent = `All strategies · N = ${body.cp_size} · ${body.doc_lengths.length} docs`;
    summary.append(h, table);
    $("plan-view").replaceChildren();
    $("compare-view").replaceChildren(summary, grid);
    status(`compared ${data.results.length} strategies (bold: lowest estimated step time)`);
  } catch (e) { status(e.message, true); }
}

async function sample() {
  const q = new URLSearchParams({ dataset: $("dataset").value, context_length: $("context").value,
    seed: $("seed").value });
  try {
    const { data } = await api("GET", "/v1/sample?" + q);
    $("lengths").value = data.doc_lengths.join(", ");
    await plan();
  } catch (e) { status(e.message, true); }
}

async function loadStrategies() {
  try {
    const { data } = await api("GET", "/v1/strategies");
    const select = $("strategy");
    select.replaceChildren();
    for (const s of data) {
      for (const name of Object.keys(s.options)) STRATEGY_OPTIONS.add(name);
      const o = document.createElement("option");
      o.value = o.textContent = s.name;
      o.title = s.description;
      if (s.name === "flashcp") o.selected = true;
      select.appendChild(o);
    }
  } catch (e) { /* keep the built-in flashcp option */ }
}

window.addEventListener("DOMContentLoaded", async () => {
  $("lengths").value = SAMPLE.join(", ");
  $("token").value = token();
  $("token").addEventListener("change", () => sessionStorage.setItem("planner-token", $("token").value));
  $("form").addEventListener("submit", (e) => { e.preventDefault(); plan(); });
  $("compare-btn").addEventListener("click", compare);
  $("sample").addEventListener("click", sample);
  await loadStrategies();
  await plan();
});
