// The loraplex console: the server's own API (with the user's key), no build step, no network
// beyond this server. Three views: adapters (and, with the admin key, load / unload), live
// numbers with a small chart, and a playground that streams several targets side by side.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { base: "", adapters: [], samples: [], last: null, previous: null, view: "adapters", runs: 0,
                page: { offset: 0, total: 0, search: "" } };
const PAGE_SIZE = 50;  // adapters per page of the table (a server may hold thousands)

for (const id of ["api-key", "admin-key"]) {  // kept for this browser only
  $(id).value = localStorage.getItem("loraplex:" + id) || "";
  $(id).addEventListener("input", () => { localStorage.setItem("loraplex:" + id, $(id).value); adminMode(); });
}

function adminMode() { document.body.classList.toggle("admin", $("admin-key").value.trim() !== ""); }

function headers(admin) {
  const key = (admin ? $("admin-key") : $("api-key")).value.trim() || $("api-key").value.trim();
  const h = { "Content-Type": "application/json" };
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

// The server's error body ({"error": {"message"}}) or its plain text, as is.
async function call(path, body, admin = false) {
  const resp = await fetch(path, { method: body === undefined ? "GET" : "POST", headers: headers(admin),
                                   body: body === undefined ? undefined : JSON.stringify(body) });
  const text = await resp.text();
  let data = text;
  try { data = JSON.parse(text); } catch (e) { /* plain text (load / unload say so) */ }
  if (!resp.ok) throw new Error(data && data.error ? data.error.message : `${resp.status} ${text}`);
  return data;
}

function showError(err) {
  $("error").hidden = !err;
  $("error").textContent = err ? String(err.message || err) : "";
}

// ---- views --------------------------------------------------------------------------------

for (const tab of document.querySelectorAll(".tab")) {
  tab.addEventListener("click", () => {
    state.view = tab.dataset.view;
    for (const t of document.querySelectorAll(".tab")) t.classList.toggle("active", t === tab);
    for (const v of document.querySelectorAll(".view")) v.hidden = v.id !== "view-" + state.view;
    if (state.view === "live") drawChart();
  });
}

// ---- adapters -----------------------------------------------------------------------------

// a field the server left out (a tenant reads nothing of where an adapter is, nor the engine's load): a dash
const NONE = '<span class="muted">—</span>';
const yes = (b) => (b === undefined ? NONE : `<span class="${b ? "yes" : "no"}">${b ? "yes" : "no"}</span>`);
const count = (v) => (v === undefined || v === null ? NONE : esc(v));
const esc = (s) => String(s).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));

async function refreshAdapters() {
  // with the admin key the table shows each adapter's folder too (folders are the admin's only)
  const admin = $("admin-key").value.trim() !== "";
  const query = new URLSearchParams({ limit: PAGE_SIZE, offset: state.page.offset, search: state.page.search });
  const [models, table] = await Promise.all([call("/v1/models"), call("/v1/adapters?" + query, undefined, admin)]);
  if (!table.data.length && state.page.offset > 0 && table.total > 0) {  // the page emptied (unloads): back one
    state.page.offset = Math.max(0, state.page.offset - PAGE_SIZE);
    return refreshAdapters();
  }
  state.page.total = table.total;
  $("page-info").textContent = table.total ? `${table.offset + 1}-${table.offset + table.data.length} of ${table.total}`
    : "none";
  $("page-prev").disabled = table.offset === 0;
  $("page-next").disabled = !table.has_more;
  const baseCard = models.data.find((m) => m.parent === null);  // absent for a tenant without the base model
  state.base = baseCard ? baseCard.id : (models.data.length ? models.data[0].parent : "");
  state.baseUsable = Boolean(baseCard);
  state.adapters = table.data;
  $("model-name").textContent = "on " + state.base;
  const rows = [`<tr class="base"><td><b>${esc(state.base)}</b> (base)</td><td>-</td><td>-</td><td>-</td><td>-</td>
    <td>-</td><td>-</td><td>-</td><td>-</td><td>-</td><td>${count(table.base.requests)}</td><td>${count(table.base.generation_tokens)}</td>
    <td class="admin-only"></td></tr>`];
  for (const a of table.data) {
    rows.push(`<tr data-name="${esc(a.id)}"><td>${esc(a.id)}</td><td>${a.rank}</td><td>${esc((a.kind || ["lora"]).join(", "))}</td>
      <td class="targets">${esc(a.target_modules.join(", "))}</td><td class="folder" title="${esc(a.path || "")}">${a.source && a.source !== "folder" ? esc(a.source) : a.path ? esc(a.path) : '<span class="muted">(admin only)</span>'}</td>
      <td>${yes(a.resident)}</td><td>${yes(a.in_memory)}</td><td>${count(a.tier)}</td>
      <td>${a.hits === undefined ? NONE : `${esc(a.hits)} / ${esc(a.misses)}`}</td><td>${count(a.pinned)}</td><td>${count(a.requests)}</td>
      <td>${count(a.generation_tokens)}</td><td class="admin-only"><button class="unload" data-name="${esc(a.id)}">Unload</button></td></tr>`);
  }
  const body = $("adapters-table").querySelector("tbody"), html = rows.join("");
  if (body.dataset.html !== html) {  // re-rendered only on change: a click mid-poll keeps its row
    body.innerHTML = html;
    body.dataset.html = html;
  }
  refreshTargets();
}

