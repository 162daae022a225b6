"""Requests processed in the bridge: the chat template, the tokens, the
limits and the route, before anything is queued.

As NVIDIA Dynamo's frontend and vLLM's API server tokenize in the process
that took the HTTP request, a bridge given the model (``mmpipe up`` does,
unless it starts processor workers) publishes each request straight to its
first hop's queue: one JetStream hop less on every request's way to its
first token (2 to 4.5 ms measured, more with an image inline), and a bad
request is answered before anything is queued. Without a model the bridge
queues the raw request for processor workers, as before.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipeline.transport.base import TransportSettings
from schemas.settings import section, setting
from stages.media.policy import MediaPolicy
from stages.processor import ProcessorLimits

if TYPE_CHECKING:
    from schemas.processed import ProcessedRequest
    from schemas.request import GenerateRequest
    from stages.contract import TensorStore
    from stages.processor import Processor

# A body past this many bytes is processed on a thread: a long prompt's
# template and tokens would hold up every other request on the event loop.
_INLINE_BODY_BYTES = 64 << 10


@dataclass(frozen=True)
class BridgeProcessing:
    model: str = setting(
        "",
        help="the model whose requests the bridge processes itself (a built-in name or a checkpoint folder, as "
        "the workers'): requests go straight to their first hop; unset: processor workers process them",
    )
    served_model_name: str | None = setting(
        None, help="with --model: the model name clients send (unset: the built-in name, or the folder's)"
    )
    modalities: str = setting(
        "image", help="with --model: media kinds accepted, comma separated: image, video, audio (others get 422)"
    )
    image_model: str = setting(
        "",
        help="the generate-image workers' model (tiny-sd or a diffusers pipeline folder, as theirs): listed in "
        "/v1/models, its workers waited for by /health (unset: none)",
    )
    limits: ProcessorLimits = section(ProcessorLimits, "request limits (with --model)")
    media: MediaPolicy = section(MediaPolicy, "media fetched and decoded here (with --model and --frontend-decode)")
    transport: str = setting(
        "auto",
        choices=("auto", "nixl", "nats"),
        help="with --frontend-decode: how the decoded media go to the encoding workers (as the workers')",
    )
    tensor_settings: TransportSettings = section(TransportSettings, "decoded media held for the encoding workers")


def load_processor(processing: BridgeProcessing, mode: str, tensors: TensorStore | None = None) -> Processor | None:
    """The processor a bridge runs, or None where it has no model. With
    --frontend-decode, ``tensors`` holds the media it decodes."""
    if not processing.model:
        return None
    from pipeline.serve import build_processor
    from stages.models import resolve_model

    spec = resolve_model(processing.model, processing.served_model_name)
    return build_processor(spec, mode, processing.limits, processing.modalities, processing.media, tensors)


async def process(processor: Processor, request: GenerateRequest, body_bytes: int) -> ProcessedRequest:
    if body_bytes <= _INLINE_BODY_BYTES:
        return processor.process(request)
    return await asyncio.to_thread(processor.process, request)


async def decoded(processor: Processor, processed: ProcessedRequest) -> ProcessedRequest:
    """With --frontend-decode, ``processed`` with its media decoded and held
    here; it then travels without the inline bytes (this bridge holds the
    request as it arrived, for a restart)."""
    if processor.frontend is None:
        return processed
    out = await processor.frontend.decode(processed)
    return out if out.decoded is None else out.without_inline_media()
