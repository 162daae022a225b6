"""The processor: chat template, tokenization with one placeholder per media
item, limits, the sampling seed and the route."""

from __future__ import annotations

import math
import random
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
import structlog
from prometheus_client import Counter

from schemas.errors import (
    ContextLengthExceeded,
    InvalidRequest,
    ModelNotFound,
    TooLarge,
    UnsupportedMedia,
)
from schemas.processed import MediaItem, MediaKind, ProcessedRequest
from schemas.request import (
    MAX_CHOICES,
    AudioPart,
    ChatMessage,
    GenerateRequest,
    ImageEmbedsPart,
    ImagePart,
    ImageURL,
    MediaPart,
    SamplingParams,
    TextPart,
    VideoPart,
)
from schemas.routes import GENERATE_IMAGE, HOP_ROLES, route_for
from schemas.settings import setting
from stages import structured
from stages.chat_tokens import SegmentTokenizer
from stages.contract import HopContext, StageOutput

if TYPE_CHECKING:  # the bridge imports this module, and torch only to decode media
    from stages.media.frontend import FrontendDecoder

log = structlog.get_logger(__name__)

WARM_UP_FAILURES = Counter("mmpipe_processor_warm_up_failures", "Processor warm-ups at start that failed")

_ROLES = ("system", "user", "assistant")
_MEDIA_SCHEMES = ("data:", "https://", "http://", "file://")
# A 28x28 PNG of one colour: the warm-up's image (the processor's and the encoder's).
WARM_UP_IMAGE_URL = (
    "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAABwAAAAcCAIAAAD9b0jDAAAAJ0lEQVR4nGNscFBgoDZgorqJo4aOGjpq6Kiho4aO"
    "Gjpq6Kihg9JQAC9DARhyvFo7AAAAAElFTkSuQmCC"
)


@dataclass(frozen=True)
class ProcessorLimits:
    max_images: int = setting(8, help="images in one request (0: none)")
    max_videos: int = setting(2, help="videos in one request (0: none)")
    max_audios: int = setting(4, help="audio clips in one request (0: none)")
    max_prompt_tokens: int = setting(32_768, help="prompt tokens before media are expanded (413 over it)")
    # Capped by what the context leaves.
    default_max_tokens: int = setting(256, help="max_tokens of a request that gives none")
    max_stop_strings: int = setting(8, help="stop strings in one request")

    def __post_init__(self) -> None:
        for name, least in (("max_prompt_tokens", 1), ("default_max_tokens", 1)):
            if getattr(self, name) < least:
                raise ValueError(f"{name.replace('_', '-')} must be at least {least}")
        for name in ("max_images", "max_videos", "max_audios", "max_stop_strings"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name.replace('_', '-')} must be at least 0")


@dataclass(frozen=True)
class ModelTraits:
    """What the processor needs of a model: no weights."""

    served_name: str
    tokenizer: Any
    max_model_len: int
    # The placeholder token of each media kind the model takes (and mmpipe's
    # adapter for its family runs).
    placeholders: dict[MediaKind, int]
    # Fewest tokens one image can become: a request that cannot fit even then
    # is refused here; the exact check happens at prefill.
    min_tokens_per_image: int = 1
    # The language model's input width (what prompt embeddings must have).
    hidden_size: int = 0
    # A sampled video's frame count is padded to a multiple of this (Qwen-VL: its temporal patch).
    video_frame_multiple: int = 1