$("adapter-search").addEventListener("input", () => {
  state.page = { ...state.page, search: $("adapter-search").value, offset: 0 };
  tick(refreshAdapters);
});
$("page-prev").addEventListener("click", () => {
  state.page.offset = Math.max(0, state.page.offset - PAGE_SIZE);
  tick(refreshAdapters);
});
$("page-next").addEventListener("click", () => {
  state.page.offset += PAGE_SIZE;
  tick(refreshAdapters);
});

$("adapters-table").addEventListener("click", async (event) => {
  const name = event.target.dataset && event.target.dataset.name;
  if (!event.target.classList.contains("unload") || !name) return;
  await adminAction(() => call("/v1/unload_lora_adapter", { lora_name: name }, true));
});

$("load-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  await adminAction(() => call("/v1/load_lora_adapter",
                               { lora_name: $("load-name").value.trim(), lora_path: $("load-path").value.trim() }, true));
});

async function adminAction(action) {
  const status = $("admin-status");
  status.className = "muted";
  status.textContent = "working...";
  try {
    status.textContent = await action();  // the server's own words, refused or not
    await refreshAdapters();
  } catch (err) {
    status.className = "bad";
    status.textContent = err.message;
  }
}

// ---- live ---------------------------------------------------------------------------------

const fmt = (v, digits = 0) => (v === null || v === undefined ? "-" : Number(v).toFixed(digits));
const pct = (v) => (v === null || v === undefined ? "-" : fmt(100 * v, 1) + " %");

async function refreshLive() {
  const s = await call("/v1/stats");
  if (state.last) {
    const dt = s.time - state.last.time;
    const tps = dt > 0 ? (s.generation_tokens - state.last.generation_tokens) / dt : 0;
    state.samples.push({ t: s.time, tps });
    state.samples = state.samples.filter((p) => s.time - p.t <= 120);
    $("live-tps").textContent = fmt(tps, 1);
  }
  state.previous = state.last;
  state.last = s;
  $("live-running").textContent = s.num_requests_running;
  $("live-waiting").textContent = s.num_requests_waiting;
  const kv = s.kv_cache_usage_perc;  // the engine's, left out for a tenant: its card hidden
  $("live-kv").closest(".card").hidden = kv === undefined;
  $("live-kv").textContent = kv === undefined ? "—" : fmt(100 * kv, 1) + " %";
  $("live-ttft").textContent = `${fmt(s.ttft_ms.p50)} / ${fmt(s.ttft_ms.p99)}`;
  $("live-itl").textContent = `${fmt(s.itl_ms.p50)} / ${fmt(s.itl_ms.p99)}`;
  $("live-total").textContent = s.generation_tokens;
  const running = s.running_adapters || [];
  $("live-adapters").textContent = running.length ? running.join(", ") : "none";
  showSpec(s, state.previous);
  if (state.view === "live") drawChart();
}

// Speculative decoding: null without --speculative-config (cards hidden); a tenant's has only the adapters
// that are its alone (the engine-wide cards hidden, as the KV card is).
function showSpec(s, previous) {
  const spec = s.spec_decode;
  const totals = Boolean(spec) && spec.drafts !== undefined;
  for (const card of document.querySelectorAll(".card.spec")) card.hidden = !totals;
  const adapters = spec ? Object.entries(spec.by_adapter || {}) : [];
  $("live-spec-adapters").closest(".card").hidden = !adapters.length;
  $("live-spec-adapters").textContent = adapters.map(([name, a]) => `${name} ${pct(a.acceptance_rate)}`).join(", ");
  if (!totals) return;
  $("live-spec-rate").textContent = pct(spec.acceptance_rate);
  $("live-spec-length").textContent = fmt(spec.mean_acceptance_length, 2);
  const before = previous && previous.spec_decode;
  if (before && before.draft_tokens !== undefined) {
    const dt = s.time - previous.time;
    $("live-spec-tps").textContent = fmt(dt > 0 ? (spec.draft_tokens - before.draft_tokens) / dt : 0, 1);
  }
}

