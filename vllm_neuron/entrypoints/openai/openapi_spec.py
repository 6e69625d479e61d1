"""/openapi.json as the routes really behave: the request bodies the JSON routes read themselves
(they take the raw request, so FastAPI cannot see them), every status code they answer with the
OpenAI error object, and the server's own limits (--max-n, --max-logprobs, the vocabulary) as
schema bounds. Checks that no schema can state (a prompt over the context length, n > 1 with greedy
sampling, ...) stay documented 400s.
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from vllm_neuron.entrypoints.openai.protocol import ErrorResponse
from vllm_neuron.entrypoints.openai.request_policy import RequestLimits
from vllm_neuron.entrypoints.openai.structured import RESPONSE_FORMATS

_REF = "#/components/schemas/{model}"
_ERRORS = {
    400: "Invalid request: bad JSON or field (the error's `param` names it), or a prompt over the context length",
    404: "Unknown model",
    408: "The request body did not arrive within --body-read-timeout",
    413: "Request body larger than --max-request-body-bytes",
    415: "Content-Type is not application/json",
    500: "The engine failed this request or is dead",
    503: "The server is still warming up",
}
_request_models: dict[str, type[BaseModel]] = {}
# What each response_format type needs besides `type` (structured.py reads them so).
_RESPONSE_FORMAT_VARIANTS = [
    {"properties": {"type": {"enum": ["text", "json_object"]}}},
    {"required": ["json_schema"], "properties": {"type": {"const": "json_schema"}, "json_schema": {
        "type": "object", "required": ["schema"], "properties": {"schema": {"type": "object"}}}}},
    # xgrammar's structural tag: a `format` object, or vLLM's original `structures` + `triggers`
    {"required": ["format"], "properties": {"type": {"const": "structural_tag"}, "format": {"type": "object"}}},
    {"required": ["structures", "triggers"], "properties": {"type": {"const": "structural_tag"},
                                                            "structures": {"type": "array"},
                                                            "triggers": {"type": "array"}}},
]
# Optional in the models (vLLM's shapes) but refused when missing or empty by the serving code.
_NON_EMPTY = {"CompletionRequest": ("prompt",), "ChatCompletionRequest": ("messages",),
              "TokenizeChatRequest": ("messages",)}


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": _REF.format(model=model.__name__)}


def _error(description: str) -> dict[str, Any]:
    return {"description": description, "model": ErrorResponse}


def request_body(*models: type[BaseModel]) -> dict[str, Any]:
    """openapi_extra of a JSON route whose body is one of `models`."""
    for m in models:
        _request_models[m.__name__] = m
    # anyOf: extra fields are allowed, so a body can match several (the route then picks by its fields).
    schema = _ref(models[0]) if len(models) == 1 else {"anyOf": [_ref(m) for m in models]}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def route_responses(model: type[BaseModel] | None, *, stream: bool = False,
                    auth: bool = False) -> dict[int | str, Any]:
    """model None: a JSON object the spec does not detail (the Responses API's)."""
    ok: dict[str, Any] = {"description": "Successful response"}
    if model is not None:
        ok["model"] = model
    else:
        ok["content"] = {"application/json": {"schema": {"type": "object"}}}
    if stream:
        ok["description"] += " (server-sent events when `stream` is true)"
        # Each event's data is one chunk object as JSON, an error object, or [DONE].
        ok["content"] = {"text/event-stream": {"schema": {}}}
    out: dict[int | str, Any] = {200: ok, **{code: _error(text) for code, text in _ERRORS.items()}}
    if auth:
        out[401] = _error("Missing or wrong API key")
    return out


HEALTH_RESPONSES: dict[int | str, Any] = {
    200: {"description": "The engine is ready", "content": {}},
    503: _error("Warming up, or the engine is dead"),
}
VERSION_RESPONSES: dict[int | str, Any] = {
    200: {"description": "The server version",
          "content": {"application/json": {"schema": {"type": "object", "required": ["version"],
                                                      "properties": {"version": {"type": "string"}}}}}},
}
METRICS_RESPONSES: dict[int | str, Any] = {
    200: {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}},
}


