"""CPU time of a running ``mmpipe up`` stack's processes, by role.

``mmpipe bench --compare-frontend-decode`` compares where the media's
decoding costs CPU (the bridge or the encode worker): each process of the
stack (its workers by role, the bridge, the nats-server) and the processes
they started (a worker's media decoding pool) are read from ``/proc``
before and after the measured load. Linux only.
"""

from __future__ import annotations

import os
from pathlib import Path

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def stack_cpu_s(root: int) -> dict[str, float]:
    """CPU seconds (user and system) each role's processes have used so far
    under ``root`` (``mmpipe up``'s pid), a process's children counted with
    it. Processes gone by now are not counted: read before and after a
    load, the difference is that load's share while the stack stays up."""
    out: dict[str, float] = {}
    stack = [(root, "up")]
    while stack:
        pid, parent = stack.pop()
        role = _role(pid) or parent
        out[role] = out.get(role, 0.0) + _cpu_s(pid)
        stack += [(child, role) for child in _children(pid)]
    return out


def _role(pid: int) -> str | None:
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    words = [a.decode(errors="replace") for a in args if a]
    if "pipeline.cli" in words:
        rest = words[words.index("pipeline.cli") + 1 :]
        if rest[:1] == ["worker"] and len(rest) > 1:
            return rest[1]
        if rest[:1] == ["bridge"]:
            return "bridge"
    if words and Path(words[0]).name.startswith("nats-server"):
        return "nats"
    return None


def _cpu_s(pid: int) -> float:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    # The command name, in parentheses, may hold spaces: the fields start after its last ")".
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) * _TICK_S  # utime, stime


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return out
    for task in tasks:
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return out
