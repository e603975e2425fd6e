// ExpressLane playground: streams /v1/chat/completions or /v1/completions over fetch + SSE.
// Live tokens/s is computed in the browser as chunks arrive (each chunk carries the server's
// running `completion_tokens`); the server's own figures (`timings`) replace it at the end.
// With speculative decoding every chunk also carries the drafted / kept figures so far.
// Stop aborts the fetch: the server sees the disconnect and stops decoding within one step.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { mode: "chat", history: [], controller: null, model: null, speed: null };

// ---------------------------------------------------------------- server info
function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api_key").value.trim();
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

async function loadModel() {
  try {
    const health = await fetch("/health");
    $("health-dot").classList.toggle("ok", health.ok);
    if (!health.ok) {
      $("model-name").textContent = "loading model…";
      setTimeout(loadModel, 1000);
      return;
    }
    const r = await fetch("/v1/models", { headers: headers() });
    const j = await r.json();
    if (!r.ok) { $("model-name").textContent = j.error ? j.error.message : "error"; return; }
    state.model = j.data[0].id;
    $("model-name").textContent = `${state.model} · context ${j.data[0].max_model_len} tokens`;
  } catch (e) {
    $("model-name").textContent = "server unreachable";
    setTimeout(loadModel, 2000);
  }
}

function unescape(s) {  // lets "\n" typed in the stop field mean a newline
  try { return JSON.parse(`"${s.replace(/"/g, '\\"')}"`); } catch (e) { return s; }
}

function requestBody() {
  const num = (id) => ($(id).value === "" ? undefined : Number($(id).value));
  const body = {
    model: state.model || undefined, max_tokens: num("max_tokens"), temperature: num("temperature"),
    top_p: num("top_p"), top_k: num("top_k"), min_p: num("min_p"), seed: num("seed"),
    stream: true, stream_options: { include_usage: true },
  };
  const stops = $("stop_strings").value.split(",").map((s) => s.trim()).filter(Boolean);
  if (stops.length) body.stop = stops.map(unescape);
  return body;
}

