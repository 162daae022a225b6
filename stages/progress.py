"""Start-up progress: what a worker is doing while it is not yet ready
(loading weights, compiling, capturing graphs can take a minute on a GPU).

A log line when a step starts and one when it ends, with its figures; on a
terminal a bar for the steps that count their items as they go."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

import structlog

log = structlog.get_logger(__name__)

T = TypeVar("T")


def on_terminal() -> bool:
    return sys.stderr.isatty()


class Step:
    """One start-up step: ``step_started``, then ``step_done`` with its seconds
    and whatever ``done(**figures)`` adds."""

    def __init__(self, name: str, **figures: Any) -> None:
        self.name = name
        self.started = time.monotonic()
        log.info(f"{name}_started", **figures)

    def done(self, **figures: Any) -> None:
        log.info(f"{self.name}_done", seconds=round(time.monotonic() - self.started, 2), **figures)


def counted(name: str, items: Iterable[T], total: int) -> Iterator[T]:
    """``items``, drawing ``name [####    ] 3/8`` on a terminal as they are taken."""
    if not on_terminal() or total <= 0:
        yield from items
        return
    width = 24
    for n, item in enumerate(items):
        _bar(name, n, total, width)
        yield item
    _bar(name, total, total, width)
    sys.stderr.write("\n")
    sys.stderr.flush()


def _bar(name: str, n: int, total: int, width: int) -> None:
    filled = width * n // total
    sys.stderr.write(f"\r{name} [{'#' * filled}{' ' * (width - filled)}] {n}/{total}")
    sys.stderr.flush()


@contextlib.contextmanager
def no_transformers_bars() -> Iterator[None]:
    """transformers' own tqdm bars ("Loading weights", save_pretrained's) off
    for a while: on stderr they are noise in a worker's log or a cache fill."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()
