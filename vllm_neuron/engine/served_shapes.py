"""The step shapes an engine served, for the bucket advisor (config/bucket_advisor.py).

Every step adds one count: a prefill step by its token count, a decode step by (sequences, longest context,
rounded up to the context lists' grid), with the step's time by kind. The counts persist as a small JSON
summary in the compile cache folder (`served_shapes.json`: one per model and configuration, as the folder is),
written every FLUSH_EVERY_S while steps run, when the engine turns idle and at shutdown; each write adds this
process' counts since the last one to the file's under a lock, so data-parallel replicas sharing the folder
and restarts accumulate. `vllm-neuron buckets advise --from-summary` reads it.

Now and then (HINT_EVERY_S) the engine compares the padding of its buckets with the advisor's at the same
bucket counts and logs one line when the gap is large.
"""
from __future__ import annotations

import fcntl
import json
import os
import time
from dataclasses import asdict
from pathlib import Path

from vllm_neuron.config.bucket_advisor import Limits, Lists, Traffic, quick_padding
from vllm_neuron.logger import init_logger

logger = init_logger(__name__)

SUMMARY_NAME = "served_shapes.json"
SUMMARY_VERSION = 1
FLUSH_EVERY_S = 60.0
IDLE_FLUSH_EVERY_S = 5.0
HINT_EVERY_S = 600.0
HINT_MIN_STEPS = 500
# A kind whose padding is this much (absolute) above the advisor's, and at least twice it, earns the hint.
HINT_MARGIN = 0.15


def engine_limits(config, prefill_with_context: bool) -> Limits:
    """The advisor's Limits of a resolved EngineConfig (prefill_with_context: the runner's
    prefill_needs_context())."""
    nc = config.neuron_config
    return Limits(config.max_num_batched_tokens, config.max_num_seqs, config.max_model_len, config.block_size,
                  prefill_graphs_per_bucket=2 if prefill_with_context else 1,
                  decode_graphs_per_bucket=2 if config.speculative is not None else 1,
                  has_decode=config.pooling is None,
                  fixed_prefill=tuple(nc.kv_segment_size_buckets) if nc.kv_segment_size_buckets else None)


def engine_lists(config) -> Lists:
    nc = config.neuron_config
    return Lists(tuple(nc.num_batched_tokens_buckets), tuple(nc.num_seqs_buckets), tuple(nc.context_buckets))


class ServedShapes:
    """One engine's counts (rank 0 / the driver only)."""

    def __init__(self, path: Path | None, limits: Limits, current: Lists,
                 compile_seconds: dict[str, float] | None = None) -> None:
        self.path = path
        self.limits = limits
        self.current = current
        self.compile_seconds = compile_seconds or {}
        self.total = Traffic(decode_work=0.0)  # this process' counts (the hint's)
        self._pending = Traffic(decode_work=0.0)  # since the last write
        self._next_flush = time.monotonic() + FLUSH_EVERY_S
        self._next_hint = time.monotonic() + HINT_EVERY_S
        self._hinted = False
        self._written = False
        self._last_idle_flush = -IDLE_FLUSH_EVERY_S

    def record(self, kind: str, size: int, context: int, seconds: float) -> None:
        """One step: kind "prefill" (size = tokens) or "decode" / "verify" (size = sequences, context = the
        longest sequence's length)."""
        for t in (self.total, self._pending):
            if kind == "prefill":
                t.prefill[size] = t.prefill.get(size, 0) + 1
                t.seconds["prefill"] = t.seconds.get("prefill", 0.0) + seconds
            else:
                key = (size, self.limits.context_top(context))
                t.decode[key] = t.decode.get(key, 0) + 1
                t.decode_work += size * context
                t.seconds["decode"] = t.seconds.get("decode", 0.0) + seconds

    def tick(self, now: float) -> None:
        """Between steps: the periodic write and hint."""
        if now >= self._next_flush:
            self._next_flush = now + FLUSH_EVERY_S
            self.flush()
        if now >= self._next_hint:
            self._next_hint = now + HINT_EVERY_S
            try:
                self._maybe_hint()
            except Exception as e:  # noqa: BLE001 - advice must never fail a step
                logger.debug("bucket padding check failed: %s", e)

    def flush_when_idle(self, now: float) -> None:
        """The engine turned idle: write what is pending, at most every IDLE_FLUSH_EVERY_S."""
        if self._pending.steps and now - self._last_idle_flush >= IDLE_FLUSH_EVERY_S:
            self._last_idle_flush = now
            self.flush()

    def flush(self) -> None:
        """Adds the counts since the last write to the summary file (never raises: the summary is advice)."""
        if self.path is None or self._pending.steps == 0:
            return
        pending, self._pending = self._pending, Traffic(decode_work=0.0)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path.with_suffix(".lock"), "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                merged, compile_seconds = pending, dict(self.compile_seconds)
                if self.path.exists():
                    try:
                        old_limits, old, _, old_compile = parse_summary(self.path)
                    except ValueError as e:
                        logger.info("Replacing the served-shape summary %s (%s)", self.path, e)
                    else:
                        if old_limits == self.limits:
                            merged, compile_seconds = merge(old, pending), {**old_compile, **compile_seconds}
                        else:
                            logger.info("Replacing the served-shape summary %s: it was recorded with other limits",
                                        self.path)
                tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
                tmp.write_text(json.dumps(summary_json(merged, self.limits, self.current, compile_seconds)))
                os.replace(tmp, self.path)
            if not self._written:
                self._written = True
                logger.info("Served step shapes are kept in %s (`vllm-neuron buckets advise --from-summary` reads "
                            "it)", self.path)
        except OSError as e:
            logger.warning("Could not write the served-shape summary %s: %s", self.path, e)

    def _maybe_hint(self) -> None:
        if self.total.steps < HINT_MIN_STEPS or self._hinted:
            return
        (p_now, d_now), (p_new, d_new) = quick_padding(self.total, self.limits, self.current)
        far = [(kind, now, new) for kind, now, new in (("prefill", p_now, p_new), ("decode", d_now, d_new))
               if now - new > HINT_MARGIN and now > 2 * new]
        if far:
            self._hinted = True  # once per process: the advice does not change quickly
            what = "; ".join(f"{kind} {now:.0%} of its compute (advised lists with as many buckets: {new:.0%})"
                             for kind, now, new in far)
            where = f"--from-summary {self.path}" if self.path is not None else "--from METRICS_URL"
            logger.info("Bucket padding: %s. `vllm-neuron buckets advise %s` proposes the lists", what, where)