class Processor:
    role = "processor"
    input_type = GenerateRequest
    resumes_stream = False

    def __init__(
        self,
        model: ModelTraits,
        mode: str = "epd",
        limits: ProcessorLimits | None = None,
        modalities: frozenset[MediaKind] = frozenset({MediaKind.IMAGE}),
        frontend: FrontendDecoder | None = None,
    ) -> None:
        route_for(mode, True)  # fail at start on an unknown mode
        self.model = model
        # --frontend-decode: the media fetched and decoded here, for the encoding hop to read.
        self.frontend = frontend
        self.mode = mode
        self.limits = limits or ProcessorLimits()
        self.modalities = modalities
        # LoRA adapters served (name -> directory): a request may name one as
        # its model. Kept current by the worker or bridge (pipeline/lora.py).
        self.adapters: dict[str, str] = {}
        # A conversation's earlier turns, tokenized once (stages/chat_tokens.py).
        self._chat_tokens = SegmentTokenizer(model.tokenizer)

    @property
    def models(self) -> list[str]:
        return [self.model.served_name, *sorted(self.adapters)]

    async def start(self) -> None:
        self.warm_up()

    async def close(self) -> None:
        if self.frontend is not None:
            await self.frontend.close()

    def has_room(self) -> bool:
        return True  # holds nothing between requests

    async def canary(self) -> None:
        """The worker's canary health check: a tiny request processed (template, tokenizer, checks)."""
        self.process(
            GenerateRequest(
                request_id="canary",
                model=self.model.served_name,
                messages=[ChatMessage("user", "ok")],
                sampling=SamplingParams(max_tokens=1),
            )
        )

    def warm_up(self) -> None:
        """A chat with a small image processed once before the first request
        (the chat template compiled, the tokenizer's and the image's first
        calls made): the first request of a fresh tiny-model bridge took 11.4
        ms here, the next 0.5 (2-vCPU machine)."""
        parts: list[Any] = [TextPart("ok")]
        images = MediaKind.IMAGE in self.modalities and MediaKind.IMAGE in self.model.placeholders
        if images and self.limits.max_images > 0:
            parts.insert(0, ImagePart(ImageURL(WARM_UP_IMAGE_URL)))
        try:
            self.process(
                GenerateRequest(
                    "warm-up", self.model.served_name, [ChatMessage("user", parts)], SamplingParams(max_tokens=1)
                )
            )
        except Exception as exc:  # requests will say what is wrong; this one is only the first
            WARM_UP_FAILURES.inc()
            log.error("processor_warm_up_failed", model=self.model.served_name, error=repr(exc))

    async def run(
        self, message: GenerateRequest | ProcessedRequest, ctx: HopContext
    ) -> AsyncGenerator[StageOutput, None]:
        assert isinstance(message, GenerateRequest)
        processed = self.process(message)
        yield processed if self.frontend is None else await self.frontend.decode(processed, ctx)

    def process(self, request: GenerateRequest) -> ProcessedRequest:
        lora = ""
        if request.model != self.model.served_name:
            if request.model not in self.adapters:
                served = ", ".join(self.models)
                raise ModelNotFound(f"model {request.model!r} is not served here; served: {served}")
            # The base model with this adapter.
            lora = request.model
        media: list[MediaItem] = []
        if request.prompt_embeds is not None:
            prompt_ids = self._embeds_places(request)
        elif request.prompt is not None:
            prompt_ids = self._prompt_ids(request)
        else:
            template_messages, media = self._template_messages(request.messages)
            self._check_counts(media)
            prompt_ids = self._tokenize(template_messages)
        kind_of = {token: kind for kind, token in self.model.placeholders.items()}
        placeholders = [i for i, t in enumerate(prompt_ids) if t in kind_of]
        if [kind_of[prompt_ids[i]] for i in placeholders] != [m.kind for m in media]:
            raise InvalidRequest(
                f"the prompt holds {len(placeholders)} media placeholders for {len(media)} media items: "
                "do not write media placeholder tokens in text"
            )
        media = [msgspec.structs.replace(m, placeholder_index=i) for m, i in zip(media, placeholders, strict=True)]
        if len(prompt_ids) > self.limits.max_prompt_tokens:
            raise TooLarge(f"prompt of {len(prompt_ids)} tokens; the limit is {self.limits.max_prompt_tokens}")
        # Only images have a known least token count; other media add at least their placeholder.
        max_tokens = self._max_tokens(request, len(prompt_ids), sum(m.kind is MediaKind.IMAGE for m in media))
        self._check_sampling(request)
        if request.sampling.prompt_logprobs is not None and media:
            raise InvalidRequest("the prompt's logprobs are given for a text prompt only")
        route = list(request.route) if request.route else route_for(self.mode, bool(media))
        if request.image is not None and not request.route:
            # The answer is the image's prompt: the model writes it, the image stage draws it.
            if request.group is not None and request.group.size > 1:
                raise InvalidRequest("n choices are not drawn: one answer, then its image (the image's own n)")
            route.append(GENERATE_IMAGE)
        for i, hop in enumerate(route):
            if hop == GENERATE_IMAGE and i == len(route) - 1 and i > 0:
                continue  # after the model's hops, the image stage
            if hop not in HOP_ROLES:
                hops = f"{', '.join(HOP_ROLES)}, then {GENERATE_IMAGE}"
                raise InvalidRequest(f"unknown hop {hop!r} in route; hops: {hops}")
        seed = request.sampling.seed if request.sampling.seed is not None else random.getrandbits(63)
        return ProcessedRequest(
            request=request,
            prompt_token_ids=prompt_ids,
            media=media,
            route=route,
            max_tokens=max_tokens,
            seed=seed,
            lora=lora,
        )

    def _template_messages(self, messages: list[ChatMessage]) -> tuple[list[dict[str, Any]], list[MediaItem]]:
        if not messages:
            raise InvalidRequest("messages must not be empty")
        out: list[dict[str, Any]] = []
        media: list[MediaItem] = []
        for i, message in enumerate(messages):
            if message.role not in _ROLES:
                raise InvalidRequest(f"messages[{i}].role {message.role!r} is not one of {', '.join(_ROLES)}")
            named = {"name": message.name} if message.name is not None else {}
            if isinstance(message.content, str):
                out.append({"role": message.role, "content": message.content, **named})
                continue
            parts: list[dict[str, Any]] = []
            for j, part in enumerate(message.content):
                if isinstance(part, TextPart):
                    parts.append({"type": "text", "text": part.text})
                    continue
                where = f"messages[{i}].content[{j}]"
                item = self._media_item(part, where, [i, j])
                if message.role != "user":
                    raise InvalidRequest(f"messages[{i}]: media are only accepted in user messages")
                # Chat templates look for {"type": "image"} or for an "image"
                # (or "audio", ...) key: give both.
                parts.append({"type": item.kind.value, item.kind.value: ""})
                media.append(item)
            out.append({"role": message.role, "content": parts, **named})
        return out, media

    def _media_item(self, part: MediaPart, where: str, index: list[int]) -> MediaItem:
        if isinstance(part, ImagePart):
            item = MediaItem(MediaKind.IMAGE, part.image_url.url, -1)
        elif isinstance(part, ImageEmbedsPart):
            item = MediaItem(MediaKind.IMAGE, part.image_embeds.url, -1, embeds=True)
        elif isinstance(part, VideoPart):
            v = part.video_url
            item = MediaItem(MediaKind.VIDEO, v.url, -1, num_frames=v.num_frames, fps=v.fps, max_frames=v.max_frames)
        elif isinstance(part, AudioPart):
            item = MediaItem(MediaKind.AUDIO, part.audio_url.url, -1)
        else:
            audio = part.input_audio
            fmt = audio.format.lower()
            if not fmt.isalnum():
                raise InvalidRequest(f"{where}.input_audio.format {audio.format!r} is not a format name")
            # Inline bytes: read from the request's part (see below), like a data: URL.
            item = MediaItem(MediaKind.AUDIO, "data:", -1, format=fmt)
        kind = item.kind.value
        if item.kind not in self.modalities:
            enabled = ", ".join(sorted(m.value for m in self.modalities)) or "none"
            raise UnsupportedMedia(f"{where}: {kind} input is not enabled on this deployment (enabled: {enabled})")
        if item.kind not in self.model.placeholders:
            takes = ", ".join(sorted(m.value for m in self.model.placeholders))
            raise UnsupportedMedia(f"{where}: model {self.model.served_name!r} takes {takes} input, not {kind}")
        if not item.url.startswith(_MEDIA_SCHEMES):
            raise UnsupportedMedia(f"{where}: {kind} URL scheme not supported; use data:, https:// or http://")
        if item.url.startswith("data:"):
            # Inline bytes are read from the request itself, not copied beside it.
            return msgspec.structs.replace(item, url="", part=index)
        return item

    def _check_counts(self, media: list[MediaItem]) -> None:
        caps = {
            MediaKind.IMAGE: self.limits.max_images,
            MediaKind.VIDEO: self.limits.max_videos,
            MediaKind.AUDIO: self.limits.max_audios,
        }
        for kind, cap in caps.items():
            count = sum(m.kind is kind for m in media)
            if count > cap:
                raise TooLarge(f"{count} {kind.value} items in one request; the limit is {cap}")

    def _embeds_places(self, request: GenerateRequest) -> list[int]:
        """A prompt given as its embeddings, checked against the model: as
        many zeros as it has tokens stand for its places (its length is what
        the hops read of its ids; the worker that prefills reads the
        embeddings)."""
        from stages.prompt_embeds import load_prompt_embeds

        assert request.prompt_embeds is not None
        if request.prompt is not None or request.messages:
            raise InvalidRequest("prompt_embeds stand for the prompt: send no prompt or messages with them")
        if request.sampling.prompt_logprobs is not None:
            raise InvalidRequest("the prompt's logprobs need a text prompt, not prompt_embeds")
        return [0] * int(load_prompt_embeds(request.prompt_embeds, self.model.hidden_size).shape[0])

    def _prompt_ids(self, request: GenerateRequest) -> list[int]:
        """A completion's prompt as it is: its text tokenized as vLLM's
        completions do (the tokenizer's special tokens added), or its ids."""
        prompt = request.prompt
        if request.messages:
            raise InvalidRequest("a request has messages or a prompt, not both")
        if isinstance(prompt, str):
            ids = [int(t) for t in self.model.tokenizer(prompt, add_special_tokens=True)["input_ids"]]
        else:
            assert prompt is not None
            vocab = len(self.model.tokenizer)
            if bad := [t for t in prompt if not 0 <= t < vocab]:
                raise InvalidRequest(f"prompt token ids outside the vocabulary (size {vocab}): {bad[:5]}")
            ids = list(prompt)
        if not ids:
            raise InvalidRequest("the prompt is empty")
        return ids

    def _tokenize(self, messages: list[dict[str, Any]]) -> list[int]:
        text = self.model.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self._chat_tokens(text)

    def _max_tokens(self, request: GenerateRequest, prompt_len: int, images: int) -> int:
        # Each placeholder becomes at least min_tokens_per_image tokens.
        least_prompt = prompt_len + images * (self.model.min_tokens_per_image - 1)
        room = self.model.max_model_len - least_prompt
        if room < 1:
            raise ContextLengthExceeded(
                f"the prompt needs at least {least_prompt} tokens; the context is {self.model.max_model_len}"
            )
        asked = request.sampling.max_tokens
        if asked is None:
            return min(self.limits.default_max_tokens, room)
        if asked < 1:
            raise InvalidRequest(f"max_tokens must be at least 1, got {asked}")
        if asked > room:
            raise ContextLengthExceeded(
                f"max_tokens {asked} plus a prompt of at least {least_prompt} tokens exceeds the "
                f"context of {self.model.max_model_len} tokens"
            )
        return asked

    def _check_sampling(self, request: GenerateRequest) -> None:
        if request.group is not None and not 1 <= request.group.size <= MAX_CHOICES:
            raise InvalidRequest(f"group.size must be between 1 and {MAX_CHOICES}; it is {request.group.size}")
        s = request.sampling
        if not (math.isfinite(s.temperature) and 0.0 <= s.temperature <= 2.0):
            raise InvalidRequest(f"temperature must be within [0, 2], got {s.temperature}")
        if not (math.isfinite(s.top_p) and 0.0 < s.top_p <= 1.0):
            raise InvalidRequest(f"top_p must be within (0, 1], got {s.top_p}")
        if s.top_k < 0:
            raise InvalidRequest(f"top_k must be 0 (off) or positive, got {s.top_k}")
        if s.min_tokens < 0 or (s.max_tokens is not None and s.min_tokens > s.max_tokens):
            raise InvalidRequest(f"min_tokens must be within [0, max_tokens], got {s.min_tokens}")
        if len(s.stop) > self.limits.max_stop_strings:
            raise InvalidRequest(f"at most {self.limits.max_stop_strings} stop strings, got {len(s.stop)}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(s, name)
            if not (math.isfinite(value) and -2.0 <= value <= 2.0):
                raise InvalidRequest(f"{name} must be within [-2, 2], got {value}")
        if not (math.isfinite(s.repetition_penalty) and 0.0 < s.repetition_penalty <= 2.0):
            raise InvalidRequest(f"repetition_penalty must be within (0, 2], got {s.repetition_penalty}")
        if not (math.isfinite(s.min_p) and 0.0 <= s.min_p <= 1.0):
            raise InvalidRequest(f"min_p must be within [0, 1], got {s.min_p}")
        if s.prompt_logprobs is not None and not 0 <= s.prompt_logprobs <= 20:
            raise InvalidRequest(f"prompt_logprobs must be between 0 and 20; it is {s.prompt_logprobs}")
        if s.structured is not None:
            if s.min_tokens:
                # Once the answer is complete the grammar allows only EOS, which min_tokens masks.
                raise InvalidRequest("min_tokens cannot be used with structured output")
            structured.grammar(s.structured)
        vocab = len(self.model.tokenizer)
        for name, ids in (("logit_bias", list(s.logit_bias)), ("stop_token_ids", s.stop_token_ids)):
            if bad := [t for t in ids if not 0 <= t < vocab]:
                raise InvalidRequest(f"{name}: token ids outside the vocabulary (size {vocab}): {bad[:5]}")
        if s.seed is not None and not (0 <= s.seed < 2**63):
            raise InvalidRequest(f"seed must be within [0, 2**63), got {s.seed}")
