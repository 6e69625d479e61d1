"""`vllm-neuron bench serve`: load an OpenAI-compatible server and print vLLM's result table.

Options carry vLLM's `vllm bench serve` names and defaults, with two documented differences:
  * --temperature defaults to 0 (greedy), so runs are comparable whatever the server's default.
  * --ignore-eos / --no-ignore-eos: unset means on for the synthetic datasets (random,
    prefix_repetition), whose output length is the point of the run, and off for sharegpt.
    (vLLM also forces it on for random.)

Usage: python -m vllm_neuron.benchmarks.serve --base-url http://127.0.0.1:8000 --num-prompts 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import httpx
import numpy as np
from tqdm import tqdm

from vllm_neuron.benchmarks.datasets import add_dataset_args, get_samples
from vllm_neuron.benchmarks.random_audio import rtf_section
from vllm_neuron.benchmarks.endpoint_request import (BACKENDS, RequestInput, RequestOutput,
                                                     fetch_first_model, send_request)
from vllm_neuron.benchmarks.prompts import SampleRequest
from vllm_neuron.benchmarks.result_table import (PERCENTILE_METRICS, compute_metrics,
                                                 failure_report, format_result_table,
                                                 result_dict)
from vllm_neuron.benchmarks.spec_decode_metrics import (SpecDecodeCounters, fetch_spec_decode_counters,
                                                      format_spec_decode_section, spec_decode_result)

_DEFAULT_ENDPOINTS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions",
                      "openai-embeddings": "/v1/embeddings", "openai-audio": "/v1/audio/transcriptions"}
# A benchmark request may legitimately run for a long time (long outputs, deep queues).
_REQUEST_TIMEOUT_S = 6 * 60 * 60


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Every `bench serve` option, added to the given parser."""
    add_dataset_args(parser)
    parser.add_argument("--backend", type=str, default="openai", choices=list(BACKENDS),
                        help="openai: /v1/completions; openai-chat: /v1/chat/completions; openai-audio: "
                        "/v1/audio/transcriptions (with --dataset-name random-audio).")
    parser.add_argument("--base-url", type=str, default=None,
                        help="Server base URL, e.g. http://127.0.0.1:8000 (default: from --host and --port).")
    parser.add_argument("--host", type=str, default="127.0.0.1", help="Server host, unless --base-url.")
    parser.add_argument("--port", type=int, default=8000, help="Server port, unless --base-url.")
    parser.add_argument("--endpoint", type=str, default=None,
                        help="API path (default: /v1/completions; /v1/chat/completions with "
                        "--backend openai-chat; /v1/embeddings with --backend openai-embeddings, which "
                        "--endpoint /v1/embeddings selects by itself).")
    parser.add_argument("--model", type=str, default=None,
                        help="Model name sent in requests (default: the first id listed by "
                        "GET /v1/models).")
    parser.add_argument("--served-model-name", type=str, default=None,
                        help="Name sent in requests when it differs from --model (default: --model).")
    parser.add_argument("--tokenizer", type=str, default=None,
                        help="Local tokenizer: an HF folder or a .gguf file (default: --model "
                        "when it is a local path, else the bundled model's tokenizer).")
    parser.add_argument("--api-key", type=str, default=None,
                        help="Bearer token (default: $OPENAI_API_KEY if set).")
    parser.add_argument("--max-concurrency", type=int, default=None,
                        help="Most requests in flight at once (default: no limit).")
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="Requests per second; inf sends all at once, otherwise arrivals "
                        "are a Poisson process (gamma with --burstiness != 1).")
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="Gamma shape of arrival gaps: 1 is Poisson, < 1 burstier, "
                        "> 1 more uniform. Only with a finite --request-rate.")
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                        help="Send ignore_eos so every request produces its full output "
                        "length (default: on for random and prefix_repetition, off for sharegpt).")
    parser.add_argument("--percentile-metrics", type=str, default="ttft,tpot,itl",
                        help="Comma-separated metrics with percentiles, of "
                        f"{','.join(PERCENTILE_METRICS)}.")
    parser.add_argument("--metric-percentiles", type=str, default="99",
                        help='Comma-separated percentiles, e.g. "50,90,99".')
    parser.add_argument("--num-warmups", type=int, default=0,
                        help="Requests sent (with the first prompt) before timing starts.")
    parser.add_argument("--disable-tqdm", action="store_true", help="No progress bar.")
    parser.add_argument("--profile", action="store_true",
                        help="POST /start_profile before the main run and /stop_profile after it (vLLM's flag; the "
                        "server needs VLLM_TORCH_PROFILER_DIR) and print the trace files.")
    parser.add_argument("--save-result", action="store_true",
                        help="Write the result json to --result-dir/--result-filename.")
    parser.add_argument("--result-dir", type=str, default=None,
                        help="Folder for the result json (default: current folder).")
    parser.add_argument("--result-filename", type=str, default=None,
                        help="Result file name (default: {label}-{rate}qps[-concurrencyN]-{model}-{date}.json).")
    parser.add_argument("--label", type=str, default=None,
                        help="Result file prefix (default: --backend).")
    sampling = parser.add_argument_group("sampling parameters")
    sampling.add_argument("--temperature", type=float, default=0.0,
                          help="Sent with every request; 0 is greedy.")
    sampling.add_argument("--top-p", type=float, default=None, help="Sent only if given (default: not sent).")
    sampling.add_argument("--top-k", type=int, default=None, help="Sent only if given (default: not sent).")
    sampling.add_argument("--min-p", type=float, default=None, help="Sent only if given (default: not sent).")
    parser.add_argument("--extra-body", type=json.loads, default=None,
                        help="JSON object merged into every request body (default: none).")


