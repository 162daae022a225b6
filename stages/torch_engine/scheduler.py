"""The decode loop: every in-flight sequence advances in one engine step;
sequences join and leave between steps (continuous batching). Engine calls
run on one thread so the event loop stays free for NATS traffic.

With an engine that can launch a step without waiting for it (``launch`` /
``collect``), the loop keeps one step ahead: step k+1 is queued on the
device before step k's tokens are read and handed out, so the device is not
idle while the host reads tokens, wakes consumers and picks the next batch.
A sequence that step k ends has taken step k+1 too; that token is dropped.
Sequences that join start at step k+2.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import threading
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import structlog

from stages import compute_threads
from stages.torch_engine.metrics import (
    ENGINE_CALL_CPU,
    ENGINE_CALL_GPU,
    ENGINE_CALL_INLINE,
    ENGINE_CALL_RUN,
    ENGINE_CALL_WAIT,
    RELEASE_FAILURES,
    STEP_INTERVAL,
    STEP_ROWS,
)

log = structlog.get_logger(__name__)

T = TypeVar("T")


class EngineThread:
    """One thread owns the engine. Calls run one at a time, in submission
    order, so a release queued after a prefill never races it. With
    ``others_s`` set, an urgent call (the decode loop's step) goes ahead of
    the others (encodes, prefills, releases) once they have had ``others_s``
    of the thread since the last urgent call.

    Why a choice: under load the other calls queue up many deep, and a
    decode step behind them all holds every running sequence's next token
    for their sum (tokens come in bursts). Steps first keep tokens smooth,
    but let new requests in more slowly: on a 2-vCPU machine (tiny model, 32
    clients) steps-first made 14 to 17 req/s where submission order made
    21, with ITL p99 95 to 157 ms against 250. A running sequence waits at
    most about ``others_s`` plus one call between two steps.

    On a GPU that order is the order of launches, not of work: an encode or
    a prefill launches in a millisecond or two and runs for several, so
    between two steps the thread could queue many of them on the device, and
    the next step ran behind them all. With ``others_ahead`` (and
    ``decoding()`` true) the thread launches another such call only once
    all but ``others_ahead - 1`` of those before it are done on the device
    (``fence``: what marks a call's work done; CUDA events by default); a
    step that comes meanwhile goes first."""

    def __init__(
        self,
        others_s: float | None = None,
        gpu_spans: bool = False,
        others_ahead: int = 0,
        fence: Callable[[], Any] | None = None,
    ) -> None:
        self.others_s = others_s
        self._others_ahead = others_ahead
        self._fence = fence if fence is not None else (_cuda_fence if others_ahead > 0 else None)
        # The other calls whose work may still be on the device, oldest first.
        self._fences: collections.deque[Any] = collections.deque()
        # Set by a decode loop: whether sequences are running (only their next
        # tokens are what the bound keeps from waiting).
        self.decoding: Callable[[], bool] = lambda: False
        # Each call's span on the GPU too (CUDA events around it, read once
        # they have passed): a thread that waits in a sync is told from one
        # the device waits for.
        self._gpu = _GpuSpans() if gpu_spans else None
        # Thread time the other calls had since the last urgent one.
        self._others_ran_s = 0.0
        self._submitted = 0
        self._urgent: collections.deque[_Call] = collections.deque()
        self._normal: collections.deque[_Call] = collections.deque()
        self._ready = threading.Condition()
        # Counted up on the caller's loop, down on the engine thread too: under ``_ready``.
        self._unsettled = 0
        # Whether a call is running on the thread now (read without the lock: a hint).
        self._calling = False
        self._thread = threading.Thread(target=self._run, name="engine_0", daemon=True)
        self._started = False
        self.closed = False

    @property
    def quiet(self) -> bool:
        """No sequence decoding, no call running or queued: nothing here
        would wait for the GIL that work beside the thread takes (a hint,
        read without the lock)."""
        return not self._calling and not self._urgent and not self._normal and not self.decoding()

    async def call(self, fn: Callable[..., T], *args: Any, urgent: bool = False) -> T:
        return await asyncio.wrap_future(self._submit(fn, args, urgent))

    @property
    def unsettled(self) -> int:
        """Calls that allocate (``call_or_release``) still running or queued,
        or whose result is still to be released: a pool read as empty now
        may hold their sequences next (a hint, read without the lock)."""
        return self._unsettled

    async def call_or_release(self, release: Callable[[T], Any], fn: Callable[[], T], small: bool = False) -> T:
        """``call`` for work that allocates: if the caller is cancelled while
        the thread runs it, the result is released once it exists.

        ``small``: the caller's word that ``fn`` is a short call that would
        run on one of the thread's cores (``compute_threads.sized``): with
        the thread quiet it runs on the caller's thread instead (``_inline``)."""
        if small and (done := self._inline(fn)) is not None:
            return done[0]
        future = self._submit(fn, (), False)
        # Before any settling: that comes only once the caller has awaited the result or left.
        with self._ready:
            self._unsettled += 1
        try:
            result = await asyncio.shield(asyncio.wrap_future(future))
        except asyncio.CancelledError:

            def release_result(done: concurrent.futures.Future[T]) -> None:
                if done.cancelled() or done.exception() is not None:
                    self._settle()
                    return
                try:
                    self._submit(self._release_then_settle, (release, done.result()), False)
                except RuntimeError:
                    # Closed: the engine is going away with what it holds.
                    self._settle()

            future.add_done_callback(release_result)
            raise
        except BaseException:
            self._settle()
            raise
        self._settle()
        return result

    def _inline(self, fn: Callable[[], T]) -> tuple[T] | None:
        """Run ``fn`` here and now if nothing runs, waits or decodes on the
        thread: its result; None where it did not run.

        Why: a hand-off to the thread and its result back cost a worker's
        first token two wakes (0.25 and 0.45 ms on 2 vCPUs, one client), for
        a call that waits for nothing there. Held under the thread's lock,
        so no call another thread submits meanwhile starts before it ends:
        the order stays the submission order. Only for a small call: the
        caller's loop does nothing else while it runs, and a small call runs
        on one core on either thread, so its float32 bits are the same. Never
        on a thread that times or fences its calls on a GPU: its device
        stream and the order of launches are the thread's."""
        if self._gpu is not None or self._others_ahead > 0:
            return None
        with self._ready:
            if self._calling or self._urgent or self._normal or self.closed or self.decoding():
                return None
            self._submitted += 1
            name = getattr(fn, "__name__", "call")
            started, cpu = time.perf_counter(), time.thread_time()
            self._calling = True
            try:
                result = fn()
            finally:
                self._calling = False
                ENGINE_CALL_INLINE.labels(name).inc()
                self._ran(name, 0.0, started, cpu, urgent=False)
        return (result,)

    def _release_then_settle(self, release: Callable[[T], Any], result: T) -> None:
        try:
            release(result)
        finally:
            self._settle()

    def _settle(self) -> None:
        with self._ready:
            self._unsettled -= 1

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Fire and forget (for releases from a cancelled task)."""
        self._submit(fn, args, False)

    def _submit(self, fn: Callable[..., Any], args: tuple[Any, ...], urgent: bool) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._ready:
            if self.closed:
                raise RuntimeError("the engine thread is closed")
            self._submitted += 1
            call = _Call(fn, args, future, self._submitted, time.perf_counter())
            (self._urgent if urgent else self._normal).append(call)
            if not self._started:
                self._started = True
                self._thread.start()
            self._ready.notify()
        return future

    def _run(self) -> None:
        compute_threads.enter_engine_thread()
        while True:
            with self._ready:
                while not self._urgent and not self._normal and not self.closed:
                    self._ready.wait()
                if not self._urgent and not self._normal:
                    return  # closed and drained
                urgent = self._urgent_next()
                if not urgent and self._held_back():
                    if not self._urgent:
                        # Woken at once by a step's submission.
                        self._ready.wait(_FENCE_POLL_S)
                        continue
                    urgent = True
                call = (self._urgent if urgent else self._normal).popleft()
                # Set under the lock: a caller that would run a call on its own thread (``_inline``) sees it.
                self._calling = True
            if not call.future.set_running_or_notify_cancel():
                self._calling = False
                continue
            name = getattr(call.fn, "__name__", "call")
            started, cpu = time.perf_counter(), time.thread_time()
            marker = self._gpu.begin() if self._gpu is not None else None
            try:
                result = call.fn(*call.args)
            except BaseException as exc:
                # Not calling by the time the caller learns the outcome (``quiet``).
                self._calling = False
                call.future.set_exception(exc)
            else:
                self._calling = False
                call.future.set_result(result)
            if self._gpu is not None and marker is not None:
                self._gpu.end(name, marker)
            if not urgent and self._others_ahead > 0 and self._fence is not None:
                self._fenced()
            self._ran(name, started - call.submitted, started, cpu, urgent)

    def _ran(self, name: str, waited_s: float, started: float, cpu_at_start: float, urgent: bool) -> None:
        """A call just ended (begun at ``perf_counter`` ``started``, the
        thread's CPU time then ``cpu_at_start``): its wait, run and CPU in
        the metrics, its run in the other calls' share of the thread."""
        ran, cpu = time.perf_counter() - started, time.thread_time() - cpu_at_start
        ENGINE_CALL_WAIT.labels(name).observe(waited_s)
        ENGINE_CALL_RUN.labels(name).observe(ran)
        ENGINE_CALL_CPU.labels(name).inc(cpu)
        if urgent:
            self._others_ran_s = 0.0
        else:
            self._others_ran_s += ran

    def _held_back(self) -> bool:
        """Whether the next other call waits: sequences decode and
        ``others_ahead`` other calls' work is still on the device."""
        if self._others_ahead <= 0 or not self._fences:
            return False
        while self._fences and self._fences[0].query():
            self._fences.popleft()
        return len(self._fences) >= self._others_ahead and self.decoding()

    def _fenced(self) -> None:
        # A fence that cannot be made (a device in error) bounds nothing: the
        # calls themselves fail then, not the thread's loop.
        try:
            self._fences.append(self._fence())  # type: ignore[misc]
        except Exception as exc:
            log.warning("engine_call_fence_failed", error=repr(exc))

    def _urgent_next(self) -> bool:
        if not self._normal:
            return True
        if not self._urgent:
            return False
        if self.others_s is None:
            return self._urgent[0].order < self._normal[0].order
        return self._others_ran_s >= self.others_s

    def close(self) -> None:
        """Stop taking calls; returns once the ones queued have run."""
        with self._ready:
            self.closed = True
            self._ready.notify()
        if self._started:
            self._thread.join()


class _GpuSpans:
    """Each engine call's span on the device's current stream: from where
    the device reached the call's first work to where it finished its last
    (gaps inside included: a call that launches slower than the device runs
    spans its launches). Summed into ``mmpipe_engine_call_gpu_seconds``
    once both events have passed, never waited for."""

    def __init__(self) -> None:
        import torch

        self._torch = torch
        self._open: collections.deque[tuple[str, Any, Any]] = collections.deque()

    def begin(self) -> Any:
        """The call's first event; None where it could not be recorded."""
        # A measurement: a device in error fails the calls themselves, not the thread's loop.
        try:
            event = self._torch.cuda.Event(enable_timing=True)
            event.record()
        except Exception as exc:
            log.warning("engine_call_gpu_span_failed", error=repr(exc))
            return None
        return event

    def end(self, name: str, begun: Any) -> None:
        try:
            event = self._torch.cuda.Event(enable_timing=True)
            event.record()
            self._open.append((name, begun, event))
            while self._open and self._open[0][2].query():
                done, first, last = self._open.popleft()
                ENGINE_CALL_GPU.labels(done).inc(first.elapsed_time(last) / 1000)
        except Exception as exc:
            self._open.clear()
            log.warning("engine_call_gpu_span_failed", call=name, error=repr(exc))


@dataclass
class _Call:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    future: concurrent.futures.Future[Any]
    order: int
    submitted: float


def _cuda_fence() -> Any:
    """An event after the work queued so far on the current CUDA stream."""
    import torch

    event = torch.cuda.Event()
    event.record()
    return event


_END = object()
# A step's chunk that the step did not run.
_NOT_RUN = object()
# How often a thread holding back another call looks whether the device is done with the earlier ones.
_FENCE_POLL_S = 0.0002
# How often a loop with nothing running looks again for blocks for a waiting sequence.
_BLOCKED_POLL_S = 0.05


@dataclass(eq=False)
class _Chunk:
    """A long prompt waiting for its next chunk, and who waits for what it gives."""

    prefilling: Any
    result: asyncio.Future[Any]


@dataclass
class Running:
    seq: Any
    # Decided on the loop, before the next step: a finished sequence never
    # takes a step (or a cache slot) it has no use for.
    is_last: Callable[[int], bool]
    queue: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    # Set by the consumer when it wants no more tokens (finished or gone).
    done: bool = False


class DecodeScheduler:
    """Owns the sequences being decoded; ``stream()`` yields one sequence's
    tokens as the shared loop produces them."""

    def __init__(self, engine: Any, thread: EngineThread, max_batch: int = 32) -> None:
        self._engine = engine
        self._thread = thread
        self._max_batch = max_batch
        self._running: list[Running] = []
        self._waiting: list[Running] = []
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._closing = False
        self._pipelined = hasattr(engine, "launch") and hasattr(engine, "collect")
        # The launched step whose tokens are not handed out yet, and its batch.
        self._ahead: tuple[Any, list[Running]] | None = None
        # Finished sequences whose release goes with the loop's next engine
        # call (one call, and one wait for the GIL, fewer per request). Taken
        # by the call when it runs: one cancelled before it ran leaves them here.
        self._to_release: collections.deque[Any] = collections.deque()
        self._blocked = False
        self._handed_out_at: float | None = None
        # Long prompts' next chunks, each carried by a step (one a step, in order).
        self._chunks: collections.deque[_Chunk] = collections.deque()
        thread.decoding = lambda: bool(self._running)

    def start(self) -> None:
        if self._loop_task is None:
            self._loop_task = asyncio.create_task(self._loop(), name="decode-loop")
            self._loop_task.add_done_callback(self._stopped)

    def check(self) -> None:
        """Raises where the decode loop has stopped other than by ``close()``:
        a sequence handed to it would never get a token."""
        task = self._loop_task
        if task is not None and task.done() and not self._closing:
            error = None if task.cancelled() else task.exception()
            raise RuntimeError(f"the decode loop has stopped: {error!r}")

    def _stopped(self, task: asyncio.Task[None]) -> None:
        if self._closing:
            return
        log.error("decode_loop_died", error="cancelled" if task.cancelled() else repr(task.exception()))
        # Its streams fail now rather than wait for tokens that never come.
        error = RuntimeError("the decode loop has stopped")
        for entry in self._running + self._waiting:
            entry.queue.put_nowait(error)
            entry.done = True
            self._to_release.append(entry.seq)
        self._running.clear()
        self._waiting.clear()
        self._fail_chunks(error)
        self._flush_releases()

    def _fail_chunks(self, error: BaseException) -> None:
        while self._chunks:
            result = self._chunks.popleft().result
            if not result.done():
                result.set_exception(error)

    async def close(self) -> None:
        self._closing = True
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except asyncio.CancelledError:
                pass
            except Exception:  # it died before: logged then (_stopped)
                pass
            self._loop_task = None
        self._fail_chunks(RuntimeError("the decode loop is closed"))
        self._flush_releases()

    def _flush_releases(self) -> None:
        """Releases still owed, as a call of their own (the loop is gone)."""
        if self._to_release and not self._thread.closed:
            self._thread.submit(_releasing(self._engine, self._to_release))

    @property
    def active(self) -> int:
        return len(self._running) + len(self._waiting)

    @property
    def holds(self) -> bool:
        """Whether the loop has sequences: running, waiting to join (no row
        of the pool yet, but one the next step may give them), in a step
        launched ahead, a long prompt's chunks, or ended with their release
        still owed."""
        return bool(self._running or self._waiting or self._ahead is not None or self._chunks or self._to_release)

    async def stream(self, seq: Any, is_last: Callable[[int], bool]) -> AsyncGenerator[int, None]:
        """Tokens of a prefilled sequence as the shared loop produces them, up
        to the one ``is_last`` accepts, or until the caller stops iterating."""
        entry = self.join(seq, is_last)
        try:
            async for token in self.tokens(entry):
                yield token
        finally:
            self.leave(entry)

    async def prefill_chunk(self, prefilling: Any) -> Any:
        """The next chunk of a long prompt (the engine's ``start_prefill``),
        carried by the loop's next step (``launch(seqs, chunk)``: a running
        sequence's next token waits for one mixed step, not for a step and a
        chunk), or run on its own while nothing decodes. What the engine's
        ``prefill_chunk`` gives. Cancelled, a chunk not begun never runs, and
        a sequence one made is released."""
        self.check()
        chunk = _Chunk(prefilling, asyncio.get_running_loop().create_future())
        self._chunks.append(chunk)
        self._wake.set()
        try:
            return await chunk.result
        except asyncio.CancelledError:
            result = chunk.result
            if result.done() and not result.cancelled() and result.exception() is None and result.result():
                # Its sequence came, and the caller was cancelled before it woke to take it.
                self._to_release.append(result.result()[0])
                self._wake.set()
            raise
        finally:
            if chunk in self._chunks:
                self._chunks.remove(chunk)

    def _chunk_done(self, chunk: _Chunk, out: Any) -> None:
        if not chunk.result.done():
            if isinstance(out, BaseException):
                chunk.result.set_exception(out)
            else:
                chunk.result.set_result(out)
        elif out is not None and not isinstance(out, BaseException):
            self._to_release.append(out[0])  # its prompt given up meanwhile: the sequence it made goes

    def _requeue(self, chunk: _Chunk) -> None:
        """A chunk taken for a step that ran none: first for the next, unless its prompt was given up."""
        if not chunk.result.done():
            self._chunks.appendleft(chunk)

    async def _chunk_alone(self) -> None:
        """The first waiting chunk in an engine call of its own."""
        chunk = self._chunks.popleft()
        engine = self._engine
        try:
            # Urgent, as a step: it is the loop's work (a later step waits for it), not a new request's.
            prefill_chunk = _releasing(engine, self._to_release, engine.prefill_chunk)
            out = await self._thread.call(prefill_chunk, chunk.prefilling, True, urgent=True)
        except Exception as exc:
            out = exc
        self._chunk_done(chunk, out)

    def join(self, seq: Any, is_last: Callable[[int], bool]) -> Running:
        """``seq`` joins the batch at the loop's next step; its tokens come
        through ``tokens``, until ``leave``. (Apart from ``stream`` so a hop
        can join before it hands out the token prefill made: the sequence's
        first step then does not wait for that token's way to the client.)"""
        self.check()
        entry = Running(seq, is_last)
        self._waiting.append(entry)
        self._wake.set()
        return entry

    async def tokens(self, entry: Running) -> AsyncGenerator[int, None]:
        while True:
            item = await entry.queue.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def leave(self, entry: Running) -> None:
        """The sequence wants no more tokens: the loop drops and releases it."""
        entry.done = True
        self._wake.set()

    def _admit(self, admissible: Callable[[list[Any]], list[bool]] | None) -> None:
        """Waiting sequences the engine can take now join the batch, in order."""
        room = self._max_batch - len(self._running)
        if room <= 0 or not self._waiting:
            self._blocked = False
            return
        takes = admissible([e.seq for e in self._waiting]) if admissible is not None else [True] * len(self._waiting)
        joining = [e for e, take in zip(self._waiting, takes, strict=True) if take][:room]
        self._blocked = not all(takes)
        for entry in joining:
            self._waiting.remove(entry)
        self._running += joining

    def _set_aside(self, batch: list[Running], taken: list[bool]) -> None:
        """Sequences a step did not take (their blocks were not free) wait
        again, ahead of those that came after them."""
        left = [e for e, took in zip(batch, taken, strict=True) if not took and e in self._running]
        for entry in left:
            self._running.remove(entry)
        self._waiting[:0] = left
        self._blocked = self._blocked or bool(left)

    @property
    def blocked(self) -> bool:
        """The first waiting sequence waits for the engine to have room for it (KV blocks)."""
        return self._blocked and bool(self._waiting)

    async def _loop(self) -> None:
        admissible = getattr(self._engine, "admissible", None)
        while True:
            self._drop_done()
            # First come, first served: one that waits for blocks holds back those behind it.
            self._admit(admissible)
            if not self._running and self._ahead is None:
                self._handed_out_at = None  # idle time is no step interval
                if self._chunks:
                    await self._chunk_alone()  # no step to carry it
                    continue
                if self._to_release:
                    # No step to carry them: what finished gives its blocks back
                    # now (the first waiting may fit then, the worker take more).
                    await self._thread.call(_releasing(self._engine, self._to_release))
                    continue
                self._wake.clear()
                if not self._waiting:
                    await self._wake.wait()
                    continue
                unblock = getattr(self._engine, "unblock", None)
                if self._blocked and unblock is not None:
                    # Nothing runs to free blocks: those the waiting hold go, until the first fits.
                    seqs = [e.seq for e in self._waiting]
                    if await self._thread.call(unblock, seqs):
                        continue
                # Blocks can come back without a word to this loop (a KV
                # transfer given up frees what it held): look again soon.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), _BLOCKED_POLL_S)
                continue
            batch = list(self._running)
            if self._pipelined and await self._advance(batch):
                continue
            seqs = [e.seq for e in batch]
            chunk = self._chunks.popleft() if self._chunks and hasattr(self._engine, "step_carrying") else None
            try:
                if chunk is None:
                    step = _releasing(self._engine, self._to_release, self._engine.step)
                    tokens = await self._thread.call(step, seqs, urgent=True)
                else:
                    # The host chooses a row's tokens (a grammar, say): the step carries the chunk all the same.
                    step = _releasing(self._engine, self._to_release, self._engine.step_carrying)
                    tokens, out = await self._thread.call(step, seqs, chunk.prefilling, urgent=True)
                    self._chunk_done(chunk, out)
            except Exception as exc:
                self._fail(batch, exc)
                if chunk is not None:
                    self._requeue(chunk)  # the step ran no chunk
                continue
            self._hand_out(batch, tokens)
            self._set_aside(batch, [token is not None for token in tokens])
            # Let consumers take their token (and say whether they are done)
            # before the next step.
            await asyncio.sleep(0)

    async def _advance(self, batch: list[Running]) -> bool:
        """Launch the batch's step (carrying the first waiting chunk), then
        hand out the previous launch's tokens. False where the batch must
        ``step`` instead (the engine would not launch it), with nothing
        launched left over."""
        ahead, self._ahead = self._ahead, None
        engine, releases = self._engine, self._to_release
        # Taken here and submitted below with no await between: a prompt given
        # up after this finds its chunk gone and the call's result released.
        chunk = self._chunks.popleft() if batch and self._chunks else None

        def launch_then_collect() -> tuple[Any, Any, Any]:
            # One hop to the engine thread: free what finished, queue the next
            # step, then wait for the last. Errors come back as values: each is
            # its batch's (or its chunk's).
            _release_all(engine, releases)
            launched: Any = None
            if batch:
                try:
                    seqs = [e.seq for e in batch]
                    launched = engine.launch(seqs) if chunk is None else engine.launch(seqs, chunk=chunk.prefilling)
                except Exception as exc:
                    launched = exc
            # What the chunk gave; _NOT_RUN where the step ran none (it could not launch, or failed).
            chunk_out: Any = _NOT_RUN
            if chunk is not None and getattr(launched, "carried", False):
                chunk_out = launched.chunk
            collected: Any = None
            if ahead is not None:
                try:
                    collected = engine.collect(ahead[0])
                except Exception as exc:
                    collected = exc
            return launched, collected, chunk_out

        try:
            launched, tokens, chunk_out = await self._thread.call(launch_then_collect, urgent=True)
        except Exception as exc:  # the engine thread itself failed
            self._fail(batch + (ahead[1] if ahead is not None else []), exc)
            if chunk is not None:
                self._chunk_done(chunk, exc)
            return True
        if chunk is not None:
            if chunk_out is _NOT_RUN:
                self._requeue(chunk)  # for the next step (stepped, not launched) or alone
            else:
                self._chunk_done(chunk, chunk_out)
        if ahead is not None:
            if isinstance(tokens, BaseException):
                self._fail(ahead[1], tokens)
            else:
                self._hand_out(ahead[1], tokens)
        if isinstance(launched, BaseException):
            self._fail(batch, launched)
            return True
        if launched is not None:
            self._ahead = (launched, batch)
            self._set_aside(batch, launched.stepped)
        await asyncio.sleep(0)
        # Not launched: step it, unless tokens were just handed out (the batch may have changed).
        return launched is not None or ahead is not None

    def _fail(self, batch: list[Running], exc: BaseException) -> None:
        log.error("decode_step_failed", batch=len(batch), error=repr(exc), exc_info=exc)
        for entry in batch:
            entry.queue.put_nowait(exc)
            entry.done = True

    def _hand_out(self, batch: list[Running], tokens: list[int | None]) -> None:
        now = time.perf_counter()
        if self._handed_out_at is not None:
            STEP_INTERVAL.observe(now - self._handed_out_at)
        self._handed_out_at = now
        STEP_ROWS.observe(len(batch))
        for entry, token in zip(batch, tokens, strict=True):
            if entry.done or token is None:
                continue
            entry.queue.put_nowait(token)
            if entry.is_last(token):
                entry.queue.put_nowait(_END)
                entry.done = True

    def _drop_done(self) -> None:
        for entry in [e for e in self._running + self._waiting if e.done]:
            (self._running if entry in self._running else self._waiting).remove(entry)
            self._to_release.append(entry.seq)


def _release_all(engine: Any, seqs: collections.deque[Any]) -> None:
    """Each taken and released; one that fails to is logged and the rest go
    on (a release is cleanup: its failure must not fail the step it rides with)."""
    while seqs:
        seq = seqs.popleft()  # only the engine's thread takes from it
        try:
            engine.release(seq)
        except Exception as exc:
            RELEASE_FAILURES.inc()
            log.error("release_failed", error=repr(exc), exc_info=exc)


def _releasing(engine: Any, seqs: collections.deque[Any], then: Callable[..., T] | None = None) -> Callable[..., Any]:
    """A call for the engine's thread: ``seqs`` released, then ``then``; named
    for what it runs, as the engine-call metrics show it."""

    def release(*args: Any) -> Any:
        _release_all(engine, seqs)
        return then(*args) if then is not None else None

    if then is not None:
        release.__name__ = getattr(then, "__name__", "call")
    return release
