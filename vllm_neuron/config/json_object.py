"""An option that takes a JSON object (a dict, or its JSON text on the command line) -> a dict (pure)."""
from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


def parse_json_object(value: str | Mapping[str, Any] | None, not_json: str, not_object: str) -> dict[str, Any]:
    """None -> {}; JSON text is decoded; anything but an object is refused with the caller's message.

    The messages are `str.format` templates, so each option keeps its own wording: `not_json` may use
    {value} (the text) and {error} (the decoder's), `not_object` {value} and {type} (its type's name).
    """
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(not_json.format(value=value, error=e)) from None
    if not isinstance(value, Mapping):
        raise ValueError(not_object.format(value=value, type=type(value).__name__))
    return dict(value)
