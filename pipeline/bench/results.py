"""Where a benchmark's results go besides the terminal, and how its tables print a figure."""

from __future__ import annotations

import json
import os
from typing import Any


def write_json(results: Any, output: str, name: str) -> None:
    """``results`` as JSON to ``output``, or to ``$OUT/name`` where a device
    machine collects files from ``$OUT``; nowhere when neither is set."""
    out = output or (os.path.join(os.environ["OUT"], name) if os.environ.get("OUT") else "")
    if out:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)


def figure(value: float | None, fmt: str) -> str:
    """A table's cell: ``value`` in ``fmt``, or ``-`` where nothing was measured."""
    return "-" if value is None else format(value, fmt)
