// The dashboard: /stats, /health and /metrics every second, as numbers and the last two minutes of each.
"use strict";
const HISTORY = 120;
const CARDS = [
  ["tok_s", "output tokens/s"], ["running", "running requests"], ["waiting", "waiting requests"],
  ["kv_used", "KV blocks used"], ["kv_cached", "KV blocks in the prefix cache"], ["hit_rate", "prefix-cache hit rate"],
  ["step_ms", "mean step time (ms)"], ["batch", "mean rows per step"], ["ttft_p50", "TTFT p50 (ms)"],
  ["ttft_p90", "TTFT p90 (ms)"], ["tpot_p50", "TPOT p50 (ms)"], ["tpot_p90", "TPOT p90 (ms)"],
  ["agents", "live agents"], ["restarts", "agent restarts"], ["spec", "speculative acceptance rate"],
];
const series = Object.fromEntries(CARDS.map(([k]) => [k, []]));
let last = null;

for (const [key, title] of CARDS) {
  document.getElementById("cards").append(
    el("div", {class: "card", id: "card-" + key}, el("h3", {text: title}), el("div", {class: "value", id: "v-" + key, text: "-"}),
       el("canvas", {id: "c-" + key, width: "300", height: "70"})));
}

function draw(key) {
  const canvas = document.getElementById("c-" + key), ctx = canvas.getContext("2d"), data = series[key];
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  const values = data.filter((v) => v !== null && Number.isFinite(v));
  if (values.length < 2) return;
  const max = Math.max(...values, 1e-9), min = Math.min(0, ...values);
  ctx.strokeStyle = "#2f6fdb";
  ctx.lineWidth = 1.5;
  ctx.beginPath();
  data.forEach((v, i) => {
    if (v === null || !Number.isFinite(v)) return;
    const x = (i / (HISTORY - 1)) * canvas.width, y = canvas.height - 4 - ((v - min) / (max - min || 1)) * (canvas.height - 8);
    i ? ctx.lineTo(x, y) : ctx.moveTo(x, y);
  });
  ctx.stroke();
}

function show(key, value, digits = 0) {
  const text = value === null || value === undefined || !Number.isFinite(value) ? "-" : value.toFixed(digits);
  document.getElementById("v-" + key).textContent = text;
  series[key].push(value === undefined ? null : value);
  if (series[key].length > HISTORY) series[key].shift();
  draw(key);
}

// A histogram's quantile from Prometheus text (cumulative buckets), interpolated inside the bucket, in ms
function quantile(metrics, name, q) {
  const buckets = [];
  const re = new RegExp("^" + name + "_bucket\\{[^}]*le=\"([^\"]+)\"[^}]*\\}\\s+([0-9.e+-]+)", "gm");
  let m;
  while ((m = re.exec(metrics)) !== null) buckets.push([m[1] === "+Inf" ? Infinity : Number(m[1]), Number(m[2])]);
  if (!buckets.length) return null;
  buckets.sort((a, b) => a[0] - b[0]);
  const total = buckets[buckets.length - 1][1];
  if (!total) return null;
  let prevLe = 0, prevCount = 0;
  for (const [le, count] of buckets) {
    if (count >= q * total) {
      if (!Number.isFinite(le)) return prevLe * 1000;
      const inside = count - prevCount;
      return (prevLe + (le - prevLe) * (inside ? (q * total - prevCount) / inside : 0)) * 1000;
    }
    prevLe = le; prevCount = count;
  }
  return null;
}

async function poll() {
  try {
    const [stats, health, metrics, models] = await Promise.all([
      api("/stats").then((r) => r.json()), api("/health").then((r) => r.json()), api("/metrics").then((r) => r.text()),
      api("/v1/models").then((r) => r.json())]);
    // every model the server serves: its state, and a loaded one's memory (weights + KV cache); the cards below are
    // the default model's
    document.getElementById("models").textContent = "models: " + models.data.filter((m) => !m.parent).map((m) =>
      `${m.id} ${m.state || "loaded"}` + (m.size_bytes ? ` (${Math.round(m.size_bytes / 1048576)} MiB)` : "")
      + (m.id === health.model ? " [default]" : "")).join(" · ");
    const now = performance.now();
    const stepSeconds = Object.values(stats.step_time_s || {}).reduce((a, b) => a + b, 0);
    let rows = 0;
    for (const sizes of Object.values(stats.batch_sizes || {}))
      for (const [size, count] of Object.entries(sizes)) rows += Number(size) * count;
    if (last) {
      const dt = (now - last.t) / 1000, steps = stats.num_steps - last.steps;
      show("tok_s", (stats.num_generated_tokens - last.generated) / dt, 1);
      show("step_ms", steps > 0 ? (stepSeconds - last.stepSeconds) * 1000 / steps : null, 1);
      show("batch", steps > 0 ? (rows - last.rows) / steps : null, 1);
    }
    last = {t: now, generated: stats.num_generated_tokens, steps: stats.num_steps, stepSeconds, rows};
    show("running", stats.num_running);
    show("waiting", stats.num_waiting);
    show("kv_used", stats.num_blocks - stats.num_free_blocks);
    show("kv_cached", stats.num_cached_blocks);
    show("hit_rate", stats.prefix_cache_hit_rate, 3);
    show("ttft_p50", quantile(metrics, "llm_serving_time_to_first_token_seconds", 0.5), 0);
    show("ttft_p90", quantile(metrics, "llm_serving_time_to_first_token_seconds", 0.9), 0);
    show("tpot_p50", quantile(metrics, "llm_serving_time_per_output_token_seconds", 0.5), 1);
    show("tpot_p90", quantile(metrics, "llm_serving_time_per_output_token_seconds", 0.9), 1);
    show("agents", (health.agents || []).length);
    show("restarts", health.agent_restarts);
    show("spec", stats.speculative ? stats.speculative.acceptance_rate : null, 3);
    const state = document.getElementById("health");
    state.textContent = health.status === "ok" ? "healthy" : "unavailable: " + (health.reason || "");
    state.className = health.status === "ok" ? "" : "bad";
  } catch (err) {
    document.getElementById("health").textContent = "cannot reach the server: " + err.message;
  }
}

poll();
setInterval(poll, 1000);
