"""xgrammar: tokenizer info, one GrammarCompiler per tokenizer info, and StructuredOutputsParams ->
CompiledGrammar with errors turned into ValueErrors that name the problem.

Compiled grammars are kept for reuse in a `GrammarCache`, keyed by the grammar's text, least recently used
first out, bounded by their `memory_size_bytes` (`--grammar-cache-bytes`; a compiled JSON schema takes
megabytes: 4 MB for a few properties with the 49k-token vocabulary, 18 MB for 3,000). xgrammar's own cache is
off: with its limit at 16 MB, 3,000 distinct schemas left the process 140 MB larger (flat without it).
"""
from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import Any

import xgrammar as xgr

from vllm_neuron.config.grammar_limits import DEFAULT_CACHE_BYTES
from vllm_neuron.structured_output.params import StructuredOutputsParams, unsupported_json_schema_feature

# "[13:51:04] /project/cpp/json_schema_converter.cc:5082: message" -> "message"
_NATIVE_PREFIX = re.compile(r"^\s*\[[0-9:]+\]\s+\S+:\d+:\s*")
# Whitespace characters allowed between two JSON tokens when any whitespace is allowed: enough for
# pretty-printed JSON (indent 4 at depth 7), while a weak model can no longer emit whitespace until
# max_tokens cuts the JSON short.
MAX_JSON_WHITESPACE = 32
_lock = threading.Lock()
_tokenizer_infos: dict[tuple[int, int | None], tuple[Any, Any]] = {}
_caches: dict[tuple[int, int], tuple[Any, Any]] = {}


def make_tokenizer_info(tokenizer: Any, vocab_size: int | None = None) -> xgr.TokenizerInfo:
    """The tokenizer's xgrammar TokenizerInfo; `vocab_size` is the model's (rows of its logits), at
    least the tokenizer's. Cached per tokenizer object (building one takes ~0.1-1 s)."""
    key = (id(tokenizer), vocab_size)
    with _lock:
        hit = _tokenizer_infos.get(key)
        if hit is not None and hit[0] is tokenizer:
            return hit[1]
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    with _lock:
        # The tokenizer is kept alive with its info so that its id is not reused.
        _tokenizer_infos[key] = (tokenizer, info)
    return info


def new_compiler(tokenizer_info: xgr.TokenizerInfo, max_threads: int = 2) -> xgr.GrammarCompiler:
    """A compiler without xgrammar's cache (GrammarCache keeps what is reused)."""
    return xgr.GrammarCompiler(tokenizer_info, max_threads=max_threads, cache_enabled=False)


