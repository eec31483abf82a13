// The shimmer dashboard: a streaming chat over /v1/chat/completions and live panels fed by
// /api/dashboard/events (docs/api.md). No dependencies.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { model: null, messages: [], key: localStorage.getItem("shimmer-api-key") || "", abort: null };

function headers() {
  const h = { "content-type": "application/json" };
  if (state.key) h["authorization"] = "Bearer " + state.key;
  return h;
}

// Asks for a key when the server wants one, then retries.
async function authed(url, init) {
  let r = await fetch(url, { ...init, headers: headers() });
  if (r.status === 401) {
    const k = prompt("This server needs an API key:");
    if (k) {
      state.key = k;
      localStorage.setItem("shimmer-api-key", k);
      r = await fetch(url, { ...init, headers: headers() });
    }
  }
  return r;
}

// --- Markdown (a small, safe subset: escape first, then code, emphasis, headings, lists) ---
function escapeHtml(s) {
  return s.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;").replace(/"/g, "&quot;");
}
function inline(s) {
  return s
    .replace(/`([^`]+)`/g, "<code>$1</code>")
    .replace(/\*\*([^*]+)\*\*/g, "<strong>$1</strong>")
    .replace(/\*([^*]+)\*/g, "<em>$1</em>");
}
function markdown(src) {
  const out = [];
  const parts = escapeHtml(src).split(/```/);
  parts.forEach((part, i) => {
    if (i % 2 === 1) {
      out.push("<pre><code>" + part.replace(/^[a-z0-9]*\n/i, "") + "</code></pre>");
      return;
    }
    let list = null;
    for (const line of part.split("\n")) {
      const h = line.match(/^(#{1,3}) (.*)$/);
      const li = line.match(/^\s*(?:[-*]|\d+\.) (.*)$/);
      if (li) {
        if (!list) { list = []; }
        list.push("<li>" + inline(li[1]) + "</li>");
        continue;
      }
      if (list) { out.push("<ul>" + list.join("") + "</ul>"); list = null; }
      if (h) out.push("<h" + (h[1].length + 2) + ">" + inline(h[2]) + "</h" + (h[1].length + 2) + ">");
      else if (line.trim()) out.push("<p>" + inline(line) + "</p>");
    }
    if (list) out.push("<ul>" + list.join("") + "</ul>");
  });
  return out.join("");
}

// --- Chat ---
function bubble(role, text) {
  const d = document.createElement("div");
  d.className = "msg " + role;
  d.innerHTML = markdown(text);
  $("messages").appendChild(d);
  $("messages").scrollTop = $("messages").scrollHeight;
  return d;
}

async function send(text) {
  state.messages.push({ role: "user", content: text });
  bubble("user", text);
  const out = bubble("assistant", "");
  out.dataset.streaming = "1";
  let reply = "";
  const ctrl = new AbortController();
  state.abort = ctrl;
  $("send").disabled = true;
  $("stop").disabled = false;
  try {
    const r = await authed("/v1/chat/completions", {
      method: "POST",
      signal: ctrl.signal,
      body: JSON.stringify({ model: state.model, messages: state.messages, stream: true, max_tokens: 256, temperature: 0.7, top_p: 0.9 }),
    });
    if (!r.ok) {
      const e = await r.json().catch(() => ({}));
      throw new Error((e.error && e.error.message) || ("HTTP " + r.status));
    }
    for await (const data of sse(r)) {
      if (data === "[DONE]") break;
      const v = JSON.parse(data);
      if (v.error) throw new Error(v.error.message);
      const piece = v.choices && v.choices[0] && v.choices[0].delta && v.choices[0].delta.content;
      if (piece) {
        reply += piece;
        out.innerHTML = markdown(reply);
        $("messages").scrollTop = $("messages").scrollHeight;
      }
    }
    state.messages.push({ role: "assistant", content: reply });
  } catch (e) {
    if (e.name === "AbortError") {
      state.messages.push({ role: "assistant", content: reply });
    } else {
      state.messages.pop();
      out.className = "msg error";
      out.textContent = "error: " + e.message;
    }
  } finally {
    delete out.dataset.streaming;
    out.dataset.done = "1";
    state.abort = null;
    $("send").disabled = false;
    $("stop").disabled = true;
  }
}

// Server-sent events from a fetch response: yields each `data:` payload.
async function* sse(response) {
  const reader = response.body.getReader();
  const dec = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += dec.decode(value, { stream: true });
    let at;
    while ((at = buf.indexOf("\n\n")) >= 0) {
      const event = buf.slice(0, at);
      buf = buf.slice(at + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart()).join("\n");
      if (data) yield data;
    }
  }
}