function drawChart() {
  const canvas = $("live-chart");
  const ctx = canvas.getContext("2d");
  const w = canvas.width, h = canvas.height, pad = 34;
  ctx.clearRect(0, 0, w, h);
  const pts = state.samples;
  const top = Math.max(10, ...pts.map((p) => p.tps)) * 1.15;
  ctx.strokeStyle = "#d8dde5"; ctx.fillStyle = "#6b7280"; ctx.font = "11px sans-serif";
  for (let i = 0; i <= 4; i++) {  // grid and its labels (tokens/s)
    const y = h - pad / 2 - (h - pad) * i / 4;
    ctx.beginPath(); ctx.moveTo(pad, y); ctx.lineTo(w - 6, y); ctx.stroke();
    ctx.fillText(String(Math.round(top * i / 4)), 2, y + 4);
  }
  if (pts.length < 2) return;
  const t0 = pts[pts.length - 1].t - 120;
  ctx.strokeStyle = "#2f6fde"; ctx.lineWidth = 2; ctx.beginPath();
  pts.forEach((p, i) => {
    const x = pad + (w - pad - 6) * (p.t - t0) / 120, y = h - pad / 2 - (h - pad) * p.tps / top;
    if (i === 0) ctx.moveTo(x, y); else ctx.lineTo(x, y);
  });
  ctx.stroke(); ctx.lineWidth = 1;
}

// ---- playground ---------------------------------------------------------------------------

function refreshTargets() {
  const box = $("targets");
  const checked = new Set([...box.querySelectorAll("input:checked")].map((i) => i.value));
  const names = [...(state.baseUsable ? [state.base] : []), ...state.adapters.map((a) => a.id)];
  if (box.dataset.names === names.join("\n")) return;  // unchanged: keep the boxes being clicked
  box.dataset.names = names.join("\n");
  if (!box.dataset.ready && state.baseUsable) checked.add(state.base);
  box.dataset.ready = "1";
  box.innerHTML = "<legend>Targets (side by side)</legend>" + names.map((n) =>
    `<label><input type="checkbox" value="${esc(n)}" ${checked.has(n) ? "checked" : ""}> ${esc(n)}</label>`).join("");
  for (const select of $("mix-rows").querySelectorAll("select")) fillAdapterSelect(select);
}

// The mix composer: rows of (adapter, weight), sent as `adapters` with the base model as `model`.
function fillAdapterSelect(select) {
  const chosen = select.value;
  select.innerHTML = state.adapters.map((a) => `<option value="${esc(a.id)}">${esc(a.id)}</option>`).join("");
  if (state.adapters.some((a) => a.id === chosen)) select.value = chosen;
}

$("mix-add").addEventListener("click", () => {
  const row = document.createElement("div");
  row.className = "mix-row";
  row.innerHTML = `<label>adapter <select class="mix-adapter"></select></label>
    <label>weight <input class="mix-weight" type="number" value="1" min="-4" max="4" step="0.1"></label>
    <button type="button" class="mix-remove">Remove</button>`;
  fillAdapterSelect(row.querySelector("select"));
  row.querySelector(".mix-remove").addEventListener("click", () => row.remove());
  $("mix-rows").appendChild(row);
});

function mixValue() {
  return [...$("mix-rows").querySelectorAll(".mix-row")].map((row) => ({
    name: row.querySelector(".mix-adapter").value, weight: Number(row.querySelector(".mix-weight").value) }));
}

// A target: a model name, or a mix of adapters on the base model.
function targetLabel(target) {
  return target.adapters ? "mix: " + target.adapters.map((a) => `${a.name} × ${a.weight}`).join(" + ") : target.model;
}

function schemaValue() {
  const text = $("schema").value.trim();
  return text ? JSON.parse(text) : null;
}

let schemaTimer = null;
$("schema").addEventListener("input", () => {  // checked as it is typed, with the server's own refusals
  clearTimeout(schemaTimer);
  schemaTimer = setTimeout(checkSchema, 400);
});

async function checkSchema() {
  const status = $("schema-status");
  let schema;
  try { schema = schemaValue(); } catch (err) {
    status.className = "bad"; status.textContent = "not JSON: " + err.message; return false;
  }
  if (schema === null) { status.className = "muted"; status.textContent = "No schema: free text."; return true; }
  try {
    const r = await call("/v1/validate_schema", { schema });
    status.className = "good";
    status.textContent = `Schema accepted (${r.backend}); outputs will match it.` +
      (r.unenforced_keywords.length ? " Not enforced: " + r.unenforced_keywords.join("; ") : "");
    return true;
  } catch (err) {
    status.className = "bad"; status.textContent = err.message; return false;
  }
}

