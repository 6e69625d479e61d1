"""Logging for vllm_neuron: one "vllm_neuron" logger tree, vLLM's line format.

Lines look like vLLM's so that the seeds' log lines can be grepped the same way:

    INFO 11-30 13:10:29 [model_runner_v2.py:123] Using the standalone V2 Neuron model runner.

The level comes from VLLM_NEURON_LOG_LEVEL (default INFO), the stream from vLLM's VLLM_LOGGING_STREAM
(`ext://sys.stdout`, the default, or `ext://sys.stderr`; child processes inherit both). The handler sits on the
"vllm_neuron" logger, not on the root logger, so that embedding applications keep control
of their own logging. Records still propagate to the root logger: pytest's caplog and
applications that collect everything at the root keep seeing them (the root logger has no
handler unless the application installs one, so lines are not printed twice).
"""

from __future__ import annotations

import logging
import os
import sys
import threading

ROOT_LOGGER_NAME = "vllm_neuron"
LOG_FORMAT = "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"
DATE_FORMAT = "%m-%d %H:%M:%S"
VALID_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

_lock = threading.Lock()
_configured = False
_handler: logging.Handler | None = None
# Bounded: messages that embed a per-request value would otherwise grow the set forever. Past the
# bound the oldest keys are forgotten, so such a message may repeat after ONCE_CAPACITY others.
ONCE_CAPACITY = 1024
_once_keys: dict[tuple[str, str], None] = {}


def _level_from_env() -> tuple[int, str | None]:
    """Return (level, problem). Read directly from os.environ: envs.py imports this module."""
    raw = os.environ.get("VLLM_NEURON_LOG_LEVEL", "").strip()
    if not raw:
        return logging.INFO, None
    name = raw.upper()
    if name == "WARN":
        name = "WARNING"
    if name not in VALID_LEVELS:
        # A bad log level must not make every import fail; one explicit warning instead.
        return logging.INFO, (
            f"VLLM_NEURON_LOG_LEVEL={raw!r} is not a valid level; valid values: "
            f"{', '.join(VALID_LEVELS)}. Using INFO."
        )
    return getattr(logging, name), None


STREAMS = {"ext://sys.stdout": "stdout", "ext://sys.stderr": "stderr"}
_stream_name: str | None = None  # the sys attribute the handler writes to


def _stream_from_env() -> tuple[str, str | None]:
    """Return ("stdout" or "stderr", problem), from VLLM_LOGGING_STREAM (read directly, as the level is)."""
    raw = os.environ.get("VLLM_LOGGING_STREAM", "").strip()
    if not raw:
        return "stdout", None
    if raw in STREAMS:
        return STREAMS[raw], None
    return "stdout", (f"VLLM_LOGGING_STREAM={raw!r} is not a valid stream; valid values: {', '.join(STREAMS)}. "
                      "Using stdout.")


def configure_root_logger(level: str | int | None = None) -> logging.Logger:
    """(Re)configure the "vllm_neuron" logger: handler, stream, format and level.

    `level` overrides VLLM_NEURON_LOG_LEVEL. Called once implicitly by init_logger; call it
    again to apply a changed environment (tests, CLI --log-level style options).
    """
    global _configured, _handler, _stream_name
    with _lock:
        root = logging.getLogger(ROOT_LOGGER_NAME)
        stream, stream_problem = _stream_from_env()
        problem = None
        if level is None:
            lvl, problem = _level_from_env()
        elif isinstance(level, str):
            if level.upper() not in VALID_LEVELS:
                raise ValueError(
                    f"log level {level!r} is not valid; valid values: {', '.join(VALID_LEVELS)}"
                )
            lvl = getattr(logging, level.upper())
        else:
            lvl = int(level)
        if _handler is None:
            _handler = logging.StreamHandler(getattr(sys, stream))
            _handler.setFormatter(logging.Formatter(LOG_FORMAT, datefmt=DATE_FORMAT))
            root.addHandler(_handler)
        elif stream != _stream_name:  # only on a change: the stream object it holds stays otherwise
            _handler.setStream(getattr(sys, stream))
        _stream_name = stream
        root.setLevel(lvl)
        _configured = True
    for text in (stream_problem, problem):
        if text:
            root.warning(text)
    return root


def init_logger(name: str) -> logging.Logger:
    """Return the logger for module `name`, placed under the "vllm_neuron" logger.

    Modules of this package pass __name__ ("vllm_neuron.worker.memory"); any other name is
    nested as "vllm_neuron.<name>" so that it shares the handler and level.
    """
    if not _configured:
        configure_root_logger()
    if name != ROOT_LOGGER_NAME and not name.startswith(ROOT_LOGGER_NAME + "."):
        name = f"{ROOT_LOGGER_NAME}.{name}"
    return logging.getLogger(name)


def warning_once(logger: logging.Logger, msg: str, *args: object) -> bool:
    """Log `msg % args` as a warning the first time this exact text is seen on `logger`.

    Used for per-step or per-request conditions that would otherwise flood the log.
    Returns True when the warning was emitted.
    """
    text = msg % args if args else msg
    key = (logger.name, text)
    with _lock:
        if key in _once_keys:
            return False
        _once_keys[key] = None
        if len(_once_keys) > ONCE_CAPACITY:
            del _once_keys[next(iter(_once_keys))]
    # stacklevel=2 makes [file:line] point at the caller, not at this helper.
    logger.warning(text, stacklevel=2)
    return True
