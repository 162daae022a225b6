"""SGLang's offline engine (``sglang.Engine``) inside an mmpipe worker.

The worker gives SGLang the processor's prompt ids with each media item's
placeholder expanded to its embeddings' length, and the embeddings mmpipe's
encoder made (its own vision tower on torch), as SGLang's
``processor_output`` input: ``precomputed_embeddings`` beside
``image_grid_thw``, from which SGLang places Qwen-VL's M-RoPE positions.
Checked on the CPU with the tiny Qwen2-VL: transformers' ``generate()``
tokens exactly, for text and images (an image given to SGLang as pixels
gives them too, but E/PD's prefill worker has only embeddings, and one
encoder for every engine keeps the embedding cache and its digests).

SGLang takes and gives token ids; the hop's emitter detokenizes, as for
the other engines. Its own tokenizer still loads (``skip_tokenizer_init``
would refuse ``min_new_tokens``: SGLang reads EOS from its tokenizer).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch

from schemas.errors import InvalidRequest
from schemas.processed import MediaKind, SglangKv
from stages.engine_health import watch_engine
from stages.families import MediaEmbedding
from stages.ports import free_port
from stages.sampling import Logprobs, SamplingConfig
from stages.sglang_engine import disaggregation_of, metrics

log = structlog.get_logger(__name__)

# SGLang's arguments on a CPU host: float32, its torch attention, no CUDA
# graphs, and a KV pool sized by tokens. On the CPU SGLang sizes the pool from the
# host's free memory before and after its weights load, less a slack of
# (1 - mem_fraction_static) of the first figure: at 0.05, other processes
# starting beside it (a second engine) left it "no memory for the KV cache".
# A wide slack and a cap in tokens keep the pool small and the start sure.
CPU_DEFAULTS: dict[str, Any] = {
    "device": "cpu",
    # The built-in engine's dtype on a CPU: generate()'s float32 tokens.
    # SGLang's "auto" runs a float32 checkpoint in float16: short greedy
    # answers still matched, a 300-token one parted from generate()'s.
    "dtype": "float32",
    "attention_backend": "torch_native",
    "disable_cuda_graph": True,
    # Its overlap scheduler counted a token for the penalties one step late
    # (checked on the CPU: generate()'s tokens with the overlap off).
    "disable_overlap_schedule": True,
    "mem_fraction_static": 0.3,
    "max_total_tokens": 65536,
}


def require_sglang() -> None:
    try:
        import sglang  # noqa: F401
    except ImportError as exc:
        raise SystemExit(
            "--engine sglang needs SGLang: bash deploy/install-sglang.sh (a CPU venv, .venv-sglang), "
            "or pip install 'mmpipe[sglang]' on a GPU host"
        ) from exc


# SGLang's KV transfer engine between a prefill and a decode engine: NIXL
# (UCX), which mmpipe installs anyway; --sglang-arg
# disaggregation_transfer_backend=mooncake takes Mooncake's.
TRANSFER_BACKEND = "nixl"


@dataclass(frozen=True)
class Delta:
    """New tokens of one request, and whether SGLang has finished it."""

    token_ids: list[int]
    finished: bool
    # Prompt tokens SGLang's prefix cache (RadixAttention) held, as it tells them.
    cached_tokens: int | None = None
    # Why SGLang ended the request itself ("abort" finishes: a failed KV
    # transfer, its own checks), where it did.
    aborted: str | None = None
    # Each new token's logprob and its step's best (where asked for).
    logprobs: list[Logprobs] | None = None
    # The prompt's, each token's after the first (where asked for; once).
    prompt_logprobs: list[Logprobs] | None = None


class SglangEngine:
    # How often SGLang's load is read into the metrics while it runs.
    load_interval_s = 1.0

    def __init__(
        self, model_dir: Path, args: dict[str, Any] | None = None, device: str = "cpu", role: str = "sglang"
    ) -> None:
        if device == "cpu":
            # What SGLang wants on a CPU, read by its scheduler processes as
            # they start: its CPU engine (else it imports vLLM for the
            # rotary), no inductor compile of the vision rotary (21 s, the
            # same tokens).
            os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
            os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
        require_sglang()
        from transformers import AutoConfig, AutoTokenizer

        from stages.torch_engine.engine import checkpoint_eos_ids

        self.model_dir = Path(model_dir)
        self.device = device
        defaults = CPU_DEFAULTS if device == "cpu" else {"device": device}
        # Prefill and decode apart: SGLang's own PD disaggregation.
        self.disaggregation = disaggregation_of(role)
        pd: dict[str, Any] = {}
        if self.disaggregation is not None:
            pd = {"disaggregation_mode": self.disaggregation, "disaggregation_transfer_backend": TRANSFER_BACKEND}
            if self.disaggregation == "prefill":
                pd["disaggregation_bootstrap_port"] = free_port()
            elif device == "cpu":
                # Its default backup of retracted requests pins host memory through CUDA.
                pd["disaggregation_decode_retraction_backup"] = "cpu_tensor"
        self.args: dict[str, Any] = {
            "model_path": str(self.model_dir),
            "log_level": "warning",
            **defaults,
            **pd,
            **(args or {}),
        }
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
        config = AutoConfig.from_pretrained(str(self.model_dir))
        vision = getattr(config, "vision_config", None)
        if vision is not None and hasattr(vision, "in_channels") and "json_model_override_args" not in self.args:
            # transformers 5 names it in_channels; SGLang's Qwen-VL towers read in_chans.
            override = {"vision_config": {"in_chans": int(vision.in_channels)}}
            self.args["json_model_override_args"] = json.dumps(override)
        self.hidden_size = int(config.get_text_config().hidden_size)
        self.eos_token_ids = checkpoint_eos_ids(self.model_dir, config)
        self.max_model_len = 0
        self.role = role
        self._engine: Any = None
        self._load_reader: asyncio.Task[None] | None = None
        self._watch: asyncio.Task[None] | None = None
        # Why SGLang is known dead (its SIGQUIT), where it is.
        self._dead = ""

    async def start(self) -> None:
        """Start SGLang's engine: its scheduler and detokenizer processes, the
        model load (tens of seconds). Its tokenizer manager then runs on this
        worker's event loop."""
        import sglang

        # Logprobs as the model gave them (vLLM's default, the built-in
        # engine's), not after a sampled row's temperature and top-p.
        os.environ.setdefault("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")
        if self.disaggregation == "prefill" and self.device == "cpu":
            # Sending a cached prefix's KV early records a CUDA event: off on a CPU.
            os.environ.setdefault("SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX", "0")
        # Its own info lines (every server argument, at each start) only at debug.
        if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
            logging.getLogger("sglang").setLevel(logging.WARNING)
        engine = await asyncio.to_thread(lambda: sglang.Engine(**self.args))
        self._engine = engine
        # SGLang's tokenizer manager puts signal handlers on the loop it runs
        # on (this worker's) as it first serves: SIGTERM to drain SGLang
        # alone, and SIGQUIT (a child process failed) to kill the whole
        # process tree, the worker with it. Registered now, and ours: the
        # worker's own stop, which drains mmpipe's work first.
        engine.tokenizer_manager.signal_handler_class = self._signal_handlers
        engine.tokenizer_manager.auto_create_handle_loop()
        self.max_model_len = int(engine.tokenizer_manager.context_len)
        metrics.declare(self.role)
        self._load_reader = asyncio.create_task(self._read_loads(engine))
        # The worker stops once one of SGLang's processes is gone.
        self._watch = asyncio.create_task(watch_engine(self, "sglang"))
        log.info("sglang_engine_started", model=str(self.model_dir), max_model_len=self.max_model_len, args=self.args)

    def _signal_handlers(self, tokenizer_manager: Any) -> Any:
        """Stands in for SGLang's ``SignalHandler`` on the worker's loop."""
        engine = self

        class Handlers:
            def sigterm_handler(self, signum: Any = None, frame: Any = None) -> None:
                # The worker stops on SIGINT as on SIGTERM; SGLang took SIGTERM's handler.
                os.kill(os.getpid(), signal.SIGINT)

            def running_phase_sigquit_handler(self, signum: Any = None, frame: Any = None) -> None:
                engine._dead = "a process of SGLang's failed (SIGQUIT from it)"
                log.error("sglang_engine_dead", error=engine._dead, pid=os.getpid())
                os.kill(os.getpid(), signal.SIGINT)

        return Handlers()

    async def _read_loads(self, engine: Any) -> None:
        while True:
            try:
                metrics.record_load(self.role, await engine.tokenizer_manager.get_loads())
            except Exception as exc:  # a stat, not the service: logged, never fatal
                log.warning("sglang_load_unread", error=repr(exc))
            await asyncio.sleep(self.load_interval_s)

    def close(self) -> None:
        for task in (self._load_reader, self._watch):
            if task is not None:
                task.cancel()
        self._load_reader = self._watch = None
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.shutdown()

    def bootstrap(self, room: int, resumed: int) -> SglangKv:
        """Where a decode engine finds this prefill engine's KV of ``room``."""
        assert self.disaggregation == "prefill", "only a prefill engine has a bootstrap server"
        host = str(self.args.get("host") or "127.0.0.1")
        if host in ("0.0.0.0", "::"):  # bound everywhere: tell the others this host's own address
            host = socket.gethostbyname(socket.gethostname())
        return SglangKv(host, int(self.args["disaggregation_bootstrap_port"]), room, resumed)

    async def check_health(self) -> None:
        """Raises where one of SGLang's processes is gone."""
        if self._engine is None:
            raise RuntimeError("the SGLang engine is not running")
        if self._dead:
            raise RuntimeError(self._dead)
        import psutil  # SGLang's own dependency

        for pid in self._engine.get_all_child_pids():
            try:
                # A killed child stays a zombie until its parent reaps it.
                gone = psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                gone = True
            if gone:
                raise RuntimeError(f"SGLang's process {pid} is gone")

    async def stream(
        self,
        request_id: str,
        prompt_ids: list[int],
        media: list[MediaEmbedding],
        sampling: SamplingConfig,
        kv: SglangKv | None = None,
    ) -> AsyncGenerator[Delta, None]:
        """One request's new tokens as SGLang makes them. ``prompt_ids`` hold
        each media item's placeholders already expanded to its tokens. With
        prefill and decode apart, ``kv`` names the prefill engine's bootstrap
        server and the request's room, on both sides."""
        assert self._engine is not None, "start() the engine first"
        extra: dict[str, Any] = {}
        if kv is not None:
            extra = {
                "bootstrap_host": kv.bootstrap_host,
                "bootstrap_port": kv.bootstrap_port,
                "bootstrap_room": kv.room,
            }
        if sampling.logprobs is not None or sampling.prompt_logprobs is not None:
            # One top count for the prompt's and the new tokens' (each list cut to its own).
            top = max(sampling.logprobs or 0, sampling.prompt_logprobs or 0)
            start = -1 if sampling.prompt_logprobs is None else 0  # 0: from the prompt's first token
            extra |= {"return_logprob": True, "top_logprobs_num": top, "logprob_start_len": start}
        gen = await self._engine.async_generate(
            input_ids=prompt_ids,
            image_data=_image_data(media),
            sampling_params=sampling_params(sampling),
            stream=True,
            rid=request_id,
            **extra,
        )
        seen = 0
        try:
            first = await anext(gen)
        except StopAsyncIteration:
            return
        except ValueError as exc:
            # SGLang's checks of a request (its context, its parameters) raise ValueError before it runs.
            raise InvalidRequest(f"SGLang refused the request: {exc}") from None
        meta: dict[str, Any] = {}
        try:
            async for out in _chain(first, gen):
                ids = [int(t) for t in out["output_ids"]]  # the whole output so far
                meta = out.get("meta_info") or {}
                cached = meta.get("cached_tokens")
                finish = meta.get("finish_reason")
                aborted = None
                if isinstance(finish, dict) and finish.get("type") == "abort":
                    aborted = str(finish.get("message") or "aborted")
                logprobs = None
                if sampling.logprobs is not None:
                    logprobs = _logprobs(meta, "output", seen, len(ids), sampling.logprobs)
                prompt = None
                if sampling.prompt_logprobs is not None and not seen and meta.get("input_token_logprobs"):
                    # Its first entry has no logprob: nothing comes before the first token.
                    count = len(meta["input_token_logprobs"])
                    prompt = _logprobs(meta, "input", 1, count, sampling.prompt_logprobs)
                yield Delta(
                    ids[seen:],
                    finish is not None,
                    int(cached) if cached is not None else None,
                    aborted,
                    logprobs,
                    prompt,
                )
                seen = len(ids)
        finally:
            if meta:  # finished, or left early (aborted): what it cost so far
                metrics.record_request(self.role, meta)

    def abort(self, request_id: str) -> None:
        if self._engine is not None:
            self._engine.tokenizer_manager.abort_request(request_id)


