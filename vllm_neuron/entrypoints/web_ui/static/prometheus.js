// Prometheus' text format (what /metrics answers) -> samples, and the sums, ratios and quantiles the dashboard
// shows. Pure functions: no DOM.

const SAMPLE = /^([A-Za-z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)/;
const LABEL = /([A-Za-z_]\w*)="((?:[^"\\]|\\.)*)"/g;

export function parseMetrics(text) {
  const samples = [];
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const m = line.match(SAMPLE);
    if (!m) continue;
    const labels = {};
    for (const l of (m[2] || "").matchAll(LABEL)) labels[l[1]] = l[2].replace(/\\(.)/g, (_, c) => (c === "n" ? "\n" : c));
    samples.push({ name: m[1], labels, value: Number(m[3]) });
  }
  return new Metrics(samples);
}

export class Metrics {
  constructor(samples) {
    this.samples = samples;
  }

  select(name, where = {}) {
    return this.samples.filter((s) => s.name === name && Object.entries(where).every(([k, v]) => s.labels[k] === v));
  }

  has(name) {
    return this.samples.some((s) => s.name === name);
  }

  sum(name, where) {
    return this.select(name, where).reduce((acc, s) => acc + s.value, 0);
  }

  max(name, where) {
    const values = this.select(name, where).map((s) => s.value);
    return values.length ? Math.max(...values) : 0;
  }

  // label value -> summed value, e.g. byLabel("vllm_neuron:neff_execution_count_total", "bucket_name")
  byLabel(name, label) {
    const out = new Map();
    for (const s of this.select(name)) out.set(s.labels[label], (out.get(s.labels[label]) || 0) + s.value);
    return out;
  }

  // A histogram's cumulative buckets summed over its other labels: [{le, count}] by ascending le, and sum, count.
  histogram(name) {
    const byLe = new Map();
    for (const s of this.select(`${name}_bucket`)) {
      const le = s.labels.le === "+Inf" ? Infinity : Number(s.labels.le);
      byLe.set(le, (byLe.get(le) || 0) + s.value);
    }
    const buckets = [...byLe.entries()].sort((a, b) => a[0] - b[0]).map(([le, count]) => ({ le, count }));
    return { buckets, sum: this.sum(`${name}_sum`), count: this.sum(`${name}_count`) };
  }
}

// The q-quantile of a cumulative histogram, linear within its bucket (Prometheus' histogram_quantile).
export function quantile(histogram, q) {
  const { buckets } = histogram;
  if (!buckets.length) return NaN;
  const total = buckets[buckets.length - 1].count;
  if (!total) return NaN;
  const rank = q * total;
  let lowerLe = 0;
  let lowerCount = 0;
  for (const { le, count } of buckets) {
    if (count >= rank) {
      if (le === Infinity) return lowerLe;
      return lowerLe + (le - lowerLe) * (count > lowerCount ? (rank - lowerCount) / (count - lowerCount) : 0);
    }
    lowerLe = le;
    lowerCount = count;
  }
  return lowerLe;
}
