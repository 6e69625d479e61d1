"""GGUF files split by llama.cpp's gguf-split (or gguf-py's writer) into `<prefix>-00001-of-0000N.gguf` parts.

The first part holds the metadata and `split.count`, `split.no`, `split.tensors.count`; every part holds some
tensors (later parts carry only the `split.*` keys). The parts are found by llama.cpp's naming rule from the
first one's name, so a part whose name was changed is not found: the error names the file it looked for.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Callable

SPLIT_COUNT = "split.count"
SPLIT_NO = "split.no"
SPLIT_TENSORS = "split.tensors.count"
_PART_RE = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def part_name(prefix: str, no: int, count: int) -> str:
    """llama.cpp's name of part `no` (1-based) of `count`: `<prefix>-0000no-of-0000count.gguf`."""
    return f"{prefix}-{no:05d}-of-{count:05d}.gguf"


def parse_part(path: str) -> tuple[str, int, int] | None:
    """(prefix with its folder, part number from 1, part count) when `path` is named like a part, else None."""
    m = _PART_RE.match(path)
    return (m["prefix"], int(m["no"]), int(m["count"])) if m and int(m["count"]) > 1 else None


def first_part(path: str) -> str:
    """The first part of the split GGUF that `path` is named as a part of (checked to exist); `path` itself
    when it is not named like a part."""
    parsed = parse_part(path)
    if parsed is None or parsed[1] == 1:
        return path
    first = part_name(parsed[0], 1, parsed[2])
    if not os.path.isfile(first):
        raise ValueError(f"GGUF file {path} is part {parsed[1]} of a split GGUF of {parsed[2]} files, whose first "
                         f"part {os.path.basename(first)} (it holds the metadata) is missing")
    return first


def sibling_parts(path: str) -> list[str]:
    """Every part that `path`'s name implies (no file is read: for cache keys); [path] for an unsplit name."""
    parsed = parse_part(path)
    if parsed is None:
        return [path]
    return [part_name(parsed[0], i, parsed[2]) for i in range(1, parsed[2] + 1)]


def one_split_set(paths: list[str]) -> bool:
    """Whether `paths` (a folder's .gguf files) are all parts of one split GGUF (some may be missing: loading
    it names them)."""
    parsed = [parse_part(p) for p in paths]
    return bool(paths) and None not in parsed and len({(p[0], p[2]) for p in parsed}) == 1


@dataclass
class SplitGGUF:
    """The parts of one split GGUF read as one file: the first part's metadata, every part's tensors in order
    (what GGUFReader offers the loader: `fields`, `tensors`)."""

    parts: list[str]
    fields: dict[str, Any]
    tensors: list[Any]


def open_split(path: str, first: Any, open_part: Callable[[str], Any]) -> Any:
    """`first` (the GGUFReader of `path`) when the file is not split, else a SplitGGUF of all its parts opened
    with `open_part`; a missing or foreign part is a ValueError naming it."""

    def meta(reader: Any, key: str) -> Any:
        field = reader.fields.get(key)
        return None if field is None else field.contents()

    count = meta(first, SPLIT_COUNT)
    if count is None or int(count) <= 1:
        return first
    count = int(count)
    if meta(first, SPLIT_NO) not in (None, 0):
        raise ValueError(f"GGUF file {path} is part {int(meta(first, SPLIT_NO)) + 1} of a split GGUF of {count} "
                         "files: pass its first part (it holds the metadata)")
    parsed = parse_part(path)
    if parsed is None or parsed[1:] != (1, count):
        raise ValueError(f"GGUF file {path} is the first of {count} parts (split.count), but its name does not end "
                         f"with -00001-of-{count:05d}.gguf, from which the other parts are found: keep llama.cpp's "
                         "part names")
    parts = sibling_parts(path)
    missing = [p for p in parts if not os.path.isfile(p)]
    if missing:
        raise ValueError(f"GGUF file {path} is split into {count} parts, and "
                         f"{', '.join(os.path.basename(p) for p in missing)} {'is' if len(missing) == 1 else 'are'} "
                         f"missing from {os.path.dirname(path) or '.'}")
    tensors = list(first.tensors)
    for no, part in enumerate(parts[1:], start=1):
        reader = open_part(part)
        if meta(reader, SPLIT_NO) != no or meta(reader, SPLIT_COUNT) != count:
            raise ValueError(f"GGUF file {part} is not part {no + 1} of {count} of {os.path.basename(path)} (its "
                             f"split.no={meta(reader, SPLIT_NO)}, split.count={meta(reader, SPLIT_COUNT)})")
        tensors.extend(reader.tensors)
    expected = meta(first, SPLIT_TENSORS)
    if expected is not None and int(expected) != len(tensors):
        raise ValueError(f"GGUF file {path}: its {count} parts hold {len(tensors)} tensors, but split.tensors.count "
                         f"says {int(expected)}")
    return SplitGGUF(parts=parts, fields=first.fields, tensors=tensors)