@dataclass
class BenchServeConfig:
    """The validated run settings derived from the parsed options."""

    base_url: str
    api_url: str
    backend: str
    model: str | None
    served_model_name: str | None
    headers: dict[str, str]
    ignore_eos: bool
    extra_body: dict[str, Any]
    request_rate: float
    burstiness: float
    max_concurrency: int | None
    num_warmups: int
    selected_metrics: list[str]
    percentiles: list[float]
    disable_tqdm: bool
    seed: int

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "BenchServeConfig":
        if args.backend not in BACKENDS:
            raise ValueError(f"--backend must be one of {', '.join(BACKENDS)}; got {args.backend!r}")
        endpoint = args.endpoint or _DEFAULT_ENDPOINTS[args.backend]
        if args.backend == "openai" and endpoint.rstrip("/").endswith("/embeddings"):
            args.backend = "openai-embeddings"  # --endpoint /v1/embeddings alone means the embeddings backend
        if args.backend == "openai-chat" and not endpoint.rstrip("/").endswith("chat/completions"):
            raise ValueError(f"--backend openai-chat needs a chat completions --endpoint "
                             f"(e.g. /v1/chat/completions); got {endpoint!r}")
        if getattr(args, "dataset_name", None) == "random-mm" and args.backend != "openai-chat":
            raise ValueError("--dataset-name random-mm sends images in chat content parts: use --backend openai-chat")
        if (getattr(args, "dataset_name", None) == "random-audio") != (args.backend == "openai-audio"):
            raise ValueError("--dataset-name random-audio and --backend openai-audio go together (clips uploaded to "
                             "/v1/audio/transcriptions)")
        if args.base_url:
            base_url = args.base_url.rstrip("/")
        else:
            host = f"[{args.host}]" if ":" in args.host else args.host
            base_url = f"http://{host}:{args.port}"
        if args.max_concurrency is not None and args.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
        if not args.request_rate > 0:
            raise ValueError(f"--request-rate must be > 0 (or inf), got {args.request_rate}")
        if not args.burstiness > 0:
            raise ValueError(f"--burstiness must be > 0, got {args.burstiness}")
        if args.num_warmups < 0:
            raise ValueError(f"--num-warmups must be >= 0, got {args.num_warmups}")
        metrics = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
        bad = [m for m in metrics if m not in PERCENTILE_METRICS]
        if bad:
            raise ValueError(f"--percentile-metrics: unknown {bad}; valid: "
                             f"{', '.join(PERCENTILE_METRICS)}")
        try:
            percentiles = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
        except ValueError:
            raise ValueError("--metric-percentiles must be comma-separated numbers in (0, 100], "
                             f"got {args.metric_percentiles!r}") from None
        if not percentiles or any(not 0 < p <= 100 for p in percentiles):
            raise ValueError("--metric-percentiles must be comma-separated numbers in (0, 100], "
                             f"got {args.metric_percentiles!r}")
        if args.extra_body is not None and not isinstance(args.extra_body, dict):
            raise ValueError("--extra-body must be a JSON object")
        ignore_eos = args.ignore_eos
        if ignore_eos is None:
            ignore_eos = args.dataset_name in ("random", "prefix_repetition")
        sampling = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
                    "min_p": getattr(args, "min_p", None)}
        extra = {k: v for k, v in sampling.items() if v is not None}
        extra.update(args.extra_body or {})
        api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        return cls(base_url=base_url, api_url=base_url + endpoint, backend=args.backend,
                   model=args.model, served_model_name=args.served_model_name,
                   headers=headers, ignore_eos=ignore_eos, extra_body=extra,
                   request_rate=args.request_rate, burstiness=args.burstiness,
                   max_concurrency=args.max_concurrency, num_warmups=args.num_warmups,
                   selected_metrics=metrics, percentiles=percentiles,
                   disable_tqdm=args.disable_tqdm, seed=args.seed)