// --- Panels ---
const PHASES = [
  ["attention_ms", "attention", "#7aa2f7"],
  ["router_ms", "router", "#bb9af7"],
  ["expert_compute_ms", "expert compute", "#9ece6a"],
  ["expert_io_wait_ms", "expert I/O wait", "#ff9e64"],
  ["sampling_ms", "sampling", "#e0af68"],
  ["other_ms", "other", "#565f89"],
];
const TIERS = [
  ["vram_bytes", "VRAM", "#bb9af7"],
  ["ram_bytes", "RAM", "#2ac3de"],
  ["disk_bytes", "disk", "#ff9e64"],
  ["remote_bytes", "remote", "#9ece6a"],
];
// On a cluster the Brain colours each expert by the worker that first serves it (the cluster
// table's swatches match).
const NODE_RGB = [[122, 162, 247], [158, 206, 106], [255, 158, 100], [187, 154, 247], [42, 195, 222], [247, 118, 142], [224, 175, 104], [115, 218, 202]];
const TIER_RGB = { vram: [187, 154, 247], ram: [42, 195, 222], disk: [255, 158, 100], remote: [158, 206, 106] };

function fmtBytes(n) {
  const u = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1000 && i < u.length - 1) { n /= 1000; i++; }
  return n.toFixed(i ? 1 : 0) + " " + u[i];
}

function stackedBar(el, legend, items, values, fmt) {
  const total = items.reduce((s, [k]) => s + (values[k] || 0), 0);
  el.innerHTML = items.map(([k, , c]) => `<span style="width:${total ? (100 * (values[k] || 0)) / total : 0}%;background:${c}"></span>`).join("");
  legend.innerHTML = items.map(([k, name, c]) => `<span><i style="background:${c}"></i>${name} ${fmt(values[k] || 0)}</span>`).join("");
}

function drawBrain(s) {
  const cv = $("brain");
  const rows = s.moe_layers.length, cols = s.experts;
  if (!rows || !cols) return;
  const cell = Math.max(2, Math.floor(Math.min(cv.clientWidth / cols, 18)));
  cv.width = cols * cell;
  cv.height = rows * cell;
  const g = cv.getContext("2d");
  g.clearRect(0, 0, cv.width, cv.height);
  for (let r = 0; r < rows; r++) {
    for (let e = 0; e < cols; e++) {
      const i = r * cols + e;
      const [cr, cg, cb] = s.node.length ? NODE_RGB[s.node[i] % NODE_RGB.length] || TIER_RGB.remote : TIER_RGB[s.tier[i]] || TIER_RGB.ram;
      const b = 0.12 + 0.88 * Math.sqrt(s.heat[i] || 0);
      g.fillStyle = s.routed[i] ? "#ffffff" : `rgb(${Math.round(cr * b)},${Math.round(cg * b)},${Math.round(cb * b)})`;
      g.fillRect(e * cell, r * cell, cell - 1, cell - 1);
    }
  }
}

