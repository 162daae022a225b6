"""structlog set-up: JSON lines when stderr is not a terminal.

Libraries that log through the standard library (nats-py, aiohttp, vLLM,
transformers) go through the same renderer, so a process writes one kind
of line: the record's message as ``event``, its level and its logger's
name beside structlog's own fields.
"""

from __future__ import annotations

import logging
import sys

import structlog

# Marks the root handler this module installed, so configuring again replaces it.
_OURS = "_mmpipe_handler"


def configure(level: str = "INFO", json: bool | None = None) -> None:
    level = level.upper()
    if json is None:
        json = not sys.stderr.isatty()
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    )
    shared: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    _route_stdlib(level, shared, renderer)
    structlog.configure(
        processors=[
            *shared,
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level)),
        # One write per line: `mmpipe up`'s children share one stderr, and under
        # PYTHONUNBUFFERED print() writes a line and its newline apart.
        logger_factory=structlog.WriteLoggerFactory(sys.stderr),
        cache_logger_on_first_use=False,
    )


def _route_stdlib(level: str, shared: list[structlog.types.Processor], renderer: structlog.types.Processor) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name],
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.format_exc_info,
                renderer,
            ],
        )
    )
    setattr(handler, _OURS, True)
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, _OURS, False)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    # Python's warnings (a library's DeprecationWarning) as log lines too.
    logging.captureWarnings(True)
