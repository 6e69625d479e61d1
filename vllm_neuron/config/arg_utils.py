"""vLLM's command-line flags <-> EngineArgs fields, grouped by topic like vLLM's `--help`.

Flags for features that exist in vLLM but not here yet are still parsed, so that using one gives a
clear "not supported yet" error from EngineArgs instead of argparse's "unrecognized argument".
Help texts say what the engine accepts (tests/unit/test_cli_help.py checks the ones that list values).

Every flag has help text and shows its default exactly once: `HelpFormatter` appends "(default: X)"
unless the help already says "default" (write that when X alone would not tell, e.g. None). Add a
flag to a topic with `arg_group(parser, "cache").add_argument(...)`; tests/unit/test_cli_help.py walks
every parser and fails on a flag without help.
"""
from __future__ import annotations

import argparse
import json

from vllm_neuron.config.device import DEVICE_CHOICES, DTYPE_CHOICES
from vllm_neuron.config.pooler_config import CONVERTS, RUNNERS, TASKS
from vllm_neuron.config.engine_args import (BLOCK_SIZES, BUNDLED_MODEL_NAME, KV_CACHE_DTYPES, LOGPROBS_MODES,
                                            SCHEDULING_POLICIES, EngineArgs, option_names)
from vllm_neuron.config.generation_config import GENERATION_CONFIG_HELP
from vllm_neuron.config.neuron_config import QUANTIZATIONS
from vllm_neuron.config.speculative import SPECULATIVE_METHODS

# Topic groups in the order --help shows them (vLLM's config classes, by topic).
GROUPS = {
    "model": "Model: what is loaded and how it computes",
    "cache": "Cache: the paged KV cache",
    "scheduler": "Scheduler: batching, sequence limits, speculative decoding",
    "parallel": "Parallel: tensor / data / expert parallelism, KV transfer",
    "compilation": "Compilation: bucket graphs and neuron_config",
    "server": "Server: HTTP listener, authentication, logging",
    "frontend": "Frontend: OpenAI API behaviour (chat templates, tools, served names)",
    "multimodal": "Multimodal: images, video and audio (limits, processor options, local media)",
    "lora": "LoRA: adapters served beside the base model, chosen per request",
    "structured_outputs": "Structured outputs: how much grammar work one request may ask for",
}


class HelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" once, unless the help text already states its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "(default" in text.lower() or action.default is argparse.SUPPRESS or not action.option_strings:
            return text
        default = action.default
        if isinstance(default, bool) or default is None:
            default = {True: "on", False: "off", None: "off"}[default] if action.nargs == 0 else default
        return f"{text} (default: {default})"


def arg_group(parser: argparse.ArgumentParser, topic: str) -> argparse._ArgumentGroup:
    """The parser's group for `topic` (one of GROUPS), created on first use."""
    if topic not in GROUPS:
        raise ValueError(f"unknown argument group {topic!r}; valid groups: {list(GROUPS)}")
    title = GROUPS[topic]
    for g in parser._action_groups:
        if g.title == title:
            return g
    return parser.add_argument_group(title)


def _json_arg(value: str):
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None


def add_engine_args(parser: argparse.ArgumentParser, *, model_positional: bool = True) -> None:
    """The engine's flags. model_positional: MODEL is the first positional (serve, compile); without
    it (generate, whose positionals are the prompts) the model is `--model` only."""
    d = EngineArgs()
    g = arg_group(parser, "model")
    bundled = f"the bundled {BUNDLED_MODEL_NAME}"
    if model_positional:
        g.add_argument("model", nargs="?", default=None, metavar="MODEL",
                       help=f"HF model directory, .gguf file, or Hugging Face id org/name[:QUANT] (default: {bundled})")
        g.add_argument("--model", dest="model_flag", default=None, metavar="MODEL",
                       help="the same as the positional MODEL, vLLM's older spelling (default: the positional "
                       "MODEL, else the bundled model)")
    else:
        g.add_argument("--model", dest="model_flag", default=None, metavar="MODEL",
                       help=f"HF model directory, .gguf file, or Hugging Face id org/name[:QUANT] (default: {bundled})")
    g.add_argument("--tokenizer", default=None,
                   help="tokenizer directory, .gguf, or Hugging Face id (default: the model's)")
    g.add_argument("--revision", default=None,
                   help="branch, tag or commit of a model given by Hugging Face id (default: main)")
    g.add_argument("--tokenizer-revision", default=None,
                   help="branch, tag or commit of the tokenizer's repository (default: --revision)")
    g.add_argument("--download-dir", default=None,
                   help="cache folder for models by Hugging Face id (default: huggingface_hub's, $HF_HUB_CACHE)")
    g.add_argument("--hf-file", default=None,
                   help="the GGUF file of a GGUF repository given by id (default: llama.cpp's rule: the file named "
                   "with MODEL's :QUANT, else Q4_K_M, else the first)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="context length in tokens, prompt plus output (default: the model's)")
    g.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                   help="weight and activation dtype; auto: bfloat16 on CUDA and on CPUs with AVX512-BF16 or AMX, "
                   "else float32, and bfloat16 with neuron_config.quantization 'bf16' (the start-up log says which "
                   "and why)")
    g.add_argument("--device", default="auto", choices=DEVICE_CHOICES,
                   help="auto picks CUDA when present (unless VLLM_NEURON_CPU_MODE=1), else CPU")
    g.add_argument("--seed", type=int, default=d.seed, help="seed of the sampler's random numbers")
    g.add_argument("--max-logprobs", type=int, default=d.max_logprobs,
                   help="largest logprobs / top_logprobs a request may ask for (0 or more; -1: the whole vocabulary)")
    g.add_argument("--logits-processors", nargs="+", default=None, metavar="MODULE:CLASS",
                   help="custom logits processors (vLLM V1's batch-level interface) applied to every request on the "
                   "host sampler (default: none)")
    g.add_argument("--logprobs-mode", default=d.logprobs_mode, choices=LOGPROBS_MODES,
                   help="what logprobs report: the model's (raw_) or those the token is drawn from after penalties, "
                   "temperature, top-k / top-p (processed_); log-probabilities or logits")
    g.add_argument("--generation-config", default=d.generation_config,
                   help=f"default sampling parameters: {GENERATION_CONFIG_HELP}")
    g.add_argument("--override-generation-config", type=_json_arg, default=None,
                   help="JSON applied over the generation config, e.g. '{\"temperature\": 0.5, \"max_new_tokens\": "
                   "128}' (default: none)")
    g.add_argument("--quantization", "-q", default=None,
                   help="refused: vLLM's flag; use neuron_config.quantization in --additional-config ("
                   f"{', '.join(QUANTIZATIONS)}), or an FP8 checkpoint (default: unset)")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="accepted for vLLM compatibility; no remote code is ever run")
    g.add_argument("--enable-prompt-embeds", action="store_true",
                   help="accept prompt_embeds ([seq_len, hidden] tensors) in place of token ids")
    g.add_argument("--runner", default=d.runner, choices=RUNNERS,
                   help="generate or pooling (embeddings, classification, scores); auto: from the checkpoint's "
                   "architecture (*Model and *ForSequenceClassification pool, *ForCausalLM generates)")
    g.add_argument("--convert", default=d.convert, choices=CONVERTS,
                   help="run a causal LM as a pooling model: embed or classify (auto: the architecture's; "
                   "implies --runner pooling)")
    g.add_argument("--task", default=None, choices=tuple(TASKS),
                   help="the older spelling of --runner / --convert (embed = --convert embed, score and classify "
                   "= --convert classify) (default: unset)")
    g.add_argument("--pooler-config", type=_json_arg, default=None,
                   help='pooling models\' pooler, e.g. \'{"pooling_type": "MEAN", "normalize": true, "dimensions": '
                   "256}' (default: the checkpoint's sentence-transformers files, else last-token pooling, "
                   "normalized embeddings)")

    g = arg_group(parser, "cache")
    g.add_argument("--block-size", type=int, default=d.block_size, choices=BLOCK_SIZES,
                   help="KV cache block size in tokens")
    g.add_argument("--num-gpu-blocks-override", type=int, default=None,
                   help="number of KV cache blocks (default: as many as the memory budget allows)")
    g.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
                   help="fraction of device memory (host RAM on CPU) for the KV budget")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV blocks of identical prompt prefixes")
    g.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype, choices=KV_CACHE_DTYPES,
                   help="KV cache dtype: auto (the model dtype), or an FP8 KV cache with per-tensor scales: fp8 "
                   "(= fp8_e4m3), fp8_e4m3, fp8_e5m2")

    g = arg_group(parser, "scheduler")
    g.add_argument("--max-num-seqs", type=int, default=None,
                   help="max concurrent sequences (default: the largest num_seqs_bucket, else 16)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="max tokens per prefill step; longer prompts are segmented (default: the largest "
                   "num_batched_tokens_bucket, else min(512, max-model-len))")
    g.add_argument("--max-num-queued-reqs", type=int, default=None,
                   help="engine requests (running and waiting; n > 1 counts n) the server takes at once; beyond it "
                   "a request gets a 503 with Retry-After before any work is done for it (default: 16 x "
                   "max-num-seqs x data-parallel-size; 0: no bound)")
    g.add_argument("--scheduling-policy", default=d.scheduling_policy, choices=SCHEDULING_POLICIES,
                   help="fcfs: requests run in arrival order; priority: by each request's `priority` (lower first, "
                   "ties by arrival), and KV preemption takes the running request with the largest value first")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule step N+1 while step N runs (default: on, except on a CPU whose cores torch's "
                   "threads all use, with speculative decoding, and with CPU sampling)")
    g.add_argument("--speculative-config", type=_json_arg, default=None,
                   help='speculative decoding, vLLM\'s JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'; '
                   f"methods: {', '.join(SPECULATIVE_METHODS)} (eagle3 and dflash name their draft checkpoint in "
                   "\"model\"; a draft model runs whole on every tensor-parallel rank) (default: off)")

    g = arg_group(parser, "parallel")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="tensor parallel ranks (processes, CPU only for now; not with an audio model; a vision "
                   "model's encoder splits them by encoder_neuron_config tp_size / dp_size); each node's cores are "
                   "split between its ranks")
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                   help="pipeline stages: the decoder layers split into this many stages of consecutive layers, "
                   "each a process group of --tensor-parallel-size ranks (CPU, Llama and Qwen3); with --nnodes "
                   "the stages spread over nodes")
    g.add_argument("--decode-context-parallel-size", "-dcp", type=int, default=1,
                   help="ranks a sequence's KV is split over in decode: only 1 (on CPU ranks the per-layer merge "
                   "costs more than it saves; docs/features.md says why)")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="engine replicas behind one API server; each request goes to the least loaded one, or "
                   "to the one that cached its prompt's prefix")
    g.add_argument("--data-parallel-size-local", "-dpl", type=int, default=None,
                   help="replicas on this node; the others join from --headless nodes (default: all of them)")
    g.add_argument("--data-parallel-start-rank", "-dpr", type=int, default=d.data_parallel_start_rank,
                   help="rank of this node's first replica (a --headless node)")
    g.add_argument("--data-parallel-address", "-dpa", default=d.data_parallel_address,
                   help="the head node's address, where replicas on other nodes connect")
    g.add_argument("--data-parallel-rpc-port", "-dpp", type=int, default=d.data_parallel_rpc_port,
                   help="the head node's port for replicas on other nodes (trusted network only)")
    g.add_argument("--data-parallel-rank", type=int, default=None,
                   help="refused: external load balancing (one server per rank) is not supported yet (default: unset)")
    g.add_argument("--data-parallel-backend", "-dpb", default=d.data_parallel_backend, choices=("mp", "ray"),
                   help="how replicas start; only mp (multiprocessing)")
    g.add_argument("--data-parallel-hybrid-lb", action="store_true",
                   help="refused: per-node API servers are not supported yet; replicas join the head's router")
    g.add_argument("--enable-expert-parallel", action="store_true",
                   help="shard a mixture-of-experts model's experts over the tensor parallel ranks "
                   "(neuron_config.ep_degree, default: tensor-parallel-size); refused for a dense model and with "
                   "--data-parallel-size > 1")
    g.add_argument("--nnodes", type=int, default=1,
                   help="nodes the tensor parallel ranks span (tensor-parallel-size / nnodes ranks each)")
    g.add_argument("--node-rank", type=int, default=0, help="this node's index (0: the head, with the API server)")
    g.add_argument("--master-addr", default="127.0.0.1", help="address of node 0, where the ranks meet")
    g.add_argument("--master-port", type=int, default=29501, help="port of node 0 for the tensor parallel group")
    g.add_argument("--kv-transfer-config", type=_json_arg, default=None,
                   help='disaggregated prefill/decode: vLLM\'s JSON, e.g. {"kv_connector": "TcpConnector", '
                   '"kv_role": "kv_producer"} (default: none)')
    g.add_argument("--kv-offloading-size", type=float, default=None, metavar="GIB",
                   help="a second KV tier of this many GiB in the folder VLLM_NEURON_KV_OFFLOAD_DIR: prefix-cache "
                   "blocks written there are read back instead of prefilled, also after a restart (default: none)")
    g.add_argument("--kv-offloading-backend", default=None, metavar="NAME",
                   help="the second tier's backend: native, a folder (default: native with --kv-offloading-size)")
    g.add_argument("--ec-transfer-config", type=_json_arg, default=None,
                   help='encoder-disaggregated serving (EPD): vLLM\'s JSON, e.g. {"ec_connector": '
                   '"ECSharedStorageConnector", "ec_role": "ec_producer", "ec_connector_extra_config": '
                   '{"shared_storage_path": "/tmp/ec"}} (default: none)')
    g.add_argument("--mm-encoder-only", action="store_true",
                   help="an EPD encoder instance: the vision tower only, answering the epd-proxy's encode requests "
                   "(needs --ec-transfer-config with ec_role ec_producer)")

    g = arg_group(parser, "multimodal")
    g.add_argument("--limit-mm-per-prompt", type=_json_arg, default=None,
                   help='most media items per prompt, e.g. \'{"image": 4, "video": 1}\' (default: no limit but the context length)')
    g.add_argument("--mm-processor-kwargs", type=_json_arg, default=None,
                   help='image/video processor options, e.g. \'{"max_pixels": 1003520, "fps": 2}\' (default: the '
                   "checkpoint's preprocessor_config.json)")
    g.add_argument("--allowed-local-media-path", default=None,
                   help="folder whose files requests may name as file:// media URLs (default: none allowed)")
    g.add_argument("--allowed-media-domains", nargs="+", default=None, metavar="HOST",
                   help="the only hosts http(s) media URLs may name (redirects are checked too); loopback, "
                   "link-local and private addresses are refused unless their host is listed (default: any "
                   "public host)")

    g = arg_group(parser, "lora")
    g.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters (PEFT folders); a request picks one by its name in `model`")
    g.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help='adapters registered at start: name=path, or JSON {"name": ..., "path": ..., '
                   '"base_model_name": ...} (default: none)')
    g.add_argument("--max-loras", type=int, default=d.max_loras,
                   help="adapters resident on the device at once: the most distinct adapters in one batch")
    g.add_argument("--max-lora-rank", type=int, default=d.max_lora_rank,
                   help="the largest adapter rank served (the device slots are this wide)")
    g.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters kept in host memory, at least --max-loras (default: --max-loras)")

    g = arg_group(parser, "structured_outputs")
    g.add_argument("--grammar-max-properties", type=int, default=d.grammar_max_properties,
                   help="object properties one JSON schema (response_format, structured_outputs, tools) may have, "
                   "every level counted; a larger schema gets a 400 before it compiles")
    g.add_argument("--grammar-max-depth", type=int, default=d.grammar_max_depth,
                   help="subschemas a JSON schema may nest in one another")
    g.add_argument("--grammar-max-pattern-length", type=int, default=d.grammar_max_pattern_length,
                   help="characters of a schema's `pattern` or of a regex constraint")
    g.add_argument("--grammar-max-repeat", type=int, default=d.grammar_max_repeat,
                   help="largest repetition count ({m,n}) in a pattern or regex")
    g.add_argument("--grammar-max-bytes", type=int, default=d.grammar_max_bytes,
                   help="size of a constraint's text in bytes (the schema's JSON, a regex, an EBNF grammar, the "
                   "choices)")
    g.add_argument("--grammar-compile-timeout", type=float, default=d.grammar_compile_timeout,
                   help="seconds one grammar may take to compile (in a process of its own at low priority, "
                   "off the event loop and the engine's steps); a slower one is stopped and its request gets a 400")
    g.add_argument("--grammar-cache-bytes", type=int, default=d.grammar_cache_bytes,
                   help="bytes of compiled grammars kept for reuse, in the API server and in each engine process "
                   "(vllm_neuron:grammar_cache_bytes in /metrics); 0 keeps none")

    g = arg_group(parser, "compilation")
    g.add_argument("--enforce-eager", action="store_true",
                   help="run the bucket graphs uncompiled (on Model Runner V1 unless VLLM_USE_V2_MODEL_RUNNER=1)")
    g.add_argument("--additional-config", type=_json_arg, default=None,
                   help='JSON, e.g. \'{"neuron_config": {"num_seqs_buckets": [1, 2, 4, 8]}}\' (default: none; '
                   "the README lists the neuron_config keys)")

    g = arg_group(parser, "frontend")
    g.add_argument("--chat-template", default=None,
                   help="Jinja chat template, as text or a file path (default: the tokenizer's)")


def engine_args_from_cli(args: argparse.Namespace) -> EngineArgs:
    if getattr(args, "quantization", None):
        raise ValueError(f"--quantization {args.quantization} is not supported: keep it unset and use "
                         "neuron_config.quantization or a quantized checkpoint")
    model = getattr(args, "model", None)
    flag = getattr(args, "model_flag", None)
    if model and flag and model != flag:
        raise ValueError(f"conflicting models: positional {model!r} and --model {flag!r}")
    names = option_names()
    kwargs = {k: v for k, v in vars(args).items() if k in names and k != "model"}
    return EngineArgs.from_kwargs(model=model or flag, **kwargs)
