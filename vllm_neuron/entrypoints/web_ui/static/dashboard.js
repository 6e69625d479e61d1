// The engine dashboard: polls /metrics and shows what the engine is doing: requests, throughput, latency
// histograms, the KV pool, the prefix cache, which bucket graphs run and how much padding they carry,
// speculative decoding and the encoder cache. Plots are SVG built here; nothing is fetched from elsewhere.

import { apiFetch, describeError, el, HttpError, setUpKeyPanel } from "./common.js";
import { parseMetrics, quantile } from "./prometheus.js";

const POLL_MS = 1000;
const HISTORY = 120;  // samples kept for the line plots
const SVG = "http://www.w3.org/2000/svg";
const $ = (id) => document.getElementById(id);

const CARDS = [
  ["running", "requests running"], ["waiting", "requests waiting"], ["finished", "requests finished"],
  ["gen-rate", "generated tokens/s"], ["prompt-rate", "prompt tokens/s"], ["generated", "tokens generated"],
  ["ttft", "TTFT mean (p50 / p90)"], ["tpot", "TPOT mean (p50 / p90)"], ["kv", "KV cache in use"],
  ["prefix", "prefix-cache hit rate"], ["preemptions", "preemptions"], ["spec", "speculative acceptance"],
  ["encoder", "encoder-cache hit rate"], ["rejected", "requests refused (503)"],
];

let previous = null;  // {time, metrics}
const history = { running: [], waiting: [], gen: [], prompt: [], kv: [] };
let timer = 0;
const showKeyPanel = setUpKeyPanel(() => poll());

function setCard(id, value) {
  $(`m-${id}`).textContent = value;
}

function push(series, value) {
  series.push(value);
  if (series.length > HISTORY) series.shift();
}

const seconds = (s) => (Number.isFinite(s) ? (s < 1 ? `${(s * 1000).toFixed(1)} ms` : `${s.toFixed(2)} s`) : "–");
const percent = (num, den) => (den > 0 ? `${((100 * num) / den).toFixed(1)} %` : "–");

function svgEl(tag, attrs) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
  return node;
}

function linePlot(svg, seriesList, fixedMax) {
  const max = fixedMax || Math.max(1e-9, ...seriesList.flatMap((s) => s.values));
  svg.replaceChildren(...seriesList.map(({ values, cls }) => {
    const step = 300 / Math.max(1, HISTORY - 1);
    const offset = HISTORY - values.length;
    const points = values.map((v, i) => `${((offset + i) * step).toFixed(1)},${(78 - (76 * v) / max).toFixed(1)}`);
    return svgEl("polyline", { points: points.join(" "), class: cls });
  }));
  svg.dataset.max = String(max);
}

function histogramPlot(svg, axis, histogram) {
  // Per-bucket counts (the cumulative counts' differences), up to the last bucket anything fell in.
  const counts = histogram.buckets.map((b, i) => ({ le: b.le, n: b.count - (i ? histogram.buckets[i - 1].count : 0) }));
  let last = counts.length - 1;
  while (last > 0 && counts[last].n === 0) last--;
  const shown = counts.slice(0, Math.max(last + 1, 1));
  const max = Math.max(1, ...shown.map((c) => c.n));
  const width = 300 / Math.max(1, shown.length);
  svg.replaceChildren(...shown.map((c, i) => {
    const h = (76 * c.n) / max;
    const bar = svgEl("rect", { x: (i * width + 1).toFixed(1), y: (78 - h).toFixed(1), width: Math.max(1, width - 2).toFixed(1),
                                height: h.toFixed(1), class: "bar" });
    bar.append(svgEl("title", {}));
    bar.firstChild.textContent = `≤ ${c.le === Infinity ? "∞" : c.le} s: ${c.n}`;
    return bar;
  }));
  axis.textContent = shown.length ? `0 … ${shown[shown.length - 1].le === Infinity ? "∞" : shown[shown.length - 1].le} s, ${histogram.count} samples` : "";
}

function latency(h) {
  return h.count > 0 ? `${seconds(h.sum / h.count)} (${seconds(quantile(h, 0.5))} / ${seconds(quantile(h, 0.9))})` : "–";
}

function bucketTable(m) {
  const runs = m.byLabel("vllm_neuron:neff_execution_count_total", "bucket_name");
  const total = [...runs.values()].reduce((a, b) => a + b, 0);
  const mean = (name, bucket) => {
    const count = m.sum(`${name}_count`, { bucket_name: bucket });
    return count > 0 ? (m.sum(`${name}_sum`, { bucket_name: bucket }) / count).toFixed(1) : "–";
  };
  const rows = [...runs.entries()].sort((a, b) => a[0].localeCompare(b[0], undefined, { numeric: true }))
    .map(([bucket, n]) => el("tr", { dataset: { bucket } }, el("td", {}, bucket), el("td", { class: "executions" }, String(n)),
                             el("td", {}, mean("vllm_neuron:num_seqs_padding", bucket)),
                             el("td", {}, mean("vllm_neuron:num_batched_tokens_padding", bucket)),
                             el("td", {}, percent(n, total))));
  $("buckets").tBodies[0].replaceChildren(...(rows.length ? rows : [el("tr", {}, el("td", { colspan: 5 }, "no steps yet"))]));
}

