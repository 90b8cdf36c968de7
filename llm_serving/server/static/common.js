// Shared by the playground and the dashboard: API calls with the key kept for this tab only.
"use strict";
const KEY_STORE = "llm-serving-api-key";

async function api(path, options = {}) {
  const headers = Object.assign({}, options.headers || {});
  const key = sessionStorage.getItem(KEY_STORE);
  if (key) headers["Authorization"] = "Bearer " + key;
  const response = await fetch(path, Object.assign({}, options, {headers}));
  if (response.status === 401) {
    const given = window.prompt("This server needs its API key (kept for this tab only):");
    if (given) {
      sessionStorage.setItem(KEY_STORE, given.trim());
      return api(path, options);
    }
  }
  return response;
}

// Server-sent events of a streaming response: calls onEvent(parsed JSON) per `data:` line until [DONE].
async function readEvents(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, {stream: true});
    let cut;
    while ((cut = buffer.indexOf("\n")) >= 0) {
      const line = buffer.slice(0, cut).trim();
      buffer = buffer.slice(cut + 1);
      if (!line.startsWith("data:")) continue;
      const data = line.slice(5).trim();
      if (data === "[DONE]") return;
      onEvent(JSON.parse(data));
    }
  }
}

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "text") node.textContent = v; else node.setAttribute(k, v);
  }
  for (const child of children) node.append(child);
  return node;
}
