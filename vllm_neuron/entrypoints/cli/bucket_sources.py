"""Where `vllm-neuron buckets advise` reads the served step shapes from, each into one `Source`.

* a summary file (engine/served_shapes.py, in the compile cache folder): exact counts, limits and lists;
* a log with the engine's DEBUG step lines (VLLM_NEURON_LOG_LEVEL=DEBUG): exact shapes; the limits and lists from
  the start-up lines of the same log (Engine config, the bucket table);
* a running server's /metrics: the step-shape histograms (each value read as its histogram bucket's upper
  bound, so padding estimates lean low; decode batch sizes and contexts taken as independent), the lists from
  vllm_neuron:bucket_graphs and max_model_len from /v1/models; the block size is taken as 16 (--block-size).
Options given on the command line (--max-num-seqs, ...) replace what a source says or lacks. Every problem is a
ValueError naming the source and what is missing.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path

from vllm_neuron.config.bucket_advisor import Limits, Lists, Traffic
from vllm_neuron.engine.served_shapes import parse_summary


@dataclass
class Source:
    what: str  # for the report: "summary FILE", "log FILE", "metrics URL"
    traffic: Traffic
    limits: Limits | None
    current: Lists | None
    compile_seconds: dict[str, float]  # mean compile seconds per graph, by kind ("prefill", "decode")
    upper_bounds: bool = False  # values are histogram bounds: clipped to the limits once these are known


def from_summary(path: str) -> Source:
    limits, traffic, current, compile_seconds = parse_summary(path)
    return Source(f"summary {path}", traffic, limits, current, compile_seconds)


_STEP = re.compile(r"\bstep (?P<bucket>(?P<kind>prefill|decode|verify)\S*) (?P<what>tokens|seqs)=(?P<real>\d+)/\d+ "
                   r"context=(?P<ctx>\d+) execute_ms=(?P<ms>[\d.]+)")
_CONFIG = re.compile(r"Engine config: .*?max_model_len=(\d+) max_num_seqs=(\d+) max_num_batched_tokens=(\d+) "
                     r"block_size=(\d+)")
_TABLE = {name: re.compile(rf"{re.escape(label)}\s*:([\d, ]*)$", re.M) for name, label in (
    ("prefill", "prefill tokens (num_batched_tokens_buckets)"), ("decode", "decode sequences (num_seqs_buckets)"),
    ("contexts", "decode context lengths"))}
_GRAPHS = re.compile(r"^\s*graphs\s*:(.*)$", re.M)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in re.findall(r"\d+", text))


def from_log(path: str) -> Source:
    try:
        text = Path(path).read_text(errors="replace")
    except OSError as e:
        raise ValueError(f"cannot read the log {path}: {e}") from None
    traffic = Traffic()
    for m in _STEP.finditer(text):
        real, ctx, seconds = int(m["real"]), int(m["ctx"]), float(m["ms"]) / 1e3
        if m["kind"] == "prefill":
            traffic.prefill[real] = traffic.prefill.get(real, 0) + 1
            traffic.seconds["prefill"] = traffic.seconds.get("prefill", 0.0) + seconds
        else:
            traffic.decode[(real, ctx)] = traffic.decode.get((real, ctx), 0) + 1
            traffic.seconds["decode"] = traffic.seconds.get("decode", 0.0) + seconds
    if traffic.steps == 0:
        raise ValueError(f"{path} has no step lines (`step <bucket> tokens=.../... context=... execute_ms=...`): "
                         "run the engine with VLLM_NEURON_LOG_LEVEL=DEBUG (and VLLM_NEURON_STEP_TIMING on) to log them")
    limits = current = None
    config = _CONFIG.findall(text)
    if config:
        max_model_len, max_num_seqs, max_tokens, block_size = (int(v) for v in config[-1])
        lists = {name: rx.findall(text) for name, rx in _TABLE.items()}
        graphs = _GRAPHS.findall(text)
        names = graphs[-1] if graphs else ""
        has_decode = not lists["decode"] or bool(_ints(lists["decode"][-1]))
        limits = Limits(max_tokens, max_num_seqs, max_model_len, block_size,
                        prefill_graphs_per_bucket=2 if re.search(r"prefill_s\d+_c\d+", names) else 1,
                        decode_graphs_per_bucket=2 if "Speculative decoding:" in text else 1, has_decode=has_decode)
        if all(lists.values()):
            current = Lists(*(_ints(lists[k][-1]) for k in ("prefill", "decode", "contexts")))
    return Source(f"log {path}", traffic, limits, current, {})


def _histogram(families: dict, name: str) -> list[tuple[float, float]]:
    """(upper bound, count in that bucket) of a histogram family, summed over its label sets."""
    fam = families.get(name)
    if fam is None:
        return []
    cumulative: dict[float, float] = {}
    for s in fam.samples:
        if s.name.endswith("_bucket"):
            le = float(s.labels["le"])
            cumulative[le] = cumulative.get(le, 0.0) + s.value
    out, prev = [], 0.0
    for le in sorted(cumulative):
        n = cumulative[le] - prev
        prev = cumulative[le]
        if n > 0:
            out.append((le, n))
    return out


def from_metrics(url: str, timeout_s: float = 10.0) -> Source:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    base = url.rstrip("/").removesuffix("/metrics")
    try:
        r = httpx.get(base + "/metrics", timeout=timeout_s)
        r.raise_for_status()
        families = {f.name: f for f in text_string_to_metric_families(r.text)}
    except (httpx.HTTPError, ValueError) as e:
        raise ValueError(f"cannot read {base}/metrics: {e}") from None
    prefill = _histogram(families, "vllm_neuron:prefill_step_tokens")
    seqs = _histogram(families, "vllm_neuron:decode_step_seqs")
    ctxs = _histogram(families, "vllm_neuron:decode_step_context_tokens")
    if not prefill and not seqs:
        raise ValueError(f"{base}/metrics has no step-shape histograms (vllm_neuron:prefill_step_tokens, "
                         "vllm_neuron:decode_step_seqs): no step was served yet, or the server runs with "
                         "VLLM_NEURON_STEP_TIMING=0")
    graphs = {s.labels.get("bucket_name", "") for name in ("vllm_neuron:bucket_graphs",
                                                           "vllm_neuron:compilation_time_seconds")
              for s in getattr(families.get(name), "samples", [])}
    current, limits = _lists_from_graphs(graphs, base, timeout_s)
    traffic = Traffic(dict(prefill))
    total = sum(n for _, n in seqs)
    for b, nb in seqs:
        for c, nc in ctxs:
            traffic.decode[(b, c)] = traffic.decode.get((b, c), 0.0) + nb * nc / total
    # No compile-time estimate: /metrics' compilation times are cache-load times on a warm start.
    return Source(f"metrics {base}/metrics", traffic, limits, current, {}, upper_bounds=True)


def _clipped(t: Traffic, limits: Limits) -> Traffic:
    """Histogram bounds (+Inf included) as values: each clipped to the largest the limits allow."""
    out = Traffic(seconds=dict(t.seconds))
    for v, n in t.prefill.items():
        k = int(min(v, limits.max_num_batched_tokens))
        out.prefill[k] = out.prefill.get(k, 0.0) + n
    for (b, c), n in t.decode.items():
        k = (int(min(b, limits.max_num_seqs)), int(min(c, limits.max_model_len)))
        out.decode[k] = out.decode.get(k, 0.0) + n
    return out


def _lists_from_graphs(graphs: set[str], base: str, timeout_s: float) -> tuple[Lists | None, Limits | None]:
    """The lists (and the limits they end at) from the graphs' names; max_model_len from /v1/models when the
    decode graphs carry no context."""
    prefill = sorted({int(m[1]) for g in graphs if (m := re.fullmatch(r"prefill_s(\d+)", g))})
    decode = sorted({int(m[1]) for g in graphs if (m := re.fullmatch(r"decode_b(\d+)(?:_c\d+)?", g))})
    contexts = sorted({int(m[1]) for g in graphs if (m := re.fullmatch(r"decode_b\d+_c(\d+)", g))})
    if not prefill or not decode:
        return None, None
    if not contexts:
        import httpx

        try:
            contexts = [int(httpx.get(base + "/v1/models", timeout=timeout_s).json()["data"][0]["max_model_len"])]
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
            return None, None
    limits = Limits(prefill[-1], decode[-1], contexts[-1], 16,
                    prefill_graphs_per_bucket=2 if any(re.fullmatch(r"prefill_s\d+_c\d+", g) for g in graphs) else 1,
                    decode_graphs_per_bucket=2 if any(g.startswith("verify_") for g in graphs) else 1)
    return Lists(tuple(prefill), tuple(decode), tuple(contexts)), limits


def with_overrides(src: Source, *, max_num_batched_tokens: int | None, max_num_seqs: int | None,
                   max_model_len: int | None, block_size: int | None) -> Source:
    """The source with the command line's limits applied; ValueError when a limit is still unknown."""
    given = {"max_num_batched_tokens": max_num_batched_tokens, "max_num_seqs": max_num_seqs,
             "max_model_len": max_model_len, "block_size": block_size}
    given = {k: v for k, v in given.items() if v is not None}
    limits = src.limits
    if limits is None:
        missing = [k for k in ("max_num_batched_tokens", "max_num_seqs", "max_model_len") if k not in given]
        if missing:
            raise ValueError(f"the {src.what} does not say the engine's {', '.join(missing)}: give "
                             + " ".join(f"--{k.replace('_', '-')} N" for k in missing))
        limits = Limits(given["max_num_batched_tokens"], given["max_num_seqs"], given["max_model_len"],
                        given.get("block_size", 16))
    elif given:
        limits = replace(limits, **given)
    return replace(src, limits=limits, traffic=_clipped(src.traffic, limits) if src.upper_bounds else src.traffic)