def arrival_offsets(num_requests: int, request_rate: float, burstiness: float = 1.0,
                    seed: int = 0) -> list[float]:
    """Send time of each request, in seconds after the first, for the given rate.

    Gaps are gamma distributed (shape = burstiness, mean = 1/rate; Poisson for 1). As vLLM
    does, the sum is rescaled so the last request goes out at num_requests / rate: otherwise a
    seed's random total would shift the measured throughput by a few percent.
    """
    if request_rate == float("inf"):
        return [0.0] * num_requests
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness),
                     size=num_requests)
    times = np.cumsum(gaps)
    if times[-1] > 0:
        times *= (num_requests / request_rate) / times[-1]
    return times.tolist()


def load_bench_tokenizer(tokenizer: str | None, model: str | None) -> tuple[Any, str]:
    """(tokenizer, its id). Only local files: nothing is ever fetched from a model hub."""
    path = tokenizer
    if path is None and model and os.path.exists(model):
        path = model
    if path is None:
        # Imported here: the loader pulls in model code that a pure client rarely needs.
        from vllm_neuron.model.loader import load_tokenizer
        return load_tokenizer(None), "bundled"
    if not os.path.exists(path):
        raise ValueError(f"--tokenizer {path!r} is not a local folder or .gguf file "
                         "(nothing is downloaded from a model hub)")
    from transformers import AutoTokenizer
    if path.endswith(".gguf"):
        tok = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                            gguf_file=os.path.basename(path))
    else:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return tok, path


def _request_input(cfg: BenchServeConfig, model: str, sample: SampleRequest) -> RequestInput:
    return RequestInput(api_url=cfg.api_url, model=model, prompt=sample.prompt,
                        prompt_len=sample.prompt_len, output_len=sample.expected_output_len,
                        chat=cfg.backend == "openai-chat", ignore_eos=cfg.ignore_eos,
                        extra_body=cfg.extra_body, headers=cfg.headers,
                        multi_modal_content=sample.multi_modal_content,
                        embeddings=cfg.backend == "openai-embeddings", audio=sample.audio,
                        audio_seconds=sample.audio_seconds)