function requestBody(target, schema) {
  const body = { model: target.model, messages: [{ role: "user", content: $("prompt").value }],
                 max_tokens: Number($("max-tokens").value), temperature: Number($("temperature").value), stream: true };
  if (target.adapters) body.adapters = target.adapters;
  if (schema) body.response_format = { type: "json_schema", json_schema: { name: "playground", schema } };
  return body;
}

function showSnippets(body) {
  const plain = { ...body, stream: false };
  $("snippet-curl").textContent = `curl ${location.origin}/v1/chat/completions -H 'Content-Type: application/json' ` +
    `-H 'Authorization: Bearer $LORAPLEX_API_KEY' -d '${JSON.stringify(plain).replace(/'/g, "'\\''")}'`;
  const args = Object.entries(plain).map(([k, v]) => `    ${k}=${JSON.stringify(v)
    .replace(/\btrue\b/g, "True").replace(/\bfalse\b/g, "False").replace(/\bnull\b/g, "None")},`).join("\n");
  $("snippet-python").textContent = `import openai\n\nclient = openai.OpenAI(base_url="${location.origin}/v1", ` +
    `api_key="...")\nreply = client.chat.completions.create(\n${args}\n)\nprint(reply.choices[0].message.content)`;
}

async function stream(target, schema, column, run) {
  const text = column.querySelector(".text"), meta = column.querySelector(".meta");
  const started = performance.now();
  let chunks = 0, finish = null;
  const resp = await fetch("/v1/chat/completions", { method: "POST", headers: headers(false),
                                                     body: JSON.stringify(requestBody(target, schema)) });
  if (!resp.ok) {
    const body = await resp.json().catch(() => ({}));
    throw new Error(body.error ? body.error.message : resp.statusText);
  }
  const reader = resp.body.getReader(), decoder = new TextDecoder();
  let pending = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done || run !== state.runs) break;
    pending += decoder.decode(value, { stream: true });
    const events = pending.split("\n\n");
    pending = events.pop();
    for (const event of events) {
      const data = event.replace(/^data: /, "").trim();
      if (!data || data === "[DONE]") continue;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      for (const choice of chunk.choices || []) {
        text.textContent += choice.delta.content || "";
        chunks += 1;
        finish = choice.finish_reason || finish;
      }
    }
  }
  meta.textContent = `${((performance.now() - started) / 1000).toFixed(1)} s, ${chunks} chunks, finish: ${finish || "-"}`;
  column.classList.add("done");
  if (schema) {  // shown parsed: the grammar made it valid JSON for the schema
    const parsed = column.querySelector(".parsed");
    try {
      parsed.textContent = JSON.stringify(JSON.parse(text.textContent), null, 2);
    } catch (err) {
      parsed.classList.add("bad"); parsed.textContent = "not parsed: " + err.message + (finish === "length" ? " (cut off by max tokens)" : "");
    }
  }
}

$("run").addEventListener("click", async () => {
  showError(null);
  if (!(await checkSchema())) return;
  const schema = schemaValue();
  const targets = [...$("targets").querySelectorAll("input:checked")].map((i) => ({ model: i.value }));
  const mix = mixValue();
  if (mix.length) targets.push({ model: state.base, adapters: mix });
  const run = ++state.runs;
  $("outputs").dataset.run = run;  // which run the columns belong to (scripts and tests wait on it)
  $("outputs").innerHTML = targets.map((t) => `<div class="column" data-model="${esc(targetLabel(t))}">
    <h3>${esc(targetLabel(t))}</h3><pre class="text"></pre>${schema ? '<pre class="parsed"></pre>' : ""}
    <div class="meta">streaming...</div></div>`).join("");
  if (targets.length) showSnippets({ ...requestBody(targets[targets.length - 1], schema) });
  await Promise.all(targets.map((t, i) => stream(t, schema, $("outputs").children[i], run).catch((err) => {
    const column = $("outputs").children[i];
    column.querySelector(".meta").textContent = "error: " + err.message;
    column.classList.add("done", "failed");
  })));
});

// ---- polling ------------------------------------------------------------------------------

async function tick(fn) {
  try { await fn(); showError(null); } catch (err) { showError(err); }
}

adminMode();
tick(refreshAdapters);
tick(refreshLive);
setInterval(() => tick(refreshLive), 1500);
setInterval(() => { if (state.view === "adapters") tick(refreshAdapters); }, 3000);
