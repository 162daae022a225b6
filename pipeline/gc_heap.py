"""The startup heap kept out of Python's garbage collector.

A worker holds a few hundred thousand long-lived objects once its model,
tokenizer and libraries are loaded (394k for the tiny model). Every full
(oldest-generation) collection walked them all: 370–700 ms on a 2-vCPU
machine with the GIL held, a pause of every request's tokens, and one
comes whenever enough new objects have outlived two younger collections,
as they do under load. Frozen once the process is ready, they are skipped;
what requests allocate is collected as before. vLLM's engine core and API
server do the same (``gc.freeze()`` after start-up).
"""

from __future__ import annotations

import gc

import structlog

log = structlog.get_logger(__name__)


def freeze_startup_heap() -> int:
    """Collect what start-up left as garbage, then move every object still
    alive to the permanent generation; returns how many that is."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("gc_startup_heap_frozen", objects=frozen)
    return frozen
