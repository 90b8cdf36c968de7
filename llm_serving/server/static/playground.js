// The playground: chat (or plain completion) with the served model through the server's OpenAI routes, streamed.
"use strict";
const $ = (id) => document.getElementById(id);
let messages = [];          // the conversation: [{role, content}] (assistant turns with tool_calls, tool results)
let controller = null;      // the request in flight (stop aborts it: the server frees its blocks)
const contextOf = {};       // model id -> its tokens per request (prompt + reply), from /v1/models
const takesImages = {};     // model id -> whether its prompts take images (/v1/models' input_modalities)
let attached = [];          // the images for the next user turn, as data: URLs

// Markdown, safely: the model's text only ever becomes text nodes (code fences -> <pre><code>, lists, headings,
// `code`, **bold**)
function renderMarkdown(container, text) {
  container.replaceChildren();
  const parts = text.split("```");
  parts.forEach((part, i) => {
    if (i % 2 === 1) {
      const newline = part.indexOf("\n");
      const body = newline >= 0 ? part.slice(newline + 1) : part;
      container.append(el("pre", {}, el("code", {text: body})));
      return;
    }
    let list = null;                        // the <ul>/<ol> that consecutive item lines go into
    for (const line of part.split("\n")) {
      const item = /^\s*(?:([-*+])|(\d+)[.)])\s+(.*)$/.exec(line), heading = /^(#{1,6})\s+(.*)$/.exec(line);
      if (item) {
        const tag = item[1] ? "ul" : "ol";
        if (!list || list.tagName.toLowerCase() !== tag) container.append(list = el(tag));
        list.append(inline(el("li"), item[3]));
        continue;
      }
      list = null;
      if (heading) container.append(inline(el("h" + Math.min(heading[1].length + 2, 6)), heading[2]));
      else if (line.trim()) container.append(inline(el("p"), line));
    }
  });
}

