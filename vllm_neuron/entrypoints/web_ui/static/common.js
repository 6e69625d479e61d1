// What the chat page and the dashboard share: the API key (asked for on a 401, kept in this browser's
// localStorage), fetch with that key, errors as readable text, and element building that never parses HTML.
// Every URL is relative: the page's <base href> is the server's --root-path.

const KEY_STORE = "vllm-neuron:api-key";

export function apiKey() {
  return localStorage.getItem(KEY_STORE) || "";
}

export function setApiKey(key) {
  if (key) localStorage.setItem(KEY_STORE, key);
  else localStorage.removeItem(KEY_STORE);
}

export class HttpError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

// The OpenAI error object's message when the body is one, else the status line and the start of the body.
export async function errorMessage(response) {
  const text = await response.text().catch(() => "");
  try {
    const body = JSON.parse(text);
    if (body && body.error && typeof body.error.message === "string") return body.error.message;
  } catch (_) { /* not JSON: shown as text */ }
  const status = `${response.status} ${response.statusText}`.trim();
  return text ? `${status}: ${text.slice(0, 300)}` : status;
}

// fetch() with the API key; a response that is not 2xx becomes an HttpError, a network failure a TypeError.
export async function apiFetch(path, options = {}) {
  const headers = new Headers(options.headers || {});
  const key = apiKey();
  if (key) headers.set("Authorization", `Bearer ${key}`);
  const response = await fetch(path, { ...options, headers, cache: "no-store" });
  if (!response.ok) throw new HttpError(response.status, await errorMessage(response));
  return response;
}

export function describeError(error) {
  if (error instanceof HttpError) {
    if (error.status === 401) return "The server wants an API key (or this one is wrong): set it with the API key button.";
    return `Error ${error.status}: ${error.message}`;
  }
  if (error instanceof TypeError) return `The server cannot be reached (${error.message}). Is it running?`;
  return String(error && error.message ? error.message : error);
}

// el("button", {class: "x", onclick: f}, "text", childNode): children are text or nodes, never HTML.
export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else if (name === "class") node.className = value;
    else if (name === "dataset") Object.assign(node.dataset, value);
    else node.setAttribute(name, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === undefined || child === null || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

// The API key panel of both pages: shown on a 401 or by the #key-button; `onSaved` runs after a key is set.
export function setUpKeyPanel(onSaved) {
  const input = el("input", { id: "key-input", type: "password", autocomplete: "off",
                              placeholder: "the server's --api-key" });
  const reason = el("span", { id: "key-reason" });
  const panel = el("div", { id: "key-panel", class: "overlay", hidden: true },
    el("div", { class: "panel" },
       el("p", {}, "API key ", reason),
       input,
       el("p", { class: "hint" }, "Kept in this browser only (localStorage), sent as Authorization: Bearer."),
       el("button", { id: "key-save", type: "button", onclick: () => save() }, "Use key"), " ",
       el("button", { id: "key-cancel", type: "button", onclick: () => { panel.hidden = true; } }, "Cancel")));
  document.body.append(panel);
  const show = (why) => {
    reason.textContent = why || "";
    input.value = apiKey();
    panel.hidden = false;
    input.focus();
  };
  const save = () => {
    setApiKey(input.value.trim());
    panel.hidden = true;
    onSaved();
  };
  input.addEventListener("keydown", (e) => { if (e.key === "Enter") save(); });
  document.getElementById("key-button").addEventListener("click", () => show(""));
  return show;
}
