"""A JSON route's body, checked before any work: media type (415), size (413, from Content-Length
before reading, then while reading), the time to read it (408: a body that stops short of its
Content-Length cannot hold a connection), JSON syntax, numbers (NaN / Infinity, which are not JSON,
and integers longer than Python converts) and nesting depth (400), and lone UTF-16 surrogates, which
JSON allows as escapes but no tokenizer takes: each is replaced by U+FFFD, as a UTF-8 decoder with
errors="replace" would (the request is served, not refused).
"""
from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from fastapi import Request

from vllm_neuron.entrypoints.openai.errors import (BadRequestError, RequestTimeoutError, RequestTooLargeError,
                                                   UnsupportedMediaTypeError)

MAX_JSON_DEPTH = 64  # tool schemas and chat_template_kwargs nest a few levels; nothing needs more
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def check_media_type(request: Request) -> None:
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        shown = media_type or "none"
        raise UnsupportedMediaTypeError(f"Unsupported Media Type: only 'application/json' is allowed, got {shown}.")


async def read_body(request: Request, max_bytes: int, timeout_s: float | None = None) -> bytes:
    """The body, or RequestTooLargeError as soon as it is known to exceed `max_bytes`, or RequestTimeoutError
    when the whole of it has not arrived `timeout_s` seconds after its first read (a deadline for the body,
    not per chunk: a client sending a byte now and then cannot hold the connection either)."""
    too_large = RequestTooLargeError(f"The request body exceeds the server's limit of {max_bytes} bytes "
                                     "(--max-request-body-bytes).")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise too_large
    chunks, size = [], 0
    stream = request.stream()
    loop = asyncio.get_running_loop()
    deadline = None if timeout_s is None else loop.time() + timeout_s
    try:
        while True:
            try:
                if deadline is None:
                    chunk = await anext(stream)
                else:
                    chunk = await asyncio.wait_for(anext(stream), max(0.0, deadline - loop.time()))
            except StopAsyncIteration:
                break
            except asyncio.TimeoutError:
                raise RequestTimeoutError(f"The request body did not arrive within {timeout_s:g} s "
                                          f"({size} bytes read; --body-read-timeout).") from None
            size += len(chunk)
            if size > max_bytes:
                raise too_large
            chunks.append(chunk)
    finally:
        await stream.aclose()
    return b"".join(chunks)


def json_depth_exceeds(value: Any, limit: int) -> bool:
    """Whether containers nest deeper than `limit` (iterative: no recursion on hostile input)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


def replace_lone_surrogates(value: Any) -> Any:
    if isinstance(value, str):
        return _LONE_SURROGATE.sub("\ufffd", value)
    if isinstance(value, list):
        return [replace_lone_surrogates(v) for v in value]
    if isinstance(value, dict):
        return {replace_lone_surrogates(k): replace_lone_surrogates(v) for k, v in value.items()}
    return value


def _not_json_constant(name: str) -> Any:
    raise _NonFiniteNumber(name)


class _NonFiniteNumber(ValueError):
    pass


def parse_json_object(raw: bytes) -> dict:
    """Decodes a body that must be a JSON object; BadRequestError otherwise."""
    try:
        # Python's decoder takes NaN, Infinity and -Infinity, which JSON does not have: a NaN would reach
        # sampling parameters (logit_bias, penalties) that compare it with nothing.
        data = json.loads(raw, parse_constant=_not_json_constant)
    except _NonFiniteNumber as e:
        raise BadRequestError(f"Invalid JSON body: {e} is not a JSON number (JSON has no NaN or Infinity).") from None
    except RecursionError:  # the C decoder stops at the interpreter's recursion limit
        raise BadRequestError(f"Invalid JSON body: nested deeper than {MAX_JSON_DEPTH} levels.") from None
    except ValueError as e:
        # JSONDecodeError and UnicodeDecodeError are ValueErrors, and so is the refusal of an integer of more
        # digits than int() converts (sys.get_int_max_str_digits(), 4300 by default).
        message = str(e).split("; use sys.set_int_max_str_digits", 1)[0]
        raise BadRequestError(f"Invalid JSON body: {message}") from None
    if not isinstance(data, dict):
        raise BadRequestError(f"The request body must be a JSON object, got {type(data).__name__}.")
    # A body with few brackets cannot nest deeply: the walk is only for those with many.
    if raw.count(b"{") + raw.count(b"[") > MAX_JSON_DEPTH and json_depth_exceeds(data, MAX_JSON_DEPTH):
        raise BadRequestError(f"Invalid JSON body: nested deeper than {MAX_JSON_DEPTH} levels.")
    if _SURROGATE_ESCAPE.search(raw):
        data = replace_lone_surrogates(data)
    return data


async def read_json_body(request: Request, max_bytes: int, timeout_s: float | None = None) -> dict:
    check_media_type(request)
    return parse_json_object(await read_body(request, max_bytes, timeout_s))
