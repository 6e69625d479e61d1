"""The request fields that constrain the output -> one StructuredOutputsParams, validated before the
request starts (a bad schema is a 400, never a failed stream).

Sources, as in vLLM: `structured_outputs` (its options may accompany another source), the old
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` / `guided_whitespace_pattern`,
`structural_tag`, and `response_format` (`json_schema`, `json_object`, `structural_tag`, `text`).
"""
from __future__ import annotations

import re
from typing import Any

from vllm_neuron.entrypoints.openai.errors import BadRequestError
from vllm_neuron.structured_output.params import CONSTRAINT_FIELDS, StructuredOutputsParams

_ALIASES = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
            "guided_grammar": "grammar", "guided_whitespace_pattern": "whitespace_pattern",
            "structural_tag": "structural_tag"}
RESPONSE_FORMATS = ("text", "json_object", "json_schema", "structural_tag")


def _from_response_format(rf: Any) -> tuple[str, Any] | None:
    if rf is None:
        return None
    if not isinstance(rf, dict) or rf.get("type") not in RESPONSE_FORMATS:
        kind = rf.get("type") if isinstance(rf, dict) else rf
        raise BadRequestError(f"response_format type {kind!r} is not supported; valid types: "
                              f"{', '.join(RESPONSE_FORMATS)}.", param="response_format")
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return "json_object", True
    if kind == "structural_tag":
        return "structural_tag", {k: v for k, v in rf.items() if k != "type"} if "structures" in rf else rf
    spec = rf.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise BadRequestError("response_format of type json_schema needs `json_schema.schema`, a JSON schema "
                              "object.", param="response_format")
    return "json", schema


def structured_outputs_from_request(req: Any) -> tuple[StructuredOutputsParams | None, str | None]:
    """(params or None, the request field that gave the constraint, for error messages)."""
    base = getattr(req, "structured_outputs", None)
    if base is not None and not isinstance(base, dict):
        raise BadRequestError("`structured_outputs` must be an object.", param="structured_outputs")
    values: dict[str, Any] = dict(base or {})
    source = {k: "structured_outputs" for k in values}
    given: list[tuple[str, str, Any]] = []
    for field, target in _ALIASES.items():
        value = getattr(req, field, None)
        if value is not None:
            given.append((field, target, value))
    rf = _from_response_format(getattr(req, "response_format", None))
    if rf is not None:
        given.append(("response_format", *rf))
    for field, target, value in given:
        if target in values:
            raise BadRequestError(f"`{field}` and `{source[target]}` both set `{target}`; give it once.",
                                  param=field)
        values[target], source[target] = value, field
    if not values:
        return None, None
    constraint = [k for k in CONSTRAINT_FIELDS if values.get(k) not in (None, False)]
    param = source[constraint[0]] if len(constraint) == 1 else (
        source[constraint[-1]] if constraint else next(iter(source.values())))
    try:
        return StructuredOutputsParams.from_value(values), param
    except ValueError as e:
        # "structured_outputs.X ..." names the field; report the request field that gave X.
        named = re.match(r"structured_outputs\.(\w+)", str(e))
        if named and named.group(1) in source:
            param = source[named.group(1)]
        raise BadRequestError(str(e), param=param) from None