// ---------------------------------------------------------------- rendering
const TOKEN_RE = new RegExp([
  /(#[^\n]*|\/\/[^\n]*)/.source,  // comments
  /("""[\s\S]*?"""|'''[\s\S]*?'''|"(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*')/.source,  // strings
  /\b(def|class|return|if|elif|else|for|while|in|import|from|as|with|try|except|finally|raise|yield|lambda|None|True|False|and|or|not|is|pass|break|continue|async|await|function|const|let|var|new|fn|pub|struct|impl|use)\b/.source,
  /\b(\d+(?:\.\d+)?)\b/.source,  // numbers
].join("|"), "g");

function esc(s) {
  return s.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
}

function highlight(code) {
  let out = "", last = 0, m;
  TOKEN_RE.lastIndex = 0;
  while ((m = TOKEN_RE.exec(code)) !== null) {
    if (m[0] === "") { TOKEN_RE.lastIndex++; continue; }
    const cls = m[1] ? "com" : m[2] ? "str" : m[3] ? "kw" : "num";
    out += esc(code.slice(last, m.index)) + `<span class="${cls}">${esc(m[0])}</span>`;
    last = m.index + m[0].length;
  }
  return out + esc(code.slice(last));
}

// Prose with `inline code`, and ``` fenced blocks shown as code with a copy button. An odd
// number of fences means a block is still streaming: it is shown as code already.
function renderText(text) {
  return text.split("```").map((part, i) => {
    if (i % 2 === 0) {
      return esc(part).replace(/`([^`\n]+)`/g, "<code>$1</code>");
    }
    const nl = part.indexOf("\n");
    const lang = nl >= 0 ? part.slice(0, nl).trim() : "";
    const code = nl >= 0 ? part.slice(nl + 1).replace(/\n$/, "") : part;
    return `<div class="code"><div class="code-head"><span>${esc(lang || "code")}</span>` +
      `<button class="copy" type="button">Copy</button></div>` +
      `<pre><code>${highlight(code)}</code></pre></div>`;
  }).join("");
}

document.addEventListener("click", async (ev) => {
  const btn = ev.target.closest(".copy");
  if (!btn) return;
  const text = btn.closest(".code").querySelector("code").textContent;
  try {
    await navigator.clipboard.writeText(text);
  } catch (e) {  // no clipboard API (insecure context): the old way
    const ta = Object.assign(document.createElement("textarea"), { value: text });
    document.body.append(ta); ta.select(); document.execCommand("copy"); ta.remove();
  }
  btn.textContent = "Copied"; setTimeout(() => { btn.textContent = "Copy"; }, 1200);
});

function bubble(role, text) {
  const div = document.createElement("div");
  div.className = `message ${role}`;
  div.innerHTML = renderText(text);
  $("messages").append(div);
  return div;
}

// ---------------------------------------------------------------- speed: live figure + chart
class Speed {
  constructor() { this.first = null; this.points = []; this.total = 0; this.final = null; }

  update(total) {  // total: completion tokens so far, as the server counts them
    const now = performance.now() / 1000;
    if (total <= 0) return;  // the clock starts at the first token, not at the role chunk
    if (this.first === null) { this.first = { t: now, n: total }; }
    this.total = total;
    this.points.push({ t: now - this.first.t, n: total });
  }

  live() {  // tokens after the first one / time since the first one arrived
    const last = this.points[this.points.length - 1];
    return last && last.t > 0 ? (last.n - this.first.n) / last.t : null;
  }

  series() {  // speed over the response: tokens/s over a sliding window of ~0.25 s
    const out = [];
    for (let i = 1, j = 0; i < this.points.length; i++) {
      const p = this.points[i];
      while (j < i - 1 && p.t - this.points[j].t > 0.25) j++;
      const q = this.points[j];
      if (p.t - q.t >= 0.05) out.push({ t: p.t, v: (p.n - q.n) / (p.t - q.t) });  // no bursts
    }
    return out;
  }
}

function drawChart(speed) {
  const c = $("chart"), ctx = c.getContext("2d");
  const w = (c.width = c.clientWidth * devicePixelRatio), h = (c.height = c.clientHeight * devicePixelRatio);
  ctx.clearRect(0, 0, w, h);
  const pts = speed ? speed.series() : [];
  const ref = speed && speed.final;
  const vmax = Math.max(1, ...pts.map((p) => p.v), ref || 0) * 1.15;
  const tmax = Math.max(0.5, ...pts.map((p) => p.t));
  const pad = 6 * devicePixelRatio, X = (t) => pad + (t / tmax) * (w - 2 * pad);
  const Y = (v) => h - pad - (v / vmax) * (h - 2 * pad);
  ctx.font = `${10 * devicePixelRatio}px system-ui`;
  ctx.fillStyle = "#8a93a6";
  ctx.fillText(`${Math.round(vmax)} tok/s`, pad, pad + 10 * devicePixelRatio);
  ctx.fillText(`${tmax.toFixed(1)} s`, w - pad - 30 * devicePixelRatio, h - pad);
  if (ref) {  // the server's decode figure, dashed
    ctx.strokeStyle = "#5fd38d"; ctx.setLineDash([4, 4]); ctx.beginPath();
    ctx.moveTo(pad, Y(ref)); ctx.lineTo(w - pad, Y(ref)); ctx.stroke(); ctx.setLineDash([]);
  }
  if (pts.length < 2) return;
  ctx.strokeStyle = "#4fb3ff"; ctx.lineWidth = 1.5 * devicePixelRatio; ctx.beginPath();
  pts.forEach((p, i) => (i ? ctx.lineTo(X(p.t), Y(p.v)) : ctx.moveTo(X(p.t), Y(p.v))));
  ctx.stroke();
}

function specText(s) {  // "3.2 per verify · 74% of 230" (drafts kept per verify step, rate)
  if (!s || !s.verify_steps) return s ? "no drafts yet" : "";
  const rate = s.draft_tokens ? Math.round((100 * s.accepted_tokens) / s.draft_tokens) : 0;
  return `${s.mean_accepted_per_verify.toFixed(1)} per verify · ${rate}% of ${s.draft_tokens}`;
}

function showFigures(t) {
  const fmt = (v, unit, digits = 1) => (v == null ? "–" : `${Number(v).toFixed(digits)} ${unit}`);
  $("srv-ttft").textContent = fmt(t && t.ttft_ms, "ms");
  $("srv-tps").textContent = fmt(t && t.decode_tokens_per_s, "tok/s");
  $("srv-spec").textContent = (t && specText(t.speculative)) || "–";
  $("srv-tokens").textContent = t ? String(t.completion_tokens) : "–";
  $("srv-prompt").textContent = t ? String(t.prompt_tokens) : "–";
  $("srv-e2e").textContent = fmt(t && t.e2e_ms, "ms", 0);
}

let frame = 0, pending = null;
// A thinking model's reasoning (`serve --reasoning-parser`), shown dimmed above its answer.
function thinking(thought) {
  return thought ? `<div class="thinking">${esc(thought)}</div>` : "";
}

function refresh(target, text, thought = () => "") {  // one repaint per frame, the latest wins
  pending = { target, text, thought };
  if (frame) return;
  frame = requestAnimationFrame(() => {
    frame = 0;
    const { target, text, thought } = pending;
    target.node.innerHTML = target.prefix + thinking(thought()) + renderText(text());
    target.node.classList.toggle("cursor", !!state.controller);
    const live = state.speed && state.speed.live();
    $("live-tps").textContent = live == null ? "–" : live.toFixed(1);
    drawChart(state.speed);
  });
}

// ---------------------------------------------------------------- one request
async function* events(response) {  // the `data:` payloads of a server-sent event stream
  const reader = response.body.getReader(), decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += decoder.decode(value, { stream: true });
    let i;
    while ((i = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, i); buf = buf.slice(i + 2);
      for (const line of block.split("\n")) if (line.startsWith("data: ")) yield line.slice(6);
    }
  }
}

async function run(path, body, target) {
  state.controller = new AbortController();
  state.speed = new Speed();
  $("send").disabled = true; $("stop").disabled = false; $("status").textContent = "waiting…";
  showFigures(null); $("live-tps").textContent = "–"; $("live-spec").textContent = "";
  let text = "", thought = "", chunks = 0;
  const paint = () => refresh(target, () => text, () => thought);
  try {
    const r = await fetch(path, { method: "POST", headers: headers(), body: JSON.stringify(body),
      signal: state.controller.signal });
    if (!r.ok) {
      const j = await r.json().catch(() => ({}));
      throw new Error(j.error ? `${r.status}: ${j.error.message}` : `HTTP ${r.status}`);
    }
    $("status").textContent = "generating…";
    for await (const data of events(r)) {
      if (data === "[DONE]") break;
      const j = JSON.parse(data);
      if (j.error) throw new Error(j.error.message);
      for (const c of j.choices || []) {
        text += c.delta ? c.delta.content || "" : c.text || "";
        thought += (c.delta && c.delta.reasoning_content) || "";
      }
      chunks += 1;
      state.speed.update(j.completion_tokens != null ? j.completion_tokens : chunks);
      if (j.speculative) $("live-spec").textContent = "drafts kept: " + specText(j.speculative);
      if (j.timings) {
        state.speed.final = j.timings.decode_tokens_per_s;
        showFigures(j.timings);
      }
      paint();
    }
    $("status").textContent = "done";
  } catch (e) {
    $("status").textContent = e.name === "AbortError" ? "stopped" : "error";
    if (e.name !== "AbortError") target.error = e.message;
  } finally {
    state.controller = null;
    $("send").disabled = false; $("stop").disabled = true;
    refresh(target, () => text + (target.error ? `\n[${target.error}]` : ""), () => thought);
  }
  return text;
}

async function send() {
  const prompt = $("prompt").value;
  if (!prompt.trim() || state.controller) return;
  if (state.mode === "chat") {
    bubble("user", prompt);
    state.history.push({ role: "user", content: prompt });
    $("prompt").value = "";
    const target = { node: bubble("assistant", ""), prefix: "" };
    const reply = await run("/v1/chat/completions", { ...requestBody(), messages: state.history },
      target);
    state.history.push({ role: "assistant", content: reply });
  } else {
    const target = { node: $("output"), prefix: `<span class="prompt-echo">${esc(prompt)}</span>` };
    await run("/v1/completions", { ...requestBody(), prompt }, target);
  }
  $("messages").scrollTop = $("messages").scrollHeight;
}

// ---------------------------------------------------------------- wiring
$("composer").addEventListener("submit", (e) => { e.preventDefault(); send(); });
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) { e.preventDefault(); send(); }
});
$("stop").addEventListener("click", () => state.controller && state.controller.abort());
$("clear").addEventListener("click", () => {
  state.history = []; $("messages").innerHTML = ""; $("output").innerHTML = "";
  showFigures(null); state.speed = null; drawChart(null); $("live-tps").textContent = "–";
});
document.querySelectorAll(".tab").forEach((tab) => tab.addEventListener("click", () => {
  state.mode = tab.dataset.mode;
  document.querySelectorAll(".tab").forEach((t) => t.classList.toggle("active", t === tab));
  $("chat-pane").classList.toggle("hidden", state.mode !== "chat");
  $("complete-pane").classList.toggle("hidden", state.mode !== "complete");
}));
for (const id of ["max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop_strings", "api_key"]) {
  const saved = localStorage.getItem("el." + id);
  if (saved !== null) $(id).value = saved;
  $(id).addEventListener("change", () => localStorage.setItem("el." + id, $(id).value));
}
$("api_key").addEventListener("change", loadModel);
loadModel();
drawChart(null);
