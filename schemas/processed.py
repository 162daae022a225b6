"""What the processor hands to the first hop, and every hop to the next."""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from schemas.request import (
    AudioPart,
    ContentPart,
    GenerateRequest,
    ImageEmbedsPart,
    ImagePart,
    InputAudioPart,
    VideoPart,
)
from schemas.routes import HOP_ROLES
from schemas.tensors import TensorRef


class MediaKind(enum.StrEnum):
    IMAGE = "image"
    VIDEO = "video"
    AUDIO = "audio"


class MediaItem(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    kind: MediaKind
    # https:// / http:// / file:// URL as the client gave it; empty for inline
    # bytes (a data: URL or input_audio), which stay where they are in the
    # request (``part``) rather than travel twice in every hop message.
    url: str
    # Index into prompt_token_ids of this item's single placeholder token; the
    # family expands it once the media's token count is known.
    placeholder_index: int
    # The URL holds precomputed embeddings (.safetensors), not the media.
    embeds: bool = False
    # Audio: the format the client declared ("wav", "mp3", ...).
    format: str = ""
    # Video: frame sampling asked for by the client (unset: server defaults).
    num_frames: int | None = None
    fps: float | None = None
    max_frames: int | None = None
    # Inline bytes: [message index, content part index] in the request.
    part: list[int] = []


class EncodedItem(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """What prefill needs of one encoded media item besides its embeddings."""

    num_tokens: int
    # The item's layout as its family reads it (Qwen-VL: the patch grid
    # (t, h, w) before the spatial merge, for M-RoPE positions).
    grid_thw: list[int]
    # Qwen2.5-VL video: seconds one temporal grid step spans.
    seconds_per_grid: float = 0.0
    # The item's content digest (its bytes and how they were read): prefill's
    # prefix cache keys the blocks showing it by it. Empty: unknown.
    digest: str = ""


class EncodedMedia(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """Encode → prefill: one embeddings tensor per item, held by the encode worker."""

    ref: TensorRef
    items: list[EncodedItem]


class KvHandoff(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """Prefill → decode: per-layer keys and values (``[k0, v0, k1, v1, …]``)
    held by the prefill worker, and what decoding continues from."""

    ref: TensorRef
    # Prompt length with every placeholder expanded to its media tokens.
    prompt_len: int
    # Tokens after the prompt: those a client already had when prefill ran,
    # then the one prefill selected (not yet in the cache).
    output_ids: list[int]
    # M-RoPE shift of text positions after media (Qwen-VL); 0 elsewhere.
    rope_delta: int = 0
    # Prompt tokens the prefill worker found in its prefix cache (for the usage).
    cached_tokens: int = 0


class DecodedItem(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """One media item the processor decoded (``--frontend-decode``): what
    its tensor in ``DecodedMedia.ref`` is, and what else the encoder needs.

    An image is ``uint8 [height, width, 3]`` (RGB); a video ``uint8
    [frames, height, width, 3]`` with its sampling below; an audio clip
    ``float32 [samples]`` at ``sampling_rate``."""

    kind: MediaKind
    # The item's content digest (item_digest of its bytes): the embedding
    # cache, the prefix cache and a router key the item by it.
    digest: str
    # Video: seconds from the first frame, the rate the frames represent,
    # the source's length, the frames taken (their indices), its frame count and rate.
    timestamps: list[float] = []
    fps: float = 0.0
    duration_s: float = 0.0
    frame_indices: list[int] = []
    total_frames: int = 0
    source_fps: float = 0.0
    # Audio.
    sampling_rate: int = 0


class DecodedMedia(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """Processor → encode: a request's media decoded (one tensor per item,
    in prompt order), held by the processor for the encoder to read."""

    ref: TensorRef
    items: list[DecodedItem]


class VllmKv(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """Prefill → decode with ``--engine vllm``: the prompt's KV cache moves by
    vLLM's own KV connector, so only what the decode engine hands back to
    vLLM travels here (no tensors)."""

    # The ``kv_transfer_params`` vLLM's prefill returned (NixlConnector: the
    # producer's engine id, side channel and block ids); empty where the
    # connector keys the cache by the prompt itself (ExampleConnector).
    params: dict[str, Any] = {}
    # Tokens a client already held when prefill ran (they are part of the
    # prefilled prompt): decode uses ``params`` only for that same prompt.
    resumed: int = 0


class SglangKv(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """Prefill → decode with ``--engine sglang``: SGLang's PD disaggregation
    moves the prompt's KV cache itself (its transfer engine, NIXL here), the
    decode engine pulling it from the prefill engine it finds by the
    prefill's bootstrap server and the request's room. Only those travel."""

    # The prefill engine's bootstrap server, as the decode worker reaches it.
    bootstrap_host: str
    bootstrap_port: int
    # The request's room: the one link between SGLang's two sides.
    room: int
    # Tokens a client already held when prefill ran (part of the prefilled prompt).
    resumed: int = 0


class VllmEncoded(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """Encode → prefill when vLLM encoder-only encoded (``--engine vllm`` on
    ``encode``): the embeddings wait in vLLM's encoder-cache connector
    (ECExampleConnector: a folder both workers see) under each item's vLLM
    multimodal hash, so only the keys and the placeholder sizes travel."""

    # One per media item, in prompt order: the connector's key of its encoder output.
    mm_hashes: list[str]
    # Each item's token count and patch grid (vLLM sizes the placeholder by it).
    items: list[EncodedItem]


class ProcessedRequest(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    # The original request rides along so any hop can restart it from the
    # first hop (a new attempt) when a referenced tensor is gone.
    request: GenerateRequest
    prompt_token_ids: list[int]
    media: list[MediaItem]
    # Every hop of the request, in order; hop_index is the one this message
    # is queued for.
    route: list[str]
    max_tokens: int
    seed: int
    attempt: int = 0
    hop_index: int = 0
    # A hop of this attempt ran it more than once (a redelivery): a later hop
    # may find chunks a first run already emitted.
    redelivered: bool = False
    # Tokens the client holds as this message was made: a hop that ends at
    # prefill streams the token its prefill chose at once (the first token
    # does not wait for the KV hand-off), and the decode hop goes on after it.
    emitted: list[int] = []
    # The bridge that processed the request holds it as it arrived while its
    # client waits, and queues it again when a hop asks (a restart): a hop
    # past the media's encoding may forward it without the inline bytes.
    bridge_restarts: bool = False
    # This message no longer holds its inline media (data: URLs, inline
    # audio): a restart from the first hop is the bridge's to make.
    media_dropped: bool = False
    # The media decoded by the processor (--frontend-decode), for the hop that encodes them.
    decoded: DecodedMedia | None = None
    encoded: EncodedMedia | None = None
    # The router sent this message past the encode hop: the prefix cache of
    # the worker it went to held every media item's tokens, which that
    # worker's prefill reads from there (or it restarts the request from
    # the encode hop where they went meanwhile).
    encode_skipped: bool = False
    kv: KvHandoff | None = None
    vllm_kv: VllmKv | None = None
    vllm_encoded: VllmEncoded | None = None
    sglang_kv: SglangKv | None = None
    # The LoRA adapter (its name) the language model runs with; "": none.
    lora: str = ""
    # The text the language model wrote, for a stage after it (an image's
    # prompt where the request gives none).
    stage_text: str = ""

    @property
    def hop(self) -> str:
        return self.route[self.hop_index]

    def media_url(self, item: MediaItem) -> str:
        """Where an item's bytes are: its URL, or its inline part of the request as a data: URL."""
        if not item.part:
            return item.url
        message, index = item.part
        content = self.request.messages[message].content
        if isinstance(content, str):
            raise ValueError(f"media part {item.part} points at a text message")
        part = content[index]
        if isinstance(part, InputAudioPart):
            return f"data:audio/{part.input_audio.format.lower()};base64,{part.input_audio.data}"
        if isinstance(part, ImagePart):
            return part.image_url.url
        if isinstance(part, ImageEmbedsPart):
            return part.image_embeds.url
        if isinstance(part, VideoPart):
            return part.video_url.url
        if isinstance(part, AudioPart):
            return part.audio_url.url
        raise ValueError(f"media part {item.part} points at a text part")

    def without_inline_media(self) -> ProcessedRequest:
        """This message without the bytes of its inline media, which no hop
        after their encoding reads: one copy of an image rides through
        JetStream, not one per hop."""
        messages = list(self.request.messages)
        for item in self.media:
            if not item.part:
                continue
            index, at = item.part
            content = messages[index].content
            if isinstance(content, str):
                raise ValueError(f"media part {item.part} points at a text message")
            parts = list(content)
            parts[at] = _emptied(parts[at])
            messages[index] = msgspec.structs.replace(messages[index], content=parts)
        request = msgspec.structs.replace(self.request, messages=messages)
        return msgspec.structs.replace(self, request=request, media_dropped=True)

    @property
    def stage_after_text(self) -> int | None:
        """The index of the first hop past the language model's (an image stage), if any."""
        return next((i for i in range(self.hop_index + 1, len(self.route)) if self.route[i] not in HOP_ROLES), None)

    def after_text(self, text: str) -> ProcessedRequest | None:
        """The message for the first hop past the language model's, with the
        text it wrote; None where the route ends with it."""
        index = self.stage_after_text
        return None if index is None else self._handed_nothing(hop_index=index, stage_text=text)

    def skipping_encode(self) -> ProcessedRequest:
        """This message (for the encode hop) for the hop after it, its media not encoded."""
        return msgspec.structs.replace(self, hop_index=self.hop_index + 1, encode_skipped=True)

    def restarted(self) -> ProcessedRequest:
        """A new attempt from the first hop: what earlier hops made is gone."""
        return self._handed_nothing(attempt=self.attempt + 1, hop_index=0, stage_text="")

    def _handed_nothing(self, **changes: Any) -> ProcessedRequest:
        """This message with ``changes`` and none of what one hop hands the next."""
        return msgspec.structs.replace(
            self,
            emitted=[],
            decoded=None,
            encoded=None,
            encode_skipped=False,
            kv=None,
            vllm_kv=None,
            vllm_encoded=None,
            sglang_kv=None,
            **changes,
        )


def _emptied(part: ContentPart) -> ContentPart:
    """A media part with its URL or inline data emptied (its other fields kept)."""
    replace = msgspec.structs.replace
    if isinstance(part, ImagePart):
        return replace(part, image_url=replace(part.image_url, url=""))
    if isinstance(part, ImageEmbedsPart):
        return replace(part, image_embeds=replace(part.image_embeds, url=""))
    if isinstance(part, VideoPart):
        return replace(part, video_url=replace(part.video_url, url=""))
    if isinstance(part, AudioPart):
        return replace(part, audio_url=replace(part.audio_url, url=""))
    if isinstance(part, InputAudioPart):
        return replace(part, input_audio=replace(part.input_audio, data=""))
    return part