def merge(a: Traffic, b: Traffic) -> Traffic:
    out = Traffic(dict(a.prefill), dict(a.decode), dict(a.seconds), (a.decode_work or 0.0) + (b.decode_work or 0.0))
    for k, n in b.prefill.items():
        out.prefill[k] = out.prefill.get(k, 0) + n
    for k, n in b.decode.items():
        out.decode[k] = out.decode.get(k, 0) + n
    for k, s in b.seconds.items():
        out.seconds[k] = out.seconds.get(k, 0.0) + s
    return out


def summary_json(t: Traffic, limits: Limits, current: Lists, compile_seconds: dict[str, float]) -> dict:
    return {"version": SUMMARY_VERSION, "updated": time.time(), "limits": asdict(limits),
            "current": current.neuron_config() | {"context_buckets": list(current.contexts)},
            "compile_seconds": compile_seconds,
            "prefill": {str(k): n for k, n in sorted(t.prefill.items())},
            "decode": [[b, c, n] for (b, c), n in sorted(t.decode.items())],
            "decode_work": t.decode_work, "seconds": t.seconds}


def parse_summary(path: Path | str) -> tuple[Limits, Traffic, Lists, dict[str, float]]:
    """(limits, traffic, the lists it was served with, mean compile seconds by kind) of a summary file."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read the served-shape summary {path}: {e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not a served-shape summary (not JSON: {e})") from None
    try:
        if data.get("version") != SUMMARY_VERSION:
            raise ValueError(f"version {data.get('version')!r}, expected {SUMMARY_VERSION}")
        lim = dict(data["limits"])
        if lim.get("fixed_prefill") is not None:
            lim["fixed_prefill"] = tuple(lim["fixed_prefill"])
        limits = Limits(**lim)
        traffic = Traffic({int(k): float(n) for k, n in data["prefill"].items()},
                          {(int(b), int(c)): float(n) for b, c, n in data["decode"]},
                          {str(k): float(s) for k, s in data.get("seconds", {}).items()},
                          float(data["decode_work"]) if data.get("decode_work") is not None else None)
        cur = data["current"]
        current = Lists(tuple(cur["num_batched_tokens_buckets"]), tuple(cur["num_seqs_buckets"]),
                        tuple(cur["context_buckets"]))
        compile_seconds = {str(k): float(v) for k, v in data.get("compile_seconds", {}).items()}
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"{path} is not a valid served-shape summary: {type(e).__name__}: {e}") from None
    return limits, traffic, current, compile_seconds
