// The chat playground: a model from /v1/models, streamed answers from /v1/chat/completions, the sampling
// settings, token logprobs coloured by probability, images, JSON-schema mode, and the conversation kept in
// this browser's localStorage. Every server answer is handled: a 4xx or 5xx is shown under the message, a lost
// stream keeps what arrived and says so, and an unreachable server is retried until it is back.

import { apiFetch, describeError, el, HttpError, setUpKeyPanel } from "./common.js";
import { renderMarkdown } from "./markdown.js";

const STORE = "vllm-neuron:chat";
const RETRY_MS = 3000;

const $ = (id) => document.getElementById(id);
const ui = {
  model: $("model"), status: $("server-status"), messages: $("messages"), prompt: $("prompt"),
  send: $("send"), stop: $("stop"), attachments: $("attachments"), imageInput: $("image-input"),
  system: $("system"), temperature: $("temperature"), topP: $("top-p"), maxTokens: $("max-tokens"),
  stopWords: $("stop-words"), logprobs: $("logprobs"), jsonMode: $("json-mode"), jsonSchema: $("json-schema"),
  newChat: $("new-chat"), notice: $("notice"),
};
const SETTINGS = ["system", "temperature", "topP", "maxTokens", "stopWords", "logprobs", "jsonMode", "jsonSchema"];

let messages = [];       // {role, content, images?, logprobs?, json?, error?, stopped?, finish?}
let pendingImages = [];  // data: URLs for the next user message
let controller = null;   // the running request's AbortController
const showKeyPanel = setUpKeyPanel(() => loadModels());

function load() {
  try {
    const saved = JSON.parse(localStorage.getItem(STORE) || "{}");
    messages = Array.isArray(saved.messages) ? saved.messages : [];
    for (const name of SETTINGS) {
      const value = saved.settings && saved.settings[name];
      if (value === undefined) continue;
      if (ui[name].type === "checkbox") ui[name].checked = Boolean(value);
      else ui[name].value = String(value);
    }
    ui.model.dataset.wanted = saved.model || "";
  } catch (_) {
    messages = [];
  }
}

function save() {
  const settings = {};
  for (const name of SETTINGS) settings[name] = ui[name].type === "checkbox" ? ui[name].checked : ui[name].value;
  const state = { messages: messages.map(({ pending, ...m }) => m), settings, model: ui.model.value };
  try {
    localStorage.setItem(STORE, JSON.stringify(state));
  } catch (_) {  // over the browser's quota (images): keep the text
    state.messages = state.messages.map(({ images, ...m }) => ({ ...m, images: images ? [] : undefined }));
    try { localStorage.setItem(STORE, JSON.stringify(state)); } catch (_) { /* nothing more to drop */ }
  }
}

function setNotice(text) {
  ui.notice.textContent = text || "";
  ui.notice.hidden = !text;
}

async function loadModels() {
  const wanted = ui.model.value || ui.model.dataset.wanted;
  try {
    const body = await (await apiFetch("v1/models")).json();
    ui.model.replaceChildren(...body.data.map((m) => el("option", { value: m.id }, m.id)));
    if (body.data.some((m) => m.id === wanted)) ui.model.value = wanted;
    ui.status.textContent = "connected";
    ui.status.className = "ok";
    setNotice("");
  } catch (error) {
    ui.status.textContent = "offline";
    ui.status.className = "bad";
    if (error instanceof HttpError && error.status === 401) {
      showKeyPanel("This server needs an API key.");
    } else {
      setNotice(`${describeError(error)} Retrying every ${RETRY_MS / 1000} s.`);
      setTimeout(loadModels, RETRY_MS);
    }
  }
}

function probabilityColour(p) {
  return `hsl(${Math.round(120 * p)}, 75%, 82%)`;  // red (unlikely) to green (likely)
}

function tokenSpans(logprobs) {
  return el("div", { class: "tokens" }, logprobs.map(({ token, logprob }) => {
    const p = Math.exp(logprob);
    const span = el("span", { class: "token", title: `p = ${p.toFixed(3)} (logprob ${logprob.toFixed(3)})`,
                              dataset: { logprob: String(logprob) } }, token);
    span.style.backgroundColor = probabilityColour(p);
    return span;
  }));
}