// `code` and **bold** inside a line, the rest as text nodes
function inline(node, text) {
  for (const piece of text.split(/(`[^`\n]+`|\*\*[^*\n]+\*\*)/)) {
    if (piece.startsWith("`") && piece.endsWith("`") && piece.length > 1) node.append(el("code", {text: piece.slice(1, -1)}));
    else if (piece.startsWith("**") && piece.endsWith("**") && piece.length > 3) node.append(el("strong", {text: piece.slice(2, -2)}));
    else if (piece) node.append(document.createTextNode(piece));
  }
  return node;
}

function bubble(role, text, images = []) {
  const body = el("div", {class: "body"});
  const node = el("div", {class: "msg " + role}, body);
  if (images.length) node.prepend(el("div", {class: "thumbs"}, ...images.map((src) => el("img", {src}))));
  renderMarkdown(body, text);
  $("log").append(node);
  $("log").scrollTop = $("log").scrollHeight;
  return node;
}

async function loadModels() {
  const response = await api("/v1/models");
  const data = (await response.json()).data || [];
  for (const m of data) {
    contextOf[m.id] = m.max_model_len;
    takesImages[m.id] = (m.input_modalities || []).includes("image");
  }
  // (a model not loaded yet loads when it is first asked: its state is shown)
  $("model").replaceChildren(...data.map((m) => el("option", {value: m.id, text: m.parent ? `${m.id} (adapter of ${m.parent})`
    : m.state && m.state !== "loaded" ? `${m.id} (${m.state})` : m.id})));
  showAttach();
}

function settings() {
  const body = {model: $("model").value, stream: true, temperature: Number($("temperature").value),
                top_p: Number($("top_p").value), max_tokens: Number($("max_tokens").value),
                stream_options: {include_usage: true}};
  const stop = $("stop").value.split("\n").filter((s) => s.length);
  if (stop.length) body.stop = stop;
  if ($("seed").value !== "") body.seed = Number($("seed").value);
  const format = $("format").value;
  if (format === "json_object") body.response_format = {type: "json_object"};
  if (format === "json_schema") {
    body.response_format = {type: "json_schema", json_schema: {name: "playground", schema: parseJson($("schema").value, "JSON schema")}};
  }
  if ($("tools").value.trim() && !$("completion").checked) {
    body.tools = parseJson($("tools").value, "tools");
    body.tool_choice = $("tool_choice").value;
    body.parallel_tool_calls = false;         // one call a turn: the next message is its result
  }
  if ($("template_kwargs").value.trim() && !$("completion").checked) {    // e.g. Qwen3's thinking switch
    body.chat_template_kwargs = parseJson($("template_kwargs").value, "chat template variables");
  }
  return body;
}

function parseJson(text, what) {
  try {
    return JSON.parse(text);
  } catch (err) {
    throw new Error(`${what} is not valid JSON: ${err.message}`);
  }
}

// A tool call as the reply shows it: name(arguments)
function toolCallNode(call) {
  return el("div", {class: "tool-call"}, el("code", {text: `${call.function.name}(${call.function.arguments})`}));
}

function lastToolCall() {
  const last = messages[messages.length - 1];
  return last && last.tool_calls ? last.tool_calls[0] : null;
}

// images: attached by the file input, pasted or dropped on the input; only for a model that takes them, in chat mode
function showAttach() {
  const shown = Boolean(takesImages[$("model").value]) && !$("completion").checked;
  $("image-box").hidden = !shown;
  if (!shown) setAttached([]);
}

function setAttached(images) {
  attached = images;
  $("attached").replaceChildren(...attached.map((src) => el("img", {src})));
}

function attach(files) {
  if ($("image-box").hidden) return;
  for (const file of files) {
    if (!file.type.startsWith("image/")) continue;
    const reader = new FileReader();
    reader.onload = () => setAttached(attached.concat([reader.result]));
    reader.readAsDataURL(file);
  }
}

async function send() {
  const text = $("input").value;
  if ((!text.trim() && !attached.length) || controller) return;
  $("input").value = "";
  const completion = $("completion").checked;
  const images = completion ? [] : attached;
  setAttached([]);
  bubble("user", text, images);
  const reply = bubble("assistant", "");
  const body = reply.querySelector(".body");
  const stats = el("div", {class: "stats"});
  reply.append(stats);
  let request;
  try {
    request = settings();
  } catch (err) {
    body.append(el("div", {class: "bad", text: "error: " + err.message}));
    return;
  }
  let path;
  if (completion) {
    path = "/v1/completions";
    Object.assign(request, {prompt: text, logprobs: 5});
  } else {
    path = "/v1/chat/completions";
    const call = $("tool-result").checked ? lastToolCall() : null;
    const content = images.length ? images.map((url) => ({type: "image_url", image_url: {url}}))
      .concat([{type: "text", text}]) : text;
    messages.push(call ? {role: "tool", tool_call_id: call.id, content: text} : {role: "user", content});
    const system = $("system").value.trim();
    request.messages = (system ? [{role: "system", content: system}] : []).concat(messages);
  }
  controller = new AbortController();
  $("send").disabled = true;
  $("stop-button").disabled = false;
  $("status").textContent = "generating...";
  const t0 = performance.now();
  let first = null, tokens = 0, full = "", finish = null, used = null;
  const calls = [];
  try {
    const response = await api(path, {method: "POST", headers: {"Content-Type": "application/json"},
                                       body: JSON.stringify(request), signal: controller.signal});
    if (!response.ok) {
      const error = await response.json().catch(() => ({}));
      throw new Error((error.error && error.error.message) || response.statusText);
    }
    await readEvents(response, (event) => {
      if (event.usage) {
        tokens = event.usage.completion_tokens;
        used = event.usage.prompt_tokens + event.usage.completion_tokens;
      }
      const choice = (event.choices || [])[0];
      if (!choice) return;
      if (choice.finish_reason) finish = choice.finish_reason;
      for (const call of (choice.delta && choice.delta.tool_calls) || []) {
        if (first === null) first = performance.now();
        calls.push(call);
        reply.insertBefore(toolCallNode(call), stats);
      }
      const thought = !completion && choice.delta && choice.delta.reasoning_content;
      if (thought) {                          // a thinking model's reasoning, shown apart from its answer
        let box = reply.querySelector(".reasoning");
        if (!box) reply.insertBefore(box = el("div", {class: "reasoning"}), body);
        box.textContent += thought;
      }
      const piece = completion ? choice.text : (choice.delta && choice.delta.content);
      if (!piece) return;
      if (first === null) first = performance.now();
      full += piece;
      if (!event.usage) tokens += 1;
      if (completion) {
        const top = (choice.logprobs && choice.logprobs.top_logprobs && choice.logprobs.top_logprobs[0]) || {};
        const title = Object.entries(top).map(([t, lp]) => `${JSON.stringify(t)}  ${Math.exp(lp).toPrecision(3)}`).join("\n");
        body.append(el("span", {class: "tok", title, text: piece}));
      } else {
        renderMarkdown(body, full);
      }
      $("log").scrollTop = $("log").scrollHeight;
    });
    if (!completion) {
      const turn = {role: "assistant", content: full};
      if (calls.length) turn.tool_calls = calls.map(({id, type, function: fn}) => ({id, type, function: fn}));
      messages.push(turn);
    }
    $("tool-result-box").hidden = !calls.length;
    $("tool-result").checked = calls.length > 0;
  } catch (err) {
    if (err.name === "AbortError") finish = "stopped";
    else body.append(el("div", {class: "bad", text: "error: " + err.message}));
    // a stopped reply stays in the conversation as far as it got; a refused or failed turn leaves the
    // conversation as it was, so the next one can go on
    if (!completion && finish === "stopped" && full) messages.push({role: "assistant", content: full});
    else if (!completion) messages.pop();
  } finally {
    const seconds = (performance.now() - t0) / 1000;
    const ttft = first === null ? "-" : Math.round(first - t0) + " ms";
    const rate = first === null ? 0 : tokens / Math.max((performance.now() - first) / 1000, 1e-3);
    const limit = contextOf[request.model];
    stats.textContent = `${tokens} tokens · TTFT ${ttft} · ${rate.toFixed(1)} tok/s · ${seconds.toFixed(1)} s` +
      (used !== null ? ` · context ${used}` + (limit ? ` / ${limit}` : "") : "") + (finish ? ` · ${finish}` : "");
    controller = null;
    $("send").disabled = false;
    $("stop-button").disabled = true;
    $("status").textContent = "";
  }
}

$("send").addEventListener("click", send);
$("input").addEventListener("keydown", (e) => { if (e.key === "Enter" && e.ctrlKey) send(); });
$("stop-button").addEventListener("click", () => { if (controller) controller.abort(); });
$("clear").addEventListener("click", () => {
  messages = [];
  setAttached([]);
  $("log").replaceChildren();
  $("tool-result-box").hidden = true;
  $("tool-result").checked = false;
});
$("format").addEventListener("change", () => { $("schema-box").hidden = $("format").value !== "json_schema"; });
$("model").addEventListener("change", showAttach);
$("completion").addEventListener("change", showAttach);
$("image").addEventListener("change", () => { attach($("image").files); $("image").value = ""; });
$("input").addEventListener("paste", (e) => attach(e.clipboardData ? e.clipboardData.files : []));
$("input").addEventListener("dragover", (e) => e.preventDefault());
$("input").addEventListener("drop", (e) => { e.preventDefault(); attach(e.dataTransfer ? e.dataTransfer.files : []); });
loadModels().catch((err) => { $("status").textContent = "cannot list models: " + err.message; });