// The cluster view: one row per worker (hidden on a single box).
function renderCluster(c) {
  const panel = $("cluster-panel");
  panel.hidden = !c;
  if (!c) return;
  const tokens = Math.max(1, c.tokens);
  const bytes = c.workers.reduce((s, w) => s + w.bytes_sent + w.bytes_received, 0);
  $("cluster-facts").textContent = `per token: ${(c.round_trips / tokens).toFixed(1)} round trips, ${fmtBytes(bytes / tokens)}, ${((1000 * c.network_wait_s) / tokens).toFixed(2)} ms network wait · ${c.failovers} failovers · placement epoch ${c.placement_epoch}`;
  const ms = (v) => (v == null ? "–" : v.toFixed(2) + " ms");
  $("cluster").tBodies[0].innerHTML = c.workers
    .map((w, i) => `<tr class="${w.up ? "up" : "down"}" data-worker="${escapeHtml(w.name)}"><td><i class="swatch" style="background:rgb(${NODE_RGB[i % NODE_RGB.length].join(",")})"></i>${escapeHtml(w.name)}</td><td>${w.up ? "up" : "down"}</td><td>${w.placed_experts} (${w.first_choice_experts})</td><td>${w.status ? w.status.resident_experts : "–"}</td><td>${w.selections}</td><td>${ms(w.path_rtt_ms)}</td><td>${ms(w.requests ? (1000 * w.rtt_sum_s) / w.requests : null)}</td><td>${fmtBytes((w.bytes_sent + w.bytes_received) / tokens)}</td></tr>`)
    .join("");
}

// The control plane as this member coordinator applied it (hidden unless it is a member).
function renderRaft(c) {
  const panel = $("raft-panel");
  panel.hidden = !c;
  if (!c) return;
  const epochs = c.placements
    .map((p) => `placement epoch ${p.epoch}` + (p.previous != null ? ` (epoch ${p.previous} still answered)` : "") + (p.proposed != null ? ` (epoch ${p.proposed} proposed, ${p.ready} ready)` : ""))
    .join(" · ");
  $("raft-facts").textContent = `leader ${c.leader ?? "none"} · term ${c.term} · commit ${c.commit} · ${epochs || "no placement yet"}`;
  $("raft").tBodies[0].innerHTML = c.members
    .map((m) => {
      const role = m.name === c.leader ? `${m.role} (leader)` : m.role;
      const state = m.draining ? "draining" : m.up == null ? "" : m.up ? "up" : "down";
      return `<tr data-member="${escapeHtml(m.name)}"><td>${escapeHtml(m.name)}</td><td>${escapeHtml(m.kind)}</td><td>${escapeHtml(role)}</td><td>${state}</td></tr>`;
    })
    .join("");
}

function render(s) {
  $("model").textContent = s.model;
  $("toks").textContent = s.tok_s.toFixed(1);
  $("ttft").textContent = s.ttft_ms == null ? "–" : s.ttft_ms.toFixed(0) + " ms";
  $("running").textContent = s.running;
  $("waiting").textContent = s.waiting;
  if (s.last_turn) {
    const t = s.last_turn;
    // On a cluster the experts' wait is for the workers' answers.
    const phases = s.cluster ? PHASES.map((p) => (p[0] === "expert_io_wait_ms" ? [p[0], "network wait", p[2]] : p)) : PHASES;
    stackedBar($("breakdown"), $("breakdown-legend"), phases, t.breakdown, (v) => v.toFixed(1) + " ms");
    $("turn-facts").textContent = `${t.prompt_tokens} prompt + ${t.completion_tokens} generated tokens · TTFT ${t.ttft_ms.toFixed(0)} ms · ${t.decode_tok_s.toFixed(1)} tok/s decode`;
  }
  stackedBar($("tiers"), $("tiers-legend"), TIERS, s.tiers, fmtBytes);
  renderCluster(s.cluster);
  renderRaft(s.control);
  drawBrain(s);
}

async function follow() {
  for (;;) {
    try {
      const r = await authed("/api/dashboard/events", {});
      if (!r.ok) throw new Error("HTTP " + r.status);
      $("status").textContent = "";
      for await (const data of sse(r)) render(JSON.parse(data));
    } catch (e) {
      $("status").textContent = "reconnecting…";
    }
    await new Promise((ok) => setTimeout(ok, 1000));
  }
}

async function start() {
  const r = await authed("/v1/models", {});
  const v = await r.json();
  state.model = v.data[0].id;
  $("model").textContent = state.model;
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("input").value.trim();
    if (!text || state.abort) return;
    $("input").value = "";
    send(text);
  });
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) {
      e.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => state.abort && state.abort.abort());
  $("reset").addEventListener("click", () => {
    state.messages = [];
    $("messages").innerHTML = "";
  });
  follow();
}

start().catch((e) => { $("status").textContent = "cannot reach the server: " + e.message; });
