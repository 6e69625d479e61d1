// A small Markdown renderer for model output: fenced code, headings, lists, quotes, rules, paragraphs, and
// inline code, bold, italic, strike-through and links. It builds DOM nodes and sets every piece of the model's
// text as a text node, so no output (a <script>, an onerror attribute, a javascript: link) is ever parsed as
// HTML or run.

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([\w+#.-]*)[^`]*$/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
const RULE = /^ {0,3}([-*_])(\s*\1){2,}\s*$/;
const QUOTE = /^ {0,3}>\s?(.*)$/;
const ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;
const LINK_SCHEMES = new Set(["http:", "https:", "mailto:"]);
// One alternative per inline form; the first that starts earliest wins.
const INLINE = /(`+)([\s\S]*?[^`])\1(?!`)|\*\*(?=\S)([\s\S]*?\S)\*\*|(?<!\w)__(?=\S)([\s\S]*?\S)__(?!\w)|\*(?=[^\s*])([^*]*?[^\s*])\*|(?<!\w)_(?=[^\s_])([^_]*?[^\s_])_(?!\w)|~~(?=\S)([\s\S]*?\S)~~|\[([^\]\n]+)\]\(([^()\s]+)\)/g;

export function safeUrl(url) {
  try {
    const parsed = new URL(url, document.baseURI);
    return LINK_SCHEMES.has(parsed.protocol) ? parsed.href : null;
  } catch (_) {
    return null;
  }
}

function appendText(parent, text) {
  const lines = text.split("\n");
  lines.forEach((line, i) => {
    if (i > 0) parent.append(document.createElement("br"));
    if (line) parent.append(document.createTextNode(line));
  });
}

export function renderInline(parent, text) {
  let last = 0;
  for (const m of text.matchAll(INLINE)) {
    if (m.index > last) appendText(parent, text.slice(last, m.index));
    last = m.index + m[0].length;
    let node;
    if (m[1] !== undefined) {
      node = document.createElement("code");
      node.textContent = m[2].replace(/^ (.*) $/s, "$1");
    } else if (m[3] !== undefined || m[4] !== undefined) {
      node = document.createElement("strong");
      renderInline(node, m[3] ?? m[4]);
    } else if (m[5] !== undefined || m[6] !== undefined) {
      node = document.createElement("em");
      renderInline(node, m[5] ?? m[6]);
    } else if (m[7] !== undefined) {
      node = document.createElement("del");
      renderInline(node, m[7]);
    } else {
      const href = safeUrl(m[9]);
      if (href === null) {  // a scheme we do not link (javascript:, data:...): the text as written
        appendText(parent, m[0]);
        continue;
      }
      node = document.createElement("a");
      node.href = href;
      node.rel = "noopener noreferrer";
      node.target = "_blank";
      renderInline(node, m[8]);
    }
    parent.append(node);
  }
  if (last < text.length) appendText(parent, text.slice(last));
}

function startsBlock(line) {
  return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) || ITEM.test(line);
}

function renderList(lines, start, parent) {
  const first = lines[start].match(ITEM);
  const ordered = /\d/.test(first[2]);
  const list = document.createElement(ordered ? "ol" : "ul");
  if (ordered && parseInt(first[2], 10) !== 1) list.start = parseInt(first[2], 10);
  const indent = first[1].length;
  let i = start;
  let item = null;
  let body = [];
  const flush = () => {
    if (item === null) return;
    const li = document.createElement("li");
    const nested = body.findIndex((l) => ITEM.test(l) && l.match(ITEM)[1].length > indent);
    if (nested >= 0) {
      renderInline(li, body.slice(0, nested).join("\n"));
      renderBlocks(body.slice(nested).map((l) => l.slice(Math.min(indent + 2, l.search(/\S|$/)))), li);
    } else {
      renderInline(li, body.join("\n"));
    }
    list.append(li);
  };
  while (i < lines.length) {
    const line = lines[i];
    const m = line.match(ITEM);
    if (m && m[1].length === indent && /\d/.test(m[2]) === ordered) {
      flush();
      item = true;
      body = [m[3]];
    } else if (line.trim() === "" || (m === null && startsBlock(line) && line.search(/\S/) <= indent)) {
      break;
    } else if (m && m[1].length < indent) {
      break;
    } else {
      body.push(m && m[1].length > indent ? line : line.trim());
    }
    i++;
  }
  flush();
  parent.append(list);
  return i;
}

export function renderBlocks(lines, parent) {
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    const fence = line.match(FENCE);
    if (fence) {
      const marker = fence[1];
      const code = [];
      i++;
      while (i < lines.length && !(lines[i].trim().startsWith(marker) && lines[i].trim().replace(/[`~]/g, "") === "")) {
        code.push(lines[i]);
        i++;
      }
      i++;  // the closing fence (or the end of a still streaming answer)
      const pre = document.createElement("pre");
      const codeEl = document.createElement("code");
      if (fence[2]) codeEl.className = `language-${fence[2]}`;
      codeEl.textContent = code.join("\n");
      pre.append(codeEl);
      parent.append(pre);
      continue;
    }
    if (line.trim() === "") {
      i++;
      continue;
    }
    const heading = line.match(HEADING);
    if (heading) {
      const h = document.createElement(`h${heading[1].length}`);
      renderInline(h, heading[2]);
      parent.append(h);
      i++;
      continue;
    }
    if (RULE.test(line)) {
      parent.append(document.createElement("hr"));
      i++;
      continue;
    }
    if (QUOTE.test(line)) {
      const quoted = [];
      while (i < lines.length && QUOTE.test(lines[i])) quoted.push(lines[i++].match(QUOTE)[1]);
      const q = document.createElement("blockquote");
      renderBlocks(quoted, q);
      parent.append(q);
      continue;
    }
    if (ITEM.test(line)) {
      i = renderList(lines, i, parent);
      continue;
    }
    const para = [line];
    i++;
    while (i < lines.length && lines[i].trim() !== "" && !startsBlock(lines[i])) para.push(lines[i++]);
    const p = document.createElement("p");
    renderInline(p, para.join("\n"));
    parent.append(p);
  }
}

// Markdown text -> a DocumentFragment of safe nodes.
export function renderMarkdown(text) {
  const fragment = document.createDocumentFragment();
  renderBlocks(String(text).replace(/\r\n?/g, "\n").split("\n"), fragment);
  return fragment;
}