async def _run_requests(client: httpx.AsyncClient, inputs: list[RequestInput],
                        offsets: list[float], max_concurrency: int | None,
                        pbar: tqdm | None, done: list[RequestOutput] | None = None) -> list[RequestOutput]:
    """Sends every request on its schedule; each finished one is also appended to `done`, so that an
    interrupted run still has what it measured."""
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def one(req: RequestInput) -> RequestOutput:
        if semaphore is None:
            out = await send_request(client, req)
        else:
            async with semaphore:
                out = await send_request(client, req)
        if done is not None:
            done.append(out)
        if pbar is not None:
            pbar.update(1)
        return out

    start = time.perf_counter()
    tasks = []
    try:
        for req, offset in zip(inputs, offsets):
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(req)))
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()


async def _profile(client: httpx.AsyncClient, cfg: BenchServeConfig, action: str) -> list[str]:
    """POST /start_profile or /stop_profile; the trace files (stop); ValueError with the server's refusal."""
    r = await client.post(f"{cfg.base_url}/{action}_profile", headers=cfg.headers)
    if r.status_code != 200:
        try:
            why = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            why = r.text[:300]
        raise ValueError(f"--profile: POST /{action}_profile answered {r.status_code}: {why}")
    return r.json().get("traces", []) if action == "stop" else []


async def _until_interrupted(coro: Any) -> tuple[Any, bool]:
    """(result, False), or (None, True) when Ctrl-C (SIGINT) arrives first: the run is cancelled and the
    caller reports what finished before it."""
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(coro)
    try:
        loop.add_signal_handler(signal.SIGINT, task.cancel)
    except (NotImplementedError, RuntimeError):  # not the main thread / no signal support
        return await task, False
    try:
        return await task, False
    except asyncio.CancelledError:
        if asyncio.current_task().cancelling():  # our caller is being cancelled, not an interrupt
            raise
        return None, True
    finally:
        loop.remove_signal_handler(signal.SIGINT)