function specTable(m) {
  const drafts = m.sum("vllm:spec_decode_num_draft_tokens_total");
  const accepted = m.sum("vllm:spec_decode_num_accepted_tokens_total");
  setCard("spec", drafts > 0 ? `${percent(accepted, drafts)} of ${drafts} drafted` : "no speculator");
  const perPos = m.byLabel("vllm:spec_decode_num_accepted_tokens_per_pos_total", "position");
  const numDrafts = m.sum("vllm:spec_decode_num_drafts_total");
  $("spec-section").hidden = drafts === 0;
  $("spec-positions").tBodies[0].replaceChildren(...[...perPos.entries()].sort((a, b) => a[0] - b[0]).map(([pos, n]) =>
    el("tr", {}, el("td", {}, pos), el("td", {}, String(n)), el("td", {}, percent(n, numDrafts)))));
}

function update(m, now) {
  const dt = previous ? (now - previous.time) / 1000 : 0;
  const rate = (name) => (previous && dt > 0 ? Math.max(0, (m.sum(name) - previous.metrics.sum(name)) / dt) : 0);
  const running = m.sum("vllm:num_requests_running");
  const waiting = m.sum("vllm:num_requests_waiting");
  const kv = 100 * m.max("vllm:kv_cache_usage_perc");
  const gen = rate("vllm:generation_tokens_total");
  const prompt = rate("vllm:prompt_tokens_total");
  setCard("running", String(running));
  setCard("waiting", String(waiting));
  setCard("finished", String(m.sum("vllm:request_success_total")));
  setCard("gen-rate", gen.toFixed(1));
  setCard("prompt-rate", prompt.toFixed(1));
  setCard("generated", String(m.sum("vllm:generation_tokens_total")));
  const ttft = m.histogram("vllm:time_to_first_token_seconds");
  const tpot = m.histogram("vllm:inter_token_latency_seconds");
  setCard("ttft", latency(ttft));
  setCard("tpot", latency(tpot));
  setCard("kv", `${kv.toFixed(1)} %`);
  setCard("prefix", percent(m.sum("vllm:prefix_cache_hits_total"), m.sum("vllm:prefix_cache_queries_total")));
  setCard("preemptions", String(m.sum("vllm:num_preemptions_total")));
  const hits = m.sum("vllm_neuron:encoder_cache_hits_total");
  const misses = m.sum("vllm_neuron:encoder_cache_misses_total");
  setCard("encoder", hits + misses > 0 ? percent(hits, hits + misses) : "no media yet");
  setCard("rejected", String(m.sum("vllm_neuron:num_requests_rejected_total")));
  specTable(m);
  bucketTable(m);
  push(history.running, running);
  push(history.waiting, waiting);
  push(history.gen, gen);
  push(history.prompt, prompt);
  push(history.kv, kv);
  linePlot($("plot-requests"), [{ values: history.running, cls: "a" }, { values: history.waiting, cls: "b" }]);
  linePlot($("plot-throughput"), [{ values: history.gen, cls: "a" }, { values: history.prompt, cls: "b" }]);
  linePlot($("plot-kv"), [{ values: history.kv, cls: "a" }], 100);
  histogramPlot($("hist-ttft"), $("hist-ttft-axis"), ttft);
  histogramPlot($("hist-tpot"), $("hist-tpot-axis"), tpot);
  const model = m.select("vllm:generation_tokens_total")[0];
  $("model-name").textContent = model ? model.labels.model_name : "";
}

async function poll() {
  clearTimeout(timer);
  try {
    const text = await (await apiFetch("metrics")).text();
    const now = performance.now();
    const metrics = parseMetrics(text);
    update(metrics, now);
    previous = { time: now, metrics };
    $("server-status").textContent = "connected";
    $("server-status").className = "ok";
    $("notice").hidden = true;
    $("updated").textContent = `Updated ${new Date().toLocaleTimeString()}.`;
  } catch (error) {
    $("server-status").textContent = "offline";
    $("server-status").className = "bad";
    $("notice").textContent = describeError(error);
    $("notice").hidden = false;
    if (error instanceof HttpError && error.status === 401) {
      showKeyPanel("This server guards /metrics (--api-key-all-routes).");
      return;  // polling resumes once a key is given
    }
  }
  timer = setTimeout(poll, POLL_MS);
}

$("cards").replaceChildren(...CARDS.map(([id, label]) =>
  el("div", { class: "card" }, el("div", { class: "value", id: `m-${id}` }, "–"), el("div", { class: "label" }, label))));
$("interval").textContent = String(POLL_MS / 1000);
poll();