class GrammarCache:
    """Compiled grammars by key (StructuredOutputsParams.key()), least recently used out first, at most
    `max_bytes` of them (0: none kept). Thread-safe; a compilation runs outside the lock."""

    def __init__(self, compiler: xgr.GrammarCompiler, max_bytes: int) -> None:
        self.compiler = compiler
        self.max_bytes = max_bytes
        self.size_bytes = 0
        self._lock = threading.Lock()
        self._grammars: OrderedDict[str, xgr.CompiledGrammar] = OrderedDict()

    def get(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """The compiled grammar of `params`, compiled now when it is not kept (ValueError naming the problem)."""
        key = params.key()
        with self._lock:
            hit = self._grammars.get(key)
            if hit is not None:
                self._grammars.move_to_end(key)
                return hit
        grammar = compile_params(self.compiler, params)
        size = grammar.memory_size_bytes
        with self._lock:
            if key not in self._grammars and size <= self.max_bytes:
                self._grammars[key] = grammar
                self.size_bytes += size
                while self.size_bytes > self.max_bytes:
                    _, old = self._grammars.popitem(last=False)
                    self.size_bytes -= old.memory_size_bytes
        return grammar


def grammar_cache_for(tokenizer_info: xgr.TokenizerInfo, cache_bytes: int, max_threads: int = 2) -> GrammarCache:
    """The shared cache (and compiler) of `tokenizer_info` (one per tokenizer info and cache size)."""
    key = (id(tokenizer_info), cache_bytes)
    with _lock:
        hit = _caches.get(key)
        if hit is not None and hit[0] is tokenizer_info:
            return hit[1]
        cache = GrammarCache(new_compiler(tokenizer_info, max_threads), cache_bytes)
        _caches[key] = (tokenizer_info, cache)
        return cache


def native_message(e: BaseException) -> str:
    """xgrammar's error text without the C++ source location."""
    lines = [_NATIVE_PREFIX.sub("", line).strip() for line in str(e).strip().splitlines()]
    return " ".join(line for line in lines if line) or type(e).__name__


def choice_grammar(choices: list[str]) -> str:
    # JSON string escapes are also EBNF string-literal escapes.
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def compile_params(compiler: xgr.GrammarCompiler, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
    """Compiles one constraint; ValueError naming the field and the problem."""
    kind = params.kind
    any_ws = not params.disable_any_whitespace
    if kind == "json":
        schema = params.schema()
        problem = unsupported_json_schema_feature(schema)
        if problem:
            raise ValueError(f"structured_outputs.json: the JSON schema uses a feature that cannot be "
                             f"enforced: {problem}")
        text = params.json if isinstance(params.json, str) else json.dumps(schema, ensure_ascii=False)
        return _native("json", "invalid JSON schema", compiler.compile_json_schema, text, any_whitespace=any_ws,
                       max_whitespace_cnt=MAX_JSON_WHITESPACE if any_ws else None)
    if kind == "json_object":
        return _native("json_object", "invalid", compiler.compile_json_schema, '{"type": "object"}',
                       any_whitespace=any_ws, strict_mode=False,
                       max_whitespace_cnt=MAX_JSON_WHITESPACE if any_ws else None)
    if kind == "regex":
        return _native("regex", "invalid regex", compiler.compile_regex, params.regex)
    if kind == "choice":
        return _native("choice", "invalid choices", compiler.compile_grammar, choice_grammar(params.choice))
    if kind == "grammar":
        if "::=" in params.grammar:
            return _native("grammar", "invalid EBNF grammar", compiler.compile_grammar, params.grammar)
        # No EBNF rule: a Lark grammar (vLLM accepts both).
        grammar = _native("grammar", "invalid Lark grammar", xgr.Grammar.from_lark, params.grammar)
        return _native("grammar", "invalid grammar", compiler.compile_grammar, grammar)
    return _compile_structural_tag(compiler, params.structural_tag)


def _compile_structural_tag(compiler: xgr.GrammarCompiler, tag: str | dict) -> xgr.CompiledGrammar:
    if isinstance(tag, str):
        try:
            tag = json.loads(tag)
        except json.JSONDecodeError as e:
            raise ValueError(f"structured_outputs.structural_tag is not valid JSON: {e}") from None
    if not isinstance(tag, dict):
        raise ValueError("structured_outputs.structural_tag must be a JSON object")
    if "structures" in tag:  # vLLM's original form: {"structures": [{begin, schema, end}], "triggers": [...]}
        try:
            items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                     for s in tag["structures"]]
            triggers = list(tag["triggers"])
        except (KeyError, TypeError) as e:
            raise ValueError("structured_outputs.structural_tag: each of `structures` needs begin, schema and "
                             f"end, and `triggers` must be a list ({type(e).__name__}: {e})") from None
        for s in tag["structures"]:
            problem = unsupported_json_schema_feature(s["schema"])
            if problem:
                raise ValueError(f"structured_outputs.structural_tag: a schema uses a feature that cannot be "
                                 f"enforced: {problem}")
        return _native("structural_tag", "invalid structural tag", compiler.compile_structural_tag, items, triggers)
    return _native("structural_tag", "invalid structural tag", compiler.compile_structural_tag, json.dumps(tag))


def _native(field: str, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
    except ValueError:
        raise
    except Exception as e:  # xgrammar raises RuntimeError / its own error types from native code
        raise ValueError(f"structured_outputs.{field}: {what}: {native_message(e)}") from None


def compile_cached(params: StructuredOutputsParams, tokenizer_info: xgr.TokenizerInfo,
                   cache_bytes: int = DEFAULT_CACHE_BYTES) -> xgr.CompiledGrammar:
    """compile_params through the shared GrammarCache of `tokenizer_info`."""
    return grammar_cache_for(tokenizer_info, cache_bytes).get(params)


def validate(params: StructuredOutputsParams, tokenizer_info: xgr.TokenizerInfo,
             cache_bytes: int = DEFAULT_CACHE_BYTES) -> None:
    """Compiles the constraint against `tokenizer_info` (compiled grammars are cached by their text):
    ValueError naming the problem when it is invalid or would not be enforced in full."""
    compile_cached(params, tokenizer_info, cache_bytes)
