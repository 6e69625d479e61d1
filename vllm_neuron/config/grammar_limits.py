"""`GrammarLimits`: how much grammar work one structured-output request may ask for (pure).

The `grammar_*` engine options (`--grammar-max-properties`, ...) as one frozen object. The size limits are
checked before anything compiles (structured_output/limits.py), the compile time limit and the cache size
where grammars compile: the API server's compile process (structured_output/checker.py) and each engine
core (structured_output/manager.py).

Defaults, measured with xgrammar 0.2.9 on a 2-core machine and a 49k-token vocabulary: an object of 1,000
optional properties compiles in about 0.15 s (about 1.3 s where whitespace is not bounded, as in structural
tags), of 10,000 in minutes and gigabytes; a `pattern` repeating a class 3,000 times takes 0.4 s, 50,000 times
over 100 s.
"""
from __future__ import annotations

from dataclasses import dataclass

from vllm_neuron.config import validate as V

DEFAULT_MAX_PROPERTIES = 1000
DEFAULT_MAX_DEPTH = 32
DEFAULT_MAX_PATTERN_LENGTH = 1000
DEFAULT_MAX_REPEAT = 2000
DEFAULT_MAX_BYTES = 256 << 10
DEFAULT_COMPILE_TIMEOUT_S = 10.0
DEFAULT_CACHE_BYTES = 128 << 20


@dataclass(frozen=True)
class GrammarLimits:
    max_properties: int = DEFAULT_MAX_PROPERTIES  # object properties in one schema, every level counted
    max_depth: int = DEFAULT_MAX_DEPTH  # subschemas nested in one another
    max_pattern_length: int = DEFAULT_MAX_PATTERN_LENGTH  # characters of a `pattern` or a regex constraint
    max_repeat: int = DEFAULT_MAX_REPEAT  # largest {m,n} count in a pattern or regex
    max_bytes: int = DEFAULT_MAX_BYTES  # the constraint's text: schema JSON, regex, grammar, choices
    compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S  # one grammar's compilation
    cache_bytes: int = DEFAULT_CACHE_BYTES  # compiled grammars kept, per process

    def check(self) -> GrammarLimits:
        """ValueError naming the option (`grammar_max_properties`, ...) of a bad value; self otherwise."""
        for name in ("max_properties", "max_depth", "max_pattern_length", "max_repeat", "max_bytes"):
            V.integer(f"grammar_{name}", getattr(self, name), minimum=1)
        V.number("grammar_compile_timeout", self.compile_timeout_s, minimum=0.0, min_exclusive=True)
        V.integer("grammar_cache_bytes", self.cache_bytes, minimum=0)
        return self
