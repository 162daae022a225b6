"""A worker's torch CPU ops run on several cores on its engine thread only:
every other thread (the main one, the event loop's helpers, the media
preprocessing pool) computes on one and so keeps no OpenMP team, whose
threads would otherwise outnumber the cores and make each of the engine's
ops wake its team from sleep (stages/compute_threads.py).

Each case runs in a process of its own: what it sets is per process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Runs a parallel op (far past ATen's grain size) on each kind of thread and
# reports each thread's intra-op count and the threads OpenMP started: the
# process's threads that are not Python's, less those there before the ops.
_SCRIPT = """
import asyncio, json, os, sys, threading
import torch
from stages import compute_threads
from stages.families.qwen2_vl import _preprocess_pool
from stages.torch_engine.scheduler import EngineThread

def natives():
    python = {t.native_id for t in threading.enumerate()}
    return {int(t) for t in os.listdir("/proc/self/task")} - python

def work():
    torch.ones(4_000_000).add_(1).sum()
    return torch.get_num_threads()

async def main(reserve):
    if reserve:
        compute_threads.reserve_on_loop(3)
    engine = EngineThread()
    await engine.call(lambda: None)  # the thread started, no op run yet
    before = natives()
    counts = {
        "main": work(),
        "helper": await asyncio.to_thread(work),
        "preprocess": _preprocess_pool().submit(work).result(),
        "engine": await engine.call(work),
    }
    counts["openmp_threads"] = len(natives() - before)
    engine.close()
    print(json.dumps(counts))

asyncio.run(main(sys.argv[1] == "reserve"))
"""


def _run(script: str, *args: str, timeout_s: float = 120) -> dict[str, Any]:
    """What ``script`` (a case in a process of its own) printed last, as JSON."""
    out = subprocess.run(
        [sys.executable, "-c", script, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout_s, check=True
    )
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def _threads(mode: str) -> dict[str, int]:
    return _run(_SCRIPT, mode)


def test_a_worker_that_reserves_its_threads_computes_on_several_only_on_its_engine_thread() -> None:
    counts = _threads("reserve")
    assert counts == {"main": 1, "helper": 1, "preprocess": 1, "engine": 3, "openmp_threads": 2}


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: OpenMP starts no team to count")
def test_without_the_reservation_each_thread_that_computes_starts_a_team() -> None:
    """The case above's control: the same ops, nothing reserved, start more
    OpenMP threads than the engine's team alone."""
    counts = _threads("none")
    assert counts["main"] == counts["engine"] > 1
    assert counts["openmp_threads"] > counts["engine"] - 1


def _spin(env: dict[str, str], first: str = "") -> list[str]:
    code = f"{first}\nimport os\nfrom stages.compute_threads import brief_spin\n"
    code += "print(brief_spin(), os.environ.get('GOMP_SPINCOUNT'))"
    clean = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=clean | env, capture_output=True, text=True, timeout=120, check=True
    )
    return out.stdout.split()


def test_a_workers_openmp_teams_spin_briefly_unless_its_environment_says_otherwise() -> None:
    from stages.compute_threads import OPENMP_SPIN_COUNT

    assert _spin({}) == ["True", OPENMP_SPIN_COUNT]
    assert _spin({"GOMP_SPINCOUNT": "5"}) == ["True", "5"]
    assert _spin({"OMP_WAIT_POLICY": "passive"}) == ["True", "None"]
    # libgomp has read its environment once torch is loaded: too late to set it.
    assert _spin({}, first="import torch") == ["False", "None"]


# On a reserved engine thread: the intra-op count inside a small call, inside
# a large one, after each, and after a small call that raised.
_SIZED = """
import asyncio, json
import torch
from stages import compute_threads
from stages.torch_engine.scheduler import EngineThread

def counts():
    seen = {}
    with compute_threads.sized(compute_threads.SMALL_CALL_FLOPS / 10):
        seen["small"] = torch.get_num_threads()
    seen["after_small"] = torch.get_num_threads()
    with compute_threads.sized(compute_threads.SMALL_CALL_FLOPS):
        seen["large"] = torch.get_num_threads()
    try:
        with compute_threads.sized(0):
            raise ValueError
    except ValueError:
        pass
    seen["after_raised"] = torch.get_num_threads()
    return seen

async def main():
    compute_threads.reserve_on_loop(3)
    engine = EngineThread()
    print(json.dumps(await engine.call(counts)))
    engine.close()

asyncio.run(main())
"""


def test_a_small_call_runs_on_one_thread_and_the_engines_count_comes_back() -> None:
    counts = _run(_SIZED)
    assert counts == {"small": 1, "after_small": 3, "large": 3, "after_raised": 3}


