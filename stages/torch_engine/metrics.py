"""The built-in engine as Prometheus metrics, on the worker's ``/metrics``
beside the rest: its KV pool (named as vLLM's: usage and preemptions), and
where its one thread's time goes (each call's wait in the thread's queue and
its run, the decode loop's step interval and rows), so a throughput ceiling
can be read off a running worker instead of guessed."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

KV_USAGE = Gauge("mmpipe_kv_cache_usage", "Fraction of the KV pool's blocks held by sequences")
# vLLM's prefix_cache_queries and prefix_cache_hits: prompt tokens looked up, and found.
PREFIX_QUERIES = Counter("mmpipe_prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
PREFIX_HITS = Counter("mmpipe_prefix_cache_hits", "Prompt tokens whose KV blocks the prefix cache held")
PREFILL_FORKS = Counter(
    "mmpipe_prefill_forks_total", "Sequences forked from another's prefill of the same prompt (a choice of n)"
)
# vLLM v1's mixed batches: a long prompt's chunk in the decode step's forward, in the
# same engine call right after it (its own graph), or with no step to ride.
PREFILL_CHUNKS = Counter(
    "mmpipe_prefill_chunks_total",
    "Chunks of long prompts prefilled, by how: in a decode step's forward (mixed), right after a step "
    "(after_step) or on their own (alone)",
    ["how"],
)
WARM_UP_FAILURES = Counter(
    "mmpipe_engine_warm_up_failures_total", "Engine warm-ups at start that failed (the worker runs on)", ["role"]
)
PREEMPTIONS = Counter("mmpipe_preemptions_total", "Running sequences swapped out of the KV pool to let older ones grow")

# Engine calls and steps last from tens of microseconds (a release) to tens
# of milliseconds (a batch of images through the tower).
_CALL = (0.0001, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.025, 0.05, 0.1, 0.25, 1, 5)
ENGINE_CALL_WAIT = Histogram(
    "mmpipe_engine_call_wait_seconds",
    "Time an engine call waited for the engine's thread, by call",
    ["call"],
    buckets=_CALL,
)
ENGINE_CALL_RUN = Histogram(
    "mmpipe_engine_call_seconds", "Time an engine call held the engine's thread, by call", ["call"], buckets=_CALL
)
# Of the calls, those the caller ran on its own thread, the engine's being idle (EngineThread._inline).
ENGINE_CALL_INLINE = Counter(
    "mmpipe_engine_call_inline_total", "Engine calls run on their caller's thread, the engine's idle, by call", ["call"]
)
# Of a call's run, the time the thread was on a CPU: the rest it waited,
# for the GPU (a blocking sync) or for the GIL, which the process's other
# threads held.
ENGINE_CALL_CPU = Counter(
    "mmpipe_engine_call_cpu_seconds", "CPU time of the engine's thread during its calls, by call", ["call"]
)
# Of a call, the span of its work on the GPU (its events on the current stream).
ENGINE_CALL_GPU = Counter(
    "mmpipe_engine_call_gpu_seconds", "Time the GPU spent on an engine call's work, by call (CUDA only)", ["call"]
)
RELEASE_FAILURES = Counter(
    "mmpipe_engine_release_failures", "Finished sequences whose release failed (their blocks may stay held)"
)
STEP_INTERVAL = Histogram(
    "mmpipe_decode_step_interval_seconds",
    "Time between two hand-outs of the decode loop's tokens (a running sequence's inter-token time in the worker)",
    buckets=_CALL,
)
STEP_ROWS = Histogram(
    "mmpipe_decode_batch_rows", "Sequences in one decode step", buckets=(1, 2, 4, 8, 16, 24, 32, 48, 64, 128, 256)
)
# What an engine core process (--engine-process) keeps for its worker between
# messages: a count that grows without load is a leak.
CORE_HELD = Gauge(
    "mmpipe_engine_core_held", "Prefilled sequences and encoded media an engine core holds for its worker", ["what"]
)