async def run_benchmark(cfg: BenchServeConfig, args: argparse.Namespace,
                        tokenizer: Any = None) -> dict[str, Any]:
    """Run the whole benchmark; print the table; return vLLM-keyed results."""
    limits = httpx.Limits(max_connections=cfg.max_concurrency,
                          max_keepalive_connections=cfg.max_concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(_REQUEST_TIMEOUT_S),
                                 limits=limits) as client:
        model_id = cfg.model
        if model_id is None:
            print("Model not specified, fetching first model from server...")
            model_id = await fetch_first_model(client, cfg.base_url, cfg.headers)
            print(f"First model name: {model_id}")
        model_name = cfg.served_model_name or model_id
        tokenizer_id = "provided"
        if tokenizer is None:
            tokenizer, tokenizer_id = load_bench_tokenizer(args.tokenizer, model_id)
        samples = get_samples(args, tokenizer)
        inputs = [_request_input(cfg, model_name, s) for s in samples]

        if cfg.num_warmups > 0:
            print(f"Warming up with {cfg.num_warmups} requests...")
            await _run_requests(client, [inputs[0]] * cfg.num_warmups,
                                [0.0] * cfg.num_warmups, cfg.max_concurrency, None)
            print("Warmup run completed.")

        print("Starting main benchmark run...")
        distribution = "Poisson process" if cfg.burstiness == 1.0 else "Gamma distribution"
        print(f"Traffic request rate: {cfg.request_rate}")
        print(f"Burstiness factor: {cfg.burstiness} ({distribution})")
        print(f"Maximum request concurrency: {cfg.max_concurrency}")
        spec_before = await fetch_spec_decode_counters(client, cfg.base_url, cfg.headers)
        if args.profile:
            await _profile(client, cfg, "start")
        offsets = arrival_offsets(len(inputs), cfg.request_rate, cfg.burstiness, cfg.seed)
        pbar = None if cfg.disable_tqdm else tqdm(total=len(inputs), desc="Requests", unit="req")
        t0 = time.perf_counter()
        done: list[RequestOutput] = []
        outputs, interrupted = await _until_interrupted(
            _run_requests(client, inputs, offsets, cfg.max_concurrency, pbar, done))
        duration = time.perf_counter() - t0
        if pbar is not None:
            pbar.close()
        if interrupted:
            outputs = list(done)
            print(f"Interrupted after {duration:.1f} s: {len(outputs)} of {len(inputs)} requests finished; "
                  "the results below cover those only.")
        spec_after = await fetch_spec_decode_counters(client, cfg.base_url, cfg.headers)
        if args.profile:
            traces = await _profile(client, cfg, "stop")
            print("Profile traces (Perfetto: https://ui.perfetto.dev):", *traces, sep="\n  ")
    spec = spec_after.minus(spec_before or SpecDecodeCounters()) if spec_after is not None else None

    metrics = compute_metrics(outputs, duration, tokenizer, cfg.percentiles)
    report = failure_report(outputs)
    if report:
        print(report)
    table = format_result_table(metrics, cfg.max_concurrency, cfg.request_rate, cfg.selected_metrics)
    if spec is not None:  # vLLM's place for it: before the closing rule
        head, _, rule = table.rpartition("\n")
        table = f"{head}\n{format_spec_decode_section(spec)}\n{rule}"
    audio = [(i.audio_seconds, o) for i, o in zip(inputs, outputs) if i.audio is not None and o.success]
    if audio:
        head, _, rule = table.rpartition("\n")
        table = f"{head}\n{rtf_section(sum(a for a, _ in audio), duration, [a / o.latency for a, o in audio])}\n{rule}"
    print(table)
    result: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": cfg.backend,
        "backend": cfg.backend,
        "label": args.label,
        "model_id": model_id,
        "tokenizer_id": tokenizer_id,
        "num_prompts": len(outputs),
        "interrupted": interrupted,
        "request_rate": cfg.request_rate if cfg.request_rate != float("inf") else "inf",
        "burstiness": cfg.burstiness,
        "max_concurrency": cfg.max_concurrency,
    }
    result.update(result_dict(metrics, outputs, cfg.selected_metrics))
    if audio:
        result["audio_seconds"] = sum(a for a, _ in audio)
        result["real_time_factor"] = result["audio_seconds"] / duration if duration else 0.0
    if spec is not None:
        result.update(spec_decode_result(spec))
    if args.save_result:
        path = _result_path(args, cfg, model_id, result["date"])
        with open(path, "w", encoding="utf-8") as f:
            json.dump(result, f)
        print(f"Results saved to {path}")
    return result


def _result_path(args: argparse.Namespace, cfg: BenchServeConfig, model_id: str,
                 date: str) -> str:
    concurrency = f"-concurrency{cfg.max_concurrency}" if cfg.max_concurrency else ""
    base_model = model_id.rstrip("/").split("/")[-1]
    name = args.result_filename or (
        f"{args.label or cfg.backend}-{cfg.request_rate}qps{concurrency}-{base_model}-{date}.json")
    if args.result_dir:
        os.makedirs(args.result_dir, exist_ok=True)
        name = os.path.join(args.result_dir, name)
    return name


def main(args: argparse.Namespace, tokenizer: Any = None) -> dict[str, Any]:
    """Entry point for `vllm-neuron bench serve`; tokenizer overrides --tokenizer (tests)."""
    cfg = BenchServeConfig.from_args(args)
    return asyncio.run(run_benchmark(cfg, args, tokenizer))


def _cli(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m vllm_neuron.benchmarks.serve",
                                     description="Benchmark an OpenAI-compatible server.")
    add_cli_args(parser)
    args = parser.parse_args(argv)
    try:
        result = main(args)
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if result.get("interrupted"):
        sys.exit(130)  # the shell's code for Ctrl-C, after the partial table


if __name__ == "__main__":
    _cli()
