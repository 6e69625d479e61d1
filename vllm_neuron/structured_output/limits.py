"""A constraint's size, checked against `GrammarLimits` before anything compiles (pure).

Compilation cost grows with a schema's properties (faster than linearly: xgrammar spells out which
optional property may follow which), with the repetition counts of a `pattern` (quadratically), and with
the text of a regex or grammar. Each is bounded here, so that a request cannot make the server compile
for minutes; the compile time limit (checker.py, manager.py) catches what no size states.

A minimum the token budget cannot reach (`minLength`, `minItems`, `minProperties` above what `max_tokens`
tokens can write) is refused too: the output would run until max_tokens and end unparseable. Large
maxima are harmless (xgrammar compiles `maxLength: 1e9` in milliseconds) and pass.

Every error is a ValueError that starts with the request field (`structured_outputs.json: ...`), as the
compiler's own errors do.
"""
from __future__ import annotations

import json
import re
from typing import Any

from vllm_neuron.config.grammar_limits import GrammarLimits
from vllm_neuron.structured_output.params import SUB_DICT, SUB_LIST, SUB_ONE, StructuredOutputsParams

# {m}, {m,} and {m,n} not preceded by a backslash (an escaped brace is a literal).
_REPEAT = re.compile(r"(?<!\\)\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


def longest_token_chars(tokenizer: Any) -> int:
    """Characters the vocabulary's longest entry spells (byte-level entries spell one character per byte, so
    no token writes more characters of text than this)."""
    return max((len(t) for t in tokenizer.get_vocab()), default=1) or 1


def constraint_text(params: StructuredOutputsParams) -> str:
    """The constraint as text (what its size is measured on)."""
    value = getattr(params, params.kind)
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "\n".join(value)
    return json.dumps(value, ensure_ascii=False)


def check_constraint(params: StructuredOutputsParams, limits: GrammarLimits, max_tokens: int | None = None,
                     max_token_chars: int = 1) -> None:
    """ValueError naming the field and the limit the constraint exceeds. `max_tokens`: the request's token
    budget (None: not known, minimums unchecked); `max_token_chars`: the vocabulary's longest entry."""
    kind = params.kind
    where = f"structured_outputs.{kind}"
    size = len(constraint_text(params).encode("utf-8", errors="replace"))
    if size > limits.max_bytes:
        raise ValueError(f"{where}: the constraint is {size} bytes, more than this server compiles "
                         f"({limits.max_bytes}, --grammar-max-bytes)")
    if kind == "regex":
        check_pattern(params.regex, limits, where)
    elif kind == "grammar":
        _check_repeats(params.grammar, limits, where)
    elif kind == "json":
        check_schema(params.schema(), limits, where, max_tokens, max_token_chars)
    elif kind == "structural_tag":
        tag = params.structural_tag
        if isinstance(tag, str):
            try:
                tag = json.loads(tag)
            except json.JSONDecodeError:
                return  # the compiler names the syntax error
        _check_structural_tag(tag, limits, where, max_tokens, max_token_chars)


def check_pattern(pattern: str, limits: GrammarLimits, where: str) -> None:
    if len(pattern) > limits.max_pattern_length:
        raise ValueError(f"{where}: a pattern of {len(pattern)} characters is longer than this server compiles "
                         f"({limits.max_pattern_length}, --grammar-max-pattern-length)")
    _check_repeats(pattern, limits, where)


def _check_repeats(text: str, limits: GrammarLimits, where: str) -> None:
    for m in _REPEAT.finditer(text):
        counts = [int(g) for g in m.groups() if g]
        if max(counts) > limits.max_repeat:
            raise ValueError(f"{where}: the repetition {m.group(0)} counts beyond this server's limit of "
                             f"{limits.max_repeat} (--grammar-max-repeat)")


def check_schema(schema: Any, limits: GrammarLimits, where: str, max_tokens: int | None = None,
                 max_token_chars: int = 1) -> None:
    """Properties, nesting, patterns and unreachable minimums of a JSON schema (iterative: no recursion)."""
    properties = 0
    stack: list[tuple[Any, int, str]] = [(schema, 1, "#")]
    while stack:
        node, depth, path = stack.pop()
        if not isinstance(node, dict):
            continue
        if depth > limits.max_depth:
            raise ValueError(f"{where}: the JSON schema nests subschemas deeper than {limits.max_depth} levels "
                             f"(at {path}; --grammar-max-depth)")
        props = node.get("properties")
        if isinstance(props, dict):
            properties += len(props)
            if properties > limits.max_properties:
                raise ValueError(f"{where}: the JSON schema has more than {limits.max_properties} object "
                                 f"properties (--grammar-max-properties)")
        if isinstance(node.get("pattern"), str):
            check_pattern(node["pattern"], limits, f"{where} ({path}/pattern)")
        pattern_props = node.get("patternProperties")
        if isinstance(pattern_props, dict):
            for key in pattern_props:
                check_pattern(key, limits, f"{where} ({path}/patternProperties)")
        if max_tokens is not None:
            _check_minimums(node, max_tokens, max_token_chars, where, path)
        for kw in SUB_ONE:
            stack.append((node.get(kw), depth + 1, f"{path}/{kw}"))
        for kw in SUB_DICT:
            subs = node.get(kw)
            if isinstance(subs, dict):
                stack.extend((sub, depth + 1, f"{path}/{kw}/{name}") for name, sub in subs.items())
        for kw in SUB_LIST:
            subs = node.get(kw)
            if isinstance(subs, list):
                stack.extend((sub, depth + 1, f"{path}/{kw}/{i}") for i, sub in enumerate(subs))


def _check_minimums(node: dict, max_tokens: int, max_token_chars: int, where: str, path: str) -> None:
    """Minimums no output of `max_tokens` tokens reaches: a token writes at most `max_token_chars` characters
    of a string, and every array item or property takes a token at least."""
    reach = {"minLength": max_tokens * max_token_chars, "minItems": max_tokens, "minProperties": max_tokens}
    for kw, most in reach.items():
        value = node.get(kw)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > most:
            raise ValueError(f"{where}: `{kw}: {value}` at {path} cannot be met within max_tokens={max_tokens} "
                             f"(at most {most} reachable); the output would end unparseable at the token limit")


def _check_structural_tag(tag: Any, limits: GrammarLimits, where: str, max_tokens: int | None,
                          max_token_chars: int) -> None:
    """Every JSON schema and regex a structural tag holds, at any depth (both of vLLM's forms)."""
    stack = [tag]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            for key, value in node.items():
                if key in ("schema", "json_schema") and isinstance(value, (dict, bool)):
                    check_schema(value, limits, where, max_tokens, max_token_chars)
                elif key in ("pattern", "regex") and isinstance(value, str):
                    check_pattern(value, limits, where)
                elif isinstance(value, (dict, list)):
                    stack.append(value)