def _set_maximum(schema: dict[str, Any], field: str, maximum: int) -> None:
    prop = schema.get("properties", {}).get(field)
    if prop is None:
        return
    for option in prop.get("anyOf", [prop]):
        if option.get("type") == "integer":
            option["maximum"] = maximum


def _require_non_empty(schema: dict[str, Any], field: str) -> None:
    """`field` as the serving code reads it: required, no null, no empty string or list."""
    prop = schema.get("properties", {}).get(field)
    if prop is None:
        return
    options = [o for o in prop.pop("anyOf", [prop]) if o.get("type") != "null"]
    for o in options:
        o.pop("default", None)
        if o.get("type") == "string":
            o["minLength"] = 1
        elif o.get("type") == "array":
            o["minItems"] = 1
            if o.get("items", {}).get("type") in ("array", "string"):
                o["items"]["min" + ("Items" if o["items"]["type"] == "array" else "Length")] = 1
    prop.pop("default", None)
    if len(options) == 1:
        prop.update(options[0])
    else:
        prop["anyOf"] = options
    required = schema.setdefault("required", [])
    if field not in required:
        required.append(field)


def _bound_token_ids(schema: dict[str, Any], field: str, vocab_size: int) -> None:
    """Integer lists of `field` (at any list depth) hold token ids: 0 <= id < vocab_size."""
    def visit(node: dict[str, Any]) -> None:
        for option in node.get("anyOf", [node]):
            if option.get("type") == "integer":
                option.update(minimum=0, maximum=vocab_size - 1)
            elif option.get("type") == "array":
                visit(option.get("items", {}))

    prop = schema.get("properties", {}).get(field)
    if prop is not None:
        for option in prop.get("anyOf", [prop]):
            if option.get("type") == "array":
                visit(option.get("items", {}))


def install(app: FastAPI, limits: RequestLimits, max_logprobs: int, vocab_size: int) -> None:
    """Replaces app.openapi with one that adds the request models and the server's limits."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        root = getattr(app.state, "root_path", "")
        servers = [{"url": root}] if root else None  # --root-path: clients call through the prefix
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes, servers=servers)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for name, model in _request_models.items():
            schema = model.model_json_schema(ref_template=_REF)
            schemas.update(schema.pop("$defs", {}))
            schemas[name] = schema
            _set_maximum(schema, "n", limits.max_n)
            for field in _NON_EMPTY.get(name, ()):
                _require_non_empty(schema, field)
            for field in ("prompt", "tokens", "stop_token_ids", "allowed_token_ids"):
                _bound_token_ids(schema, field, vocab_size)
            for option in schema.get("properties", {}).get("response_format", {}).get("anyOf", []):
                if option.get("type") == "object":
                    option.update(required=["type"], properties={"type": {"enum": list(RESPONSE_FORMATS)}},
                                  anyOf=_RESPONSE_FORMAT_VARIANTS)
            if "chat_template" in schema.get("properties", {}) and not limits.trust_request_chat_template:
                schema["properties"]["chat_template"] = {"type": "null", "description": "refused with a 400 unless "
                                                         "the server runs with --trust-request-chat-template"}
            messages = schema.get("properties", {}).get("messages", {})
            if messages.get("type") == "array":
                messages["items"] = {
                    "type": "object", "required": ["role"], "additionalProperties": True,
                    "properties": {"role": {"type": "string", "minLength": 1}},
                    # content is required, except beside tool_calls (an assistant's call)
                    "anyOf": [{"required": ["content"], "properties": {"content": {"type": ["string", "array"]}}},
                              {"required": ["tool_calls"], "properties": {"tool_calls": {"type": "array",
                                                                                         "minItems": 1}}}]}
            if max_logprobs >= 0:
                for field in ("logprobs", "top_logprobs", "prompt_logprobs"):
                    _set_maximum(schema, field, max_logprobs)
        app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]