def sampling_params(config: SamplingConfig) -> dict[str, Any]:
    """SGLang's sampling parameters for one request. Structured output goes
    as the EBNF of the grammar mmpipe's own engine compiles (xgrammar's, as
    SGLang's default grammar backend reads it), so every kind (vLLM's
    choice and compact JSON included) means the same on each engine."""
    params: dict[str, Any] = {
        "temperature": config.temperature,
        "top_p": config.top_p,
        "min_p": config.min_p,
        "max_new_tokens": config.max_tokens,
        "min_new_tokens": config.min_tokens,
        "ignore_eos": config.ignore_eos,
        "presence_penalty": config.presence_penalty,
        "frequency_penalty": config.frequency_penalty,
        "repetition_penalty": config.repetition_penalty,
    }
    if config.top_k > 0:
        params["top_k"] = config.top_k
    if config.stop_token_ids:
        params["stop_token_ids"] = sorted(config.stop_token_ids)
    if not config.greedy:
        params["sampling_seed"] = config.seed
    if config.logit_bias:
        params["logit_bias"] = {str(token): float(bias) for token, bias in config.logit_bias}
    if config.structured is not None:
        from stages import structured

        params["ebnf"] = str(structured.grammar(config.structured))
    return params


def _logprobs(meta: dict[str, Any], side: str, start: int, end: int, top: int) -> list[Logprobs]:
    """Tokens start..end's logprobs and their ``top`` best from SGLang's
    ``meta_info``, ``side`` ``input`` (the prompt) or ``output`` (its lists
    hold every token so far: (logprob, id, text) each, the best first)."""
    chosen = meta.get(f"{side}_token_logprobs") or []
    tops = meta.get(f"{side}_top_logprobs") or []
    out = []
    for i in range(start, end):
        best = (tops[i] if i < len(tops) and tops[i] else [])[:top]
        out.append(Logprobs(float(chosen[i][0]), tuple((int(t), float(lp)) for lp, t, *_ in best)))
    return out


def _image_data(media: list[MediaEmbedding]) -> list[dict[str, Any]] | None:
    """The request's images as SGLang's ``processor_output`` (one entry for
    them all, as it takes precomputed inputs): their embeddings in prompt
    order and each one's grid."""
    if not media:
        return None
    if any(m.kind is not MediaKind.IMAGE for m in media):
        raise InvalidRequest("--engine sglang takes images so far, not video or audio")
    return [
        {
            "format": "processor_output",
            "precomputed_embeddings": torch.cat([m.embeddings.cpu() for m in media]),
            "image_grid_thw": torch.tensor([list(m.grid_thw) for m in media]),
        }
    ]


async def _chain(first: Any, rest: AsyncGenerator[Any, None]) -> AsyncGenerator[Any, None]:
    yield first
    async for item in rest:
        yield item