# Where nothing was reserved (a test's or a bench's process): a small call on
# one thread all the same, and the calling thread's own count back after it.
_UNRESERVED = """
import json, threading
import torch
from stages import compute_threads

def counts(seen):
    torch.set_num_threads(3)
    with compute_threads.sized(compute_threads.SMALL_CALL_FLOPS / 10):
        seen["small"] = torch.get_num_threads()
    seen["after_small"] = torch.get_num_threads()
    with compute_threads.sized(compute_threads.SMALL_CALL_FLOPS):
        seen["large"] = torch.get_num_threads()

seen = {}
thread = threading.Thread(target=counts, args=(seen,))
thread.start()
thread.join()
seen["reserved"] = compute_threads.engine_threads()
print(json.dumps(seen))
"""


def test_where_nothing_is_reserved_a_small_call_runs_on_one_thread_and_the_threads_count_comes_back() -> None:
    counts = _run(_UNRESERVED)
    assert counts == {"small": 1, "after_small": 3, "large": 3, "reserved": None}


# A CPU engine in a process that reserved two threads for its engines, each
# forward recorded (the thread it ran on, that thread's intra-op count, the
# last place's logits), and an engine thread: a case's ``main`` gets them and
# returns what it saw.
def _with_recorded_engine(case: str) -> str:
    return (
        """
import asyncio, json, sys, threading
import torch
from stages import compute_threads
from stages.sampling import SamplingConfig
from stages.torch_engine.engine import TorchEngine
from stages.torch_engine.scheduler import EngineThread

greedy = SamplingConfig(temperature=0.0, max_tokens=4)

async def run(model_dir):
    compute_threads.reserve_on_loop(2)
    engine = TorchEngine(model_dir, device="cpu", dtype=torch.float32)
    seen = []
    forward = engine.model.forward

    def recorded(*args, **kwargs):
        out = forward(*args, **kwargs)
        seen.append((threading.get_ident(), torch.get_num_threads(), out.logits[0, -1].clone()))
        return out

    engine.model.forward = recorded
    ids = engine.tokenizer("hello there", add_special_tokens=False)["input_ids"]
    thread = EngineThread()
    print(json.dumps(await main(engine, thread, seen, ids)))
    thread.close()
"""
        + case
        + """
asyncio.run(run(sys.argv[1]))
"""
    )


# Its forward's intra-op count on the engine's thread, for a short prompt and a long one.
_ENGINE = _with_recorded_engine("""
async def main(engine, thread, seen, ids):
    await thread.call(engine.prefill, [ids * 4], [[]], [greedy])
    out = {"short_prefill": seen[-1][1]}
    await thread.call(engine.prefill, [ids * 400], [[]], [greedy])
    out["long_prefill"] = seen[-1][1]
    out["threads_after"] = await thread.call(torch.get_num_threads)
    return out
""")


def test_a_cpu_engine_prefills_a_short_prompt_on_one_thread_and_a_long_one_on_its_own(tiny_model_dir: Path) -> None:
    counts = _run(_ENGINE, str(tiny_model_dir), timeout_s=300)
    assert counts == {"short_prefill": 1, "long_prefill": 2, "threads_after": 2}


# A small prefill run on its caller's thread (the engine's idle), against the
# same prompt on the engine's thread.
_INLINE = _with_recorded_engine("""
async def main(engine, thread, seen, ids):
    ids = ids * 4

    def prefill():
        return engine.prefill([ids], [[]], [greedy])[0]

    tokens = []
    for small in (False, True):
        seq, token = await thread.call_or_release(lambda out: engine.release(out[0]), prefill, small=small)
        tokens.append(token)
        await thread.call(engine.release, seq)
        await thread.call(engine.reset_prefix_cache)  # the second prompt runs whole too
    (on_engine, engine_count, engine_logits), (inline, inline_count, inline_logits) = seen[-2:]
    caller = threading.get_ident()
    return {
        "small": engine.small_prefill(len(ids)),
        "long_small": engine.small_prefill(len(ids) * 100),
        "engine_thread": on_engine != caller,
        "inline_on_caller": inline == caller,
        "counts": [engine_count, inline_count],
        "caller_after": torch.get_num_threads(),
        "same_logits": bool(torch.equal(engine_logits, inline_logits)),
        "same_token": tokens[0] == tokens[1],
    }
""")


def test_a_small_prefill_on_its_callers_thread_computes_as_the_engines_thread_does(tiny_model_dir: Path) -> None:
    seen = _run(_INLINE, str(tiny_model_dir), timeout_s=300)
    assert seen == {
        "small": True,
        "long_small": False,
        "engine_thread": True,
        "inline_on_caller": True,
        "counts": [1, 1],
        "caller_after": 1,
        "same_logits": True,
        "same_token": True,
    }
