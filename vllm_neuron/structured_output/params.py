"""`StructuredOutputsParams` (vLLM's fields) and its validation.

Torch-free and xgrammar-free at import: SamplingParams (imported by the scheduler) holds these.
Compiling one (`compiler.validate`) is the compiler's job; this module imports nothing of it.

xgrammar silently ignores some JSON-schema keywords; a schema using one would yield output that does
not validate, so `unsupported_json_schema_feature` refuses them up front (checked against xgrammar
0.2.9: each keyword listed was accepted by the compiler and not enforced by the matcher).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

# Constraint fields: exactly one must be set.
CONSTRAINT_FIELDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")

# String formats xgrammar turns into a grammar; any other `format` would be ignored.
SUPPORTED_STRING_FORMATS = frozenset({
    "email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid", "uri",
    "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"})
# Keywords xgrammar accepts but does not enforce, wherever they appear.
_IGNORED_KEYWORDS = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies",
                     "uniqueItems", "contains", "minContains", "maxContains", "$dynamicRef",
                     "$dynamicAnchor", "$recursiveRef")
# Keywords whose value is one subschema / a dict of subschemas / a list of subschemas.
SUB_ONE = ("additionalProperties", "unevaluatedProperties", "propertyNames", "additionalItems",
            "unevaluatedItems", "items")
SUB_DICT = ("properties", "patternProperties", "$defs", "definitions")
SUB_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")


@dataclass
class StructuredOutputsParams:
    """One output constraint (vLLM's `structured_outputs`): a JSON schema (dict or JSON text), a
    regex, a list of choices, an EBNF/GBNF (or Lark) grammar, any JSON object, or an xgrammar
    structural tag (dict or JSON text)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    disable_fallback: bool = False  # there is one backend: nothing to fall back to
    whitespace_pattern: str | None = None
    # Set by the server, never by a request (from_value drops "_" keys): with a reasoning parser the
    # constraint starts after the tokens that end the reasoning (vLLM's rule: `</think>`, or harmony's
    # `<|channel|>final<|message|>`); not part of the grammar's key.
    _reasoning_end: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        given = [f for f in CONSTRAINT_FIELDS if getattr(self, f) not in (None, False)]
        if len(given) > 1:
            raise ValueError("structured_outputs: only one kind of constraint may be given, got "
                             f"{', '.join(given)}")
        if not given:
            raise ValueError("structured_outputs: one constraint must be given: one of "
                             f"{', '.join(CONSTRAINT_FIELDS)}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (object or JSON text), "
                             f"got {type(self.json).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.regex is not None and "\x00" in self.regex:
            raise ValueError("structured_outputs.regex must not contain a NUL character")
        if self.choice is not None:
            if isinstance(self.choice, (str, bytes)) or not isinstance(self.choice, (list, tuple)) \
                    or not self.choice or not all(isinstance(c, str) for c in self.choice):
                raise ValueError("structured_outputs.choice must be a non-empty list of strings")
            self.choice = list(self.choice)
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise ValueError("structured_outputs.json_object must be a boolean")
        if self.structural_tag is not None and not isinstance(self.structural_tag, (str, dict)):
            raise ValueError("structured_outputs.structural_tag must be an object or JSON text")
        if self.whitespace_pattern is not None:
            raise ValueError("structured_outputs.whitespace_pattern is not supported (the xgrammar backend "
                             "has no whitespace patterns); use disable_any_whitespace=true for compact JSON")

    @classmethod
    def from_value(cls, value: Any) -> StructuredOutputsParams:
        """A StructuredOutputsParams, or a dict with its field names (the JSON body's form)."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError("structured_outputs must be an object with one of "
                             f"{', '.join(CONSTRAINT_FIELDS)}, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(k for k in value if k not in known and not k.startswith("_"))
        if unknown:
            raise ValueError(f"structured_outputs: unknown field(s) {unknown}; valid fields: {sorted(known)}")
        return cls(**{k: v for k, v in value.items() if k in known and not k.startswith("_")})

    @property
    def kind(self) -> str:
        return next(f for f in CONSTRAINT_FIELDS if getattr(self, f) not in (None, False))

    def schema(self) -> dict | bool:
        """The JSON schema of a `json` constraint, parsed (ValueError naming the problem)."""
        if isinstance(self.json, dict):
            return self.json
        try:
            schema = json.loads(self.json)
        except (TypeError, json.JSONDecodeError) as e:
            raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError("structured_outputs.json must be a JSON schema object")
        return schema

    def key(self) -> str:
        """The grammar's identity: the cache key of its compiled form."""
        value = getattr(self, self.kind)
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        return f"{self.kind}|ws={int(not self.disable_any_whitespace)}|{text}"


def unsupported_json_schema_feature(schema: Any, path: str = "#") -> str | None:
    """A description of the first keyword the grammar would not enforce (with its location), or None."""
    if not isinstance(schema, dict):
        return None
    for kw in _IGNORED_KEYWORDS:
        if kw in schema and not (kw == "uniqueItems" and schema[kw] is False):
            return f"`{kw}` at {path}"
    types = schema.get("type")
    types = {types} if isinstance(types, str) else set(types) if isinstance(types, list) else set()
    if "multipleOf" in schema and types != {"integer"}:
        return f"`multipleOf` on a non-integer type at {path}"
    if "format" in schema and schema["format"] not in SUPPORTED_STRING_FORMATS:
        return (f"string format {schema['format']!r} at {path} (supported: "
                f"{', '.join(sorted(SUPPORTED_STRING_FORMATS))})")
    if ("pattern" in schema or "format" in schema) and ("minLength" in schema or "maxLength" in schema):
        return f"`minLength`/`maxLength` together with `pattern`/`format` at {path}"
    all_of = schema.get("allOf")
    if isinstance(all_of, list) and len(all_of) > 1:
        return f"`allOf` with more than one subschema at {path}"
    pattern_props = schema.get("patternProperties")
    if isinstance(pattern_props, dict) and ("properties" in schema or len(pattern_props) > 1):
        return f"`patternProperties` with several patterns or beside `properties` at {path}"
    if "propertyNames" in schema and ("properties" in schema or "patternProperties" in schema
                                      or isinstance(schema.get("additionalProperties"), dict)):
        return f"`propertyNames` beside other property keywords at {path}"
    for kw in SUB_ONE:
        sub = schema.get(kw)
        found = unsupported_json_schema_feature(sub, f"{path}/{kw}") if isinstance(sub, dict) else None
        if found:
            return found
    for kw in SUB_DICT:
        subs = schema.get(kw)
        if isinstance(subs, dict):
            for name, sub in subs.items():
                found = unsupported_json_schema_feature(sub, f"{path}/{kw}/{name}")
                if found:
                    return found
    for kw in SUB_LIST:
        subs = schema.get(kw)
        if isinstance(subs, list):
            for i, sub in enumerate(subs):
                found = unsupported_json_schema_feature(sub, f"{path}/{kw}/{i}")
                if found:
                    return found
    return None

