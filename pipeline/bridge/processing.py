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

from schemas.settings import section, setting
from stages.processor import ProcessorLimits

if TYPE_CHECKING:
    from schemas.processed import ProcessedRequest
    from schemas.request import GenerateRequest
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
    limits: ProcessorLimits = section(ProcessorLimits, "request limits (with --model)")


def load_processor(processing: BridgeProcessing, mode: str) -> Processor | None:
    """The processor a bridge runs, or None where it has no model."""
    if not processing.model:
        return None
    from pipeline.serve import parse_modalities
    from stages.models import resolve_model
    from stages.models.traits import load_traits
    from stages.processor import Processor

    spec = resolve_model(processing.model, processing.served_model_name)
    return Processor(
        load_traits(spec), mode=mode, limits=processing.limits, modalities=parse_modalities(processing.modalities)
    )


async def process(processor: Processor, request: GenerateRequest, body_bytes: int) -> ProcessedRequest:
    if body_bytes <= _INLINE_BODY_BYTES:
        return processor.process(request)
    return await asyncio.to_thread(processor.process, request)
