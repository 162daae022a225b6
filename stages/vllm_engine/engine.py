"""vLLM's AsyncLLM behind the calls mmpipe's stage makes: start, one
request's token stream, a prefill that hands its KV cache to another engine
(the KV connector's producer), abort, close.

Importing this module does not import vLLM; ``start()`` does (after
``require_vllm`` said it is there). The tokenizer and the EOS ids come from
the checkpoint directory, as the built-in engine reads them, so the chunks
mmpipe emits (text, stop strings, finish) are the same for both engines.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from schemas.errors import InvalidRequest, ModelNotFound
from schemas.request import StructuredOutput
from stages.engine_health import watch_engine
from stages.families import MediaEmbedding
from stages.ports import free_port
from stages.sampling import Logprobs, SamplingConfig
from stages.vllm_engine.args import STORAGE_TTL_S, KvConnectorSettings, require_vllm
from stages.vllm_engine.media import mm_prompt
from stages.vllm_engine.metrics import stat_logger_factory
from stages.vllm_engine.storage import StoragePruner, written_folders

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class Delta:
    """New tokens of one request, and whether vLLM has finished it."""

    token_ids: list[int]
    finished: bool
    # Each token's logprob and its step's best ``SamplingConfig.logprobs`` (where asked for).
    logprobs: list[Logprobs] | None = None
    # On the first delta, where asked for: each prompt token's after the first.
    prompt_logprobs: list[Logprobs] | None = None
    # Prompt tokens vLLM found in its prefix cache (a decode engine: the
    # prefill engine's, which its KV connector passes on); None: not told.
    cached_tokens: int | None = None


class VllmEngine:
    def __init__(
        self,
        model_dir: Path,
        args: dict[str, Any] | None = None,
        role: str = "",
        kv: KvConnectorSettings | None = None,
        storage_ttl_s: float = STORAGE_TTL_S,
    ) -> None:
        require_vllm()
        from transformers import AutoConfig, AutoTokenizer

        from stages.torch_engine.engine import checkpoint_eos_ids

        self.model_dir = Path(model_dir)
        # mmpipe passes image embeddings (its encoder's) to vLLM: enable_mm_embeds.
        self.args: dict[str, Any] = {"model": str(self.model_dir), "enable_mm_embeds": True, **(args or {})}
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
        config = AutoConfig.from_pretrained(str(self.model_dir))
        # Qwen2.5-VL: video positions by seconds, which video_embeds inputs cannot carry in vLLM 0.32.
        self.timed_video = config.model_type == "qwen2_5_vl"
        # The width prompt embeddings must have.
        self.hidden_size = int(config.get_text_config().hidden_size)
        self.eos_token_ids = checkpoint_eos_ids(self.model_dir, config)
        self.role = role
        self.kv = kv or KvConnectorSettings()
        self.max_model_len = 0
        self._llm: Any = None
        self._watch: asyncio.Task[None] | None = None
        # The example connectors' folders this engine writes, pruned of what
        # is older than storage_ttl_s while it runs (storage.py).
        self.pruner = StoragePruner(written_folders(self.args), storage_ttl_s)
        # LoRA adapters loaded into vLLM (vllm.lora.request.LoRARequest by name), each under an id of its own.
        self.loras: dict[str, Any] = {}
        self._lora_ids = itertools.count(1)

    async def start(self) -> None:
        """Start vLLM's engine (its engine-core process, the model load and
        warm-up: tens of seconds). Call from the worker's event loop."""
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        try:
            engine_args = AsyncEngineArgs(**self.args)
        except TypeError as exc:
            raise ValueError(f"vLLM engine arguments {sorted(self.args)}: {exc}") from None
        connector = (self.args.get("kv_transfer_config") or {}).get("kv_connector")
        if connector == "NixlConnector":
            # vLLM reads its NIXL side channel from the environment (its
            # engine-core child inherits it): a port of this worker's own.
            port = self.kv.port or int(os.environ.get("VLLM_NIXL_SIDE_CHANNEL_PORT") or 0) or free_port()
            os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(port)
        self._llm = AsyncLLM.from_engine_args(engine_args, stat_loggers=[stat_logger_factory(self.role)])
        self.max_model_len = int(self._llm.model_config.max_model_len)
        # The worker stops once vLLM's engine core is dead.
        self._watch = asyncio.create_task(watch_engine(self, "vllm"))
        self.pruner.start()
        log.info(
            "vllm_engine_started",
            model=str(self.model_dir),
            max_model_len=self.max_model_len,
            args=self.args,
            kv_connector=connector,
            side_channel=os.environ.get("VLLM_NIXL_SIDE_CHANNEL_PORT") if connector == "NixlConnector" else None,
        )

    def close(self) -> None:
        self.pruner.close()
        if self._watch is not None:
            self._watch.cancel()
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None

    @property
    def unfinished(self) -> int:
        """Requests vLLM still holds (running or waiting)."""
        return int(self._llm.get_num_unfinished_requests()) if self._llm is not None else 0

    async def stream(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        media: list[MediaEmbedding],
        sampling: SamplingConfig,
        kv_transfer_params: dict[str, Any] | None = None,
        lora: str = "",
        embeds: Any = None,
    ) -> AsyncGenerator[Delta, None]:
        """One request's new tokens as vLLM makes them. ``prompt_token_ids``
        hold one placeholder per image; vLLM expands each to its embeddings.
        ``kv_transfer_params``: what a prefill engine returned (the KV
        connector's consumer loads the prompt's cache with them). ``lora``:
        the adapter (``add_lora``'s name) the language model runs with.
        ``embeds``: the prompt as input embeddings [tokens, hidden] instead
        of ``prompt_token_ids`` (vLLM's ``enable_prompt_embeds``)."""
        from vllm.sampling_params import RequestOutputKind

        assert self._llm is not None, "start() the engine first"
        params = self._params(sampling, RequestOutputKind.DELTA, kv_transfer_params)
        inputs = _prompt(prompt_token_ids, media, self.timed_video) if embeds is None else {"prompt_embeds": embeds}
        async for out in self._llm.generate(inputs, params, request_id, lora_request=self.lora_request(lora)):
            done = out.outputs[0]
            tokens = [int(t) for t in done.token_ids]
            asked = sampling.logprobs is not None and done.logprobs is not None
            logprobs = (
                [
                    _logprobs(t, step, sampling.logprobs or 0)
                    for t, step in zip(tokens, done.logprobs or [], strict=True)
                ]
                if asked
                else None
            )
            prompt = None
            if sampling.prompt_logprobs is not None and out.prompt_logprobs:
                # vLLM's first entry is None: nothing comes before the first token.
                steps = zip(prompt_token_ids[1:], out.prompt_logprobs[1:], strict=True)
                prompt = [_logprobs(t, step, sampling.prompt_logprobs) for t, step in steps]
            cached = getattr(out, "num_cached_tokens", None)
            yield Delta(tokens, bool(out.finished), logprobs, prompt, int(cached) if cached is not None else None)

    async def prefill(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        media: list[MediaEmbedding],
        sampling: SamplingConfig,
        lora: str = "",
    ) -> dict[str, Any]:
        """Prefill the prompt for another engine to decode: one token's
        budget and ``do_remote_decode``, so the KV connector's producer keeps
        (or stores) the prompt's cache. Returns the ``kv_transfer_params``
        the decode engine needs (empty where the connector needs none)."""
        from vllm.sampling_params import RequestOutputKind

        assert self._llm is not None, "start() the engine first"
        one = SamplingConfig(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            seed=sampling.seed,
            min_tokens=0,
            ignore_eos=True,
            max_tokens=1,
        )
        params = self._params(one, RequestOutputKind.FINAL_ONLY, {"do_remote_decode": True})
        got: dict[str, Any] = {}
        prompt = _prompt(prompt_token_ids, media, self.timed_video)
        async for out in self._llm.generate(prompt, params, request_id, lora_request=self.lora_request(lora)):
            got = dict(out.kv_transfer_params or {})
        return got

    async def add_lora(self, name: str, path: str) -> None:
        """Load the LoRA adapter at ``path`` (PEFT's format) into vLLM as
        ``name`` (again from the same path: nothing to do). vLLM must have
        been started with ``enable_lora`` (and a ``max_lora_rank`` at least
        the adapter's)."""
        from vllm.lora.request import LoRARequest

        assert self._llm is not None, "start() the engine first"
        if not self.args.get("enable_lora"):
            raise InvalidRequest("LoRA adapters on --engine vllm need vLLM's LoRA: --vllm-arg enable_lora=true")
        where = _checked_adapter(name, path)
        loaded = self.loras.get(name)
        if loaded is not None:
            if loaded.lora_path == where:
                return
            raise InvalidRequest(f"LoRA adapter {name!r} is loaded from {loaded.lora_path}; unload it first")
        request = LoRARequest(name, next(self._lora_ids), where)
        try:
            await self._llm.add_lora(request)
        except Exception as exc:  # vLLM's own checks (rank, modules) raise what they raise
            raise InvalidRequest(f"LoRA adapter {name!r}: vLLM refused it: {exc}") from None
        self.loras[name] = request
        log.info("vllm_lora_loaded", name=name, path=request.lora_path, lora_id=request.lora_int_id)

    async def remove_lora(self, name: str) -> None:
        request = self.loras.pop(name, None)
        if request is not None and self._llm is not None:
            await self._llm.remove_lora(request.lora_int_id)

    def lora_request(self, name: str) -> Any:
        """vLLM's LoRARequest of a loaded adapter; None for ""."""
        if not name:
            return None
        try:
            return self.loras[name]
        except KeyError:
            raise ModelNotFound(f"LoRA adapter {name!r} is not loaded on this worker") from None

    def _params(self, sampling: SamplingConfig, kind: Any, kv_transfer_params: dict[str, Any] | None) -> Any:
        from vllm import SamplingParams

        return SamplingParams(
            n=1,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=max(sampling.top_k, 0),
            seed=sampling.seed,
            min_tokens=sampling.min_tokens,
            max_tokens=sampling.max_tokens,
            ignore_eos=sampling.ignore_eos,
            # The model's EOS ids are passed as stop ids (vLLM reads only the
            # tokenizer's own), so ignore_eos has to leave them out here.
            stop_token_ids=sorted({*sampling.stop_token_ids, *(() if sampling.ignore_eos else self.eos_token_ids)}),
            output_kind=kind,
            # vLLM gives the sampled token's and the best ``logprobs`` (raw: the model's own output).
            logprobs=sampling.logprobs,
            prompt_logprobs=sampling.prompt_logprobs,
            presence_penalty=sampling.presence_penalty,
            frequency_penalty=sampling.frequency_penalty,
            logit_bias=dict(sampling.logit_bias) or None,
            repetition_penalty=sampling.repetition_penalty,
            min_p=sampling.min_p,
            structured_outputs=_structured_outputs(sampling.structured),
            # mmpipe detokenizes (stop strings, held-back characters) itself.
            detokenize=False,
            extra_args={"kv_transfer_params": dict(kv_transfer_params)} if kv_transfer_params else None,
        )

    async def abort(self, request_id: str) -> None:
        if self._llm is not None:
            await self._llm.abort(request_id)

    async def check_health(self) -> None:
        """Raises where vLLM's engine core is gone (its process died or it
        failed): what the worker's readiness asks (``health.engine_health``)."""
        if self._llm is not None:  # none before start() and after close(): the worker says why
            await self._llm.check_health()


