"""The comparison table (one row per engine, then ours against the best peer) and the roofline."""

from __future__ import annotations

import glob
import os
import time
from dataclasses import dataclass, field

# (key, higher is better); the order the table shows them in.
FIGURES: tuple[tuple[str, bool], ...] = (
    ("p1_output_tok_s", True),
    ("p1_mean_ttft_ms", False), ("p1_median_tpot_ms", False),
    ("p2_mean_ttft_ms", False), ("p2_median_tpot_ms", False),
    ("p3_cold_mean_ttft_ms", False), ("p3_warm_mean_ttft_ms", False),
    ("p4_output_tok_s", True), ("p4_mean_ttft_ms", False), ("p4_median_tpot_ms", False),
    ("p4_8k_mean_ttft_ms", False), ("p4_8k_median_tpot_ms", False),
)
# Table columns: header and the figures shown in it, joined by " / ".
COLUMNS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("P1 output tok/s", ("p1_output_tok_s",)),
    ("P1 TTFT / TPOT (ms)", ("p1_mean_ttft_ms", "p1_median_tpot_ms")),
    ("P2 TTFT / TPOT (ms)", ("p2_mean_ttft_ms", "p2_median_tpot_ms")),
    ("P3 TTFT cold / warm (ms)", ("p3_cold_mean_ttft_ms", "p3_warm_mean_ttft_ms")),
    ("P4 tok/s / TTFT / TPOT (ms)", ("p4_output_tok_s", "p4_mean_ttft_ms", "p4_median_tpot_ms")),
    ("P4-8k TTFT / TPOT (ms)", ("p4_8k_mean_ttft_ms", "p4_8k_median_tpot_ms")),
)
OURS = "ours"


@dataclass
class EngineResult:
    """One engine's outcome: its figures (absent when not measured) and what went wrong, if anything."""

    name: str
    label: str
    status: str = "ok"
    install_seconds: float | None = None
    install_fresh: bool = False
    ready_seconds: float | None = None
    figures: dict[str, float] = field(default_factory=dict)
    runs: list[dict] = field(default_factory=list)


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}" if value >= 1000 else f"{value:.1f}"


def is_ours(name: str) -> bool:
    """Our engine, in any of its forms (`ours`, `ours-avx2`); the first one in a run is compared with the peers."""
    return name == OURS or name.startswith(OURS + "-")


def best_peer_ratios(results: list[EngineResult]) -> dict[str, float]:
    """ours / best peer, per figure that ours and at least one peer measured.

    The best peer is the highest for throughput and the lowest for times, so a ratio above 1 is
    a win for tok/s and a ratio below 1 is a win for times.
    """
    ours = next((r for r in results if is_ours(r.name)), None)
    if ours is None:
        return {}
    ratios = {}
    for key, higher in FIGURES:
        peer_values = [r.figures[key] for r in results
                       if not is_ours(r.name) and r.figures.get(key) is not None]
        if key not in ours.figures or not peer_values:
            continue
        best = max(peer_values) if higher else min(peer_values)
        if best > 0:
            ratios[key] = ours.figures[key] / best
    return ratios


def format_table(results: list[EngineResult]) -> str:
    """The markdown table: every engine, then the ratio row when ours ran beside a peer. The long-context
    columns (P4) show only when some engine measured them."""
    columns = [c for c in COLUMNS if not c[0].startswith("P4") or
               any(r.figures.get(k) is not None for r in results for k in c[1])]
    header = ["engine", *[c[0] for c in columns], "status"]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for r in results:
        cells = [" / ".join(_fmt(r.figures.get(k)) for k in keys) for _, keys in columns]
        lines.append("| " + " | ".join([r.label, *cells, r.status.replace("|", "/")]) + " |")
    ratios = best_peer_ratios(results)
    if ratios:
        cells = [" / ".join(f"{ratios[k]:.2f}x" if k in ratios else "-" for k in keys)
                 for _, keys in columns]
        lines.append("| " + " | ".join(["ours / best peer", *cells,
                                         ">1 wins for tok/s, <1 wins for times"]) + " |")
    return "\n".join(lines)


def weight_bytes_bf16(model_path: str) -> int:
    """Bytes of all weights at 2 bytes per element: what one decode step reads at batch 1.

    Tied embeddings are one tensor in the file and are read once per step (by the output layer;
    the embedding lookup reads one row), so counting each stored tensor once is right.
    """
    if model_path.endswith(".gguf"):
        import gguf

        reader = gguf.GGUFReader(model_path)
        return 2 * sum(int(t.n_elements) for t in reader.tensors)
    from safetensors import safe_open

    total = 0
    for path in sorted(glob.glob(os.path.join(model_path, "*.safetensors"))):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                n = 1
                for d in f.get_slice(name).get_shape():
                    n *= int(d)
                total += n
    if total == 0:
        raise ValueError(f"--model {model_path!r}: no .gguf file or *.safetensors weights found")
    return 2 * total


def measure_read_bandwidth(threads: int = 2, gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes per second of an fp32 sum over `gib` GiB with `threads` torch threads (best of N). The buffer lies in
    2 MiB pages where the kernel hands them out, as the engine keeps its weights: in 4 KiB pages the same sum read
    28.1 against 34.3 GB/s (1 GiB, 2-core Zen 4 VM, 2026-12-07), below what the engine's own weight streams reach."""
    import torch

    from vllm_neuron import huge_pages

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        n = int(gib * (1 << 30)) // 4
        x = huge_pages.zeros((n,), torch.float32) if huge_pages.available() else torch.zeros(n)
        x.fill_(1.0)
        x.sum()  # touch every page before timing
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            x.sum()
            best = min(best, time.perf_counter() - t0)
        nbytes = x.numel() * 4
        del x
        return nbytes / best
    finally:
        torch.set_num_threads(old)


def roofline_report(bandwidth_b_s: float, weight_bytes: int, ours_step_ms: float | None,
                    threads: int) -> tuple[str, dict]:
    """The printed roofline paragraph and its numbers."""
    roof_ms = weight_bytes / bandwidth_b_s * 1e3
    info = {"read_bandwidth_gb_s": bandwidth_b_s / 1e9, "weight_bytes_bf16": weight_bytes,
            "roofline_step_ms": roof_ms, "ours_step_ms": ours_step_ms,
            "source_of_ours_step": "median TPOT of P2 (batch 1, served)", "threads": threads}
    lines = [(f"Batch-1 decode roofline: {weight_bytes / 1e6:.0f} MB of bf16 weights per step / "
              f"{bandwidth_b_s / 1e9:.1f} GB/s read bandwidth (fp32 sum of 1 GiB, 2 MiB pages where available, {threads} "
              f"threads) = {roof_ms:.1f} ms per step ({1e3 / roof_ms:.0f} steps/s).")]
    if ours_step_ms:
        info["fraction_of_roofline"] = roof_ms / ours_step_ms
        lines.append(f"Ours (median TPOT of P2, batch 1): {ours_step_ms:.1f} ms per step "
                     f"({1e3 / ours_step_ms:.0f} steps/s) = {100 * roof_ms / ours_step_ms:.0f}% "
                     f"of the roofline.")
    else:
        lines.append("Ours: no batch-1 step measured (run P2 with --peers including ours).")
    return "\n".join(lines), info