async function copyText(text, button) {
  try {
    await navigator.clipboard.writeText(text);
  } catch (_) {  // no clipboard permission (plain http on another host): the old way
    const area = el("textarea", {}, text);
    document.body.append(area);
    area.select();
    document.execCommand("copy");
    area.remove();
  }
  button.textContent = "Copied";
  setTimeout(() => { button.textContent = "Copy"; }, 1200);
}

function messageBody(message) {
  const body = el("div", { class: "body" });
  if (message.role === "assistant" && message.logprobs && message.logprobs.length) {
    body.append(tokenSpans(message.logprobs));
  } else if (message.role === "assistant" && message.json) {  // JSON mode: the text as it came, as code
    body.append(el("pre", {}, el("code", { class: "language-json" }, message.content)));
  } else if (message.role === "assistant") {
    body.append(renderMarkdown(message.content));
  } else {
    body.append(el("div", { class: "plain" }, message.content));
  }
  for (const url of message.images || []) body.append(el("img", { class: "thumb", src: url, alt: "attached image" }));
  if (message.pending && !message.content) body.append(el("span", { class: "cursor" }, "…"));
  return body;
}

function messageNode(message, index) {
  const last = index === messages.length - 1;
  const actions = el("div", { class: "actions" });
  if (message.role === "assistant" && !message.pending) {
    const copy = el("button", { class: "copy", type: "button" }, "Copy");
    copy.addEventListener("click", () => copyText(message.content, copy));
    actions.append(copy);
    if (last) actions.append(el("button", { class: "regenerate", type: "button", onclick: regenerate }, "Regenerate"));
  }
  const notes = [];
  if (message.stopped) notes.push(el("div", { class: "note" }, "Stopped."));
  if (message.finish === "length") notes.push(el("div", { class: "note" }, "Cut at max tokens."));
  if (message.error) notes.push(el("div", { class: "error", role: "alert" }, message.error));
  return el("article", { class: `message ${message.role}${message.pending ? " pending" : ""}` },
            el("div", { class: "role" }, message.role), messageBody(message), notes, actions);
}

function render() {
  ui.messages.replaceChildren(...messages.map(messageNode));
  ui.messages.scrollTop = ui.messages.scrollHeight;
}

let frame = 0;
function renderLast() {  // at most once a frame while tokens stream in
  if (frame) return;
  frame = requestAnimationFrame(() => {
    frame = 0;
    const node = ui.messages.lastElementChild;
    if (node && messages.length) node.replaceWith(messageNode(messages[messages.length - 1], messages.length - 1));
    ui.messages.scrollTop = ui.messages.scrollHeight;
  });
}

function setBusy(busy) {
  ui.send.disabled = busy;
  ui.stop.hidden = !busy;
  ui.send.hidden = busy;
}

function number(input, name) {
  const text = input.value.trim();
  if (text === "") return undefined;
  const value = Number(text);
  if (!Number.isFinite(value)) throw new Error(`${name} must be a number, got "${text}".`);
  return value;
}

function responseFormat() {
  if (!ui.jsonMode.checked) return undefined;
  const text = ui.jsonSchema.value.trim();
  if (!text) return { type: "json_object" };
  let schema;
  try {
    schema = JSON.parse(text);
  } catch (e) {
    throw new Error(`The JSON schema is not valid JSON: ${e.message}`);
  }
  return { type: "json_schema", json_schema: { name: "playground", schema } };
}

function apiMessages() {
  const out = [];
  if (ui.system.value.trim()) out.push({ role: "system", content: ui.system.value });
  for (const m of messages) {
    if (m.pending || (m.role === "assistant" && !m.content)) continue;
    if (m.images && m.images.length) {
      out.push({ role: m.role, content: [...m.images.map((url) => ({ type: "image_url", image_url: { url } })),
                                         ...(m.content ? [{ type: "text", text: m.content }] : [])] });
    } else {
      out.push({ role: m.role, content: m.content });
    }
  }
  return out;
}