def _structured_outputs(spec: StructuredOutput | None) -> Any:
    """vLLM's StructuredOutputsParams of the same kind, or None."""
    if spec is None:
        return None
    from vllm.sampling_params import StructuredOutputsParams

    if spec.kind == "json_object":
        return StructuredOutputsParams(json_object=True, disable_any_whitespace=spec.compact)
    if spec.kind == "choice":
        return StructuredOutputsParams(choice=json.loads(spec.text))
    return StructuredOutputsParams(**{spec.kind: spec.text}, disable_any_whitespace=spec.compact)


def _logprobs(token: int, step: dict[int, Any], top: int) -> Logprobs:
    """vLLM's logprobs of one step (token id -> Logprob with its rank): the
    chosen token's, and the ``top`` best by rank."""
    ranked = sorted((lp.rank, t, lp.logprob) for t, lp in step.items() if lp.rank is not None and lp.rank <= top)
    return Logprobs(float(step[token].logprob), tuple((t, float(lp)) for _, t, lp in ranked))


def _prompt(prompt_token_ids: list[int], media: list[MediaEmbedding], timed_video: bool = False) -> dict[str, Any]:
    return mm_prompt(prompt_token_ids, media, timed_video)


def _checked_adapter(name: str, given: str) -> str:
    """The adapter's folder, resolved, once what vLLM reads of it is there
    (vLLM's own error for a missing file names no adapter)."""
    path = Path(given).resolve()
    config = path / "adapter_config.json"
    if not config.is_file():
        raise InvalidRequest(f"LoRA adapter {name!r}: no adapter_config.json in {path}")
    try:
        if not isinstance(json.loads(config.read_text()), dict):
            raise InvalidRequest(f"LoRA adapter {name!r}: adapter_config.json is not an object")
    except (OSError, ValueError) as exc:
        raise InvalidRequest(f"LoRA adapter {name!r}: adapter_config.json unreadable: {exc}") from None
    if not any((path / f).is_file() for f in ("adapter_model.safetensors", "adapter_model.bin")):
        raise InvalidRequest(f"LoRA adapter {name!r}: no adapter_model.safetensors in {path}")
    return str(path)