function requestBody() {
  const body = { model: ui.model.value, messages: apiMessages(), stream: true };
  const temperature = number(ui.temperature, "Temperature");
  const topP = number(ui.topP, "top_p");
  const maxTokens = number(ui.maxTokens, "Max tokens");
  if (temperature !== undefined) body.temperature = temperature;
  if (topP !== undefined) body.top_p = topP;
  if (maxTokens !== undefined) body.max_tokens = maxTokens;
  const stop = ui.stopWords.value.split("\n").filter((s) => s !== "");
  if (stop.length) body.stop = stop;
  if (ui.logprobs.checked) body.logprobs = true;
  const format = responseFormat();
  if (format) body.response_format = format;
  return body;
}

// Server-sent events: `data: {chunk}` blocks, an error object as a chunk, `data: [DONE]` at the end.
async function readStream(response, onChunk) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return false;
    buffer += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
      if (!data) continue;
      if (data === "[DONE]") return true;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new HttpError(chunk.error.code || 500, chunk.error.message);
      onChunk(chunk);
    }
  }
}

async function generate() {
  const reply = { role: "assistant", content: "", pending: true, logprobs: ui.logprobs.checked ? [] : undefined };
  let body;
  try {
    body = requestBody();
  } catch (error) {
    setNotice(error.message);
    return;
  }
  setNotice("");
  reply.json = body.response_format !== undefined || undefined;
  messages.push(reply);
  render();
  controller = new AbortController();
  setBusy(true);
  try {
    const response = await apiFetch("v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
      signal: controller.signal,
    });
    const complete = await readStream(response, (chunk) => {
      const choice = chunk.choices && chunk.choices[0];
      if (!choice) return;
      if (choice.delta && choice.delta.content) reply.content += choice.delta.content;
      if (reply.logprobs && choice.logprobs && choice.logprobs.content) {
        for (const t of choice.logprobs.content) reply.logprobs.push({ token: t.token, logprob: t.logprob });
      }
      if (choice.finish_reason) reply.finish = choice.finish_reason;
      renderLast();
    });
    if (!complete) reply.error = "The connection was lost before the answer was complete; what arrived is kept.";
  } catch (error) {
    if (error.name === "AbortError") {
      reply.stopped = true;
    } else {
      reply.error = describeError(error);
      if (error instanceof HttpError && error.status === 401) showKeyPanel("This server needs an API key.");
    }
  } finally {
    controller = null;
    reply.pending = false;
    setBusy(false);
    save();
    render();
  }
}

async function send() {
  if (controller) return;
  const text = ui.prompt.value.trim();
  if (!text && !pendingImages.length) return;
  if (!ui.model.value) {
    setNotice("No model to talk to yet: the server has not answered /v1/models.");
    return;
  }
  messages.push({ role: "user", content: text, images: pendingImages.length ? pendingImages : undefined });
  ui.prompt.value = "";
  pendingImages = [];
  ui.attachments.replaceChildren();
  await generate();
}

async function regenerate() {
  if (controller) return;
  while (messages.length && messages[messages.length - 1].role === "assistant") messages.pop();
  if (messages.length) await generate();
  else render();
}

function addImages(files) {
  for (const file of files) {
    const reader = new FileReader();
    reader.addEventListener("load", () => {
      const url = reader.result;
      pendingImages.push(url);
      const remove = el("button", { type: "button", class: "remove", title: "Remove" }, "×");
      const chip = el("span", { class: "attachment" }, el("img", { class: "thumb", src: url, alt: file.name }),
                      remove);
      remove.addEventListener("click", () => {
        pendingImages = pendingImages.filter((u) => u !== url);
        chip.remove();
      });
      ui.attachments.append(chip);
    });
    reader.readAsDataURL(file);
  }
}

ui.send.addEventListener("click", send);
ui.stop.addEventListener("click", () => { if (controller) controller.abort(); });
ui.prompt.addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) {
    e.preventDefault();
    send();
  }
});
ui.imageInput.addEventListener("change", () => {
  addImages(ui.imageInput.files);
  ui.imageInput.value = "";
});
ui.newChat.addEventListener("click", () => {
  if (controller) controller.abort();
  messages = [];
  save();
  render();
});
ui.jsonMode.addEventListener("change", () => { ui.jsonSchema.hidden = !ui.jsonMode.checked; });
for (const name of SETTINGS) ui[name].addEventListener("change", save);
ui.model.addEventListener("change", save);

load();
ui.jsonSchema.hidden = !ui.jsonMode.checked;
render();
loadModels();
