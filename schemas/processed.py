"""What the processor hands to the first hop, and every hop to the next."""

from __future__ import annotations

import enum

import msgspec

from schemas.request import GenerateRequest


class MediaKind(enum.StrEnum):
    IMAGE = "image"


class MediaItem(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    kind: MediaKind
    # data: / https:// / http:// URL as the client gave it.
    url: str
    # Index into prompt_token_ids of this item's single placeholder token; the
    # family expands it once the media's token count is known.
    placeholder_index: int


class ProcessedRequest(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    # The original request rides along so any hop can restart it from the
    # first hop (a new attempt) when a referenced tensor is gone.
    request: GenerateRequest
    prompt_token_ids: list[int]
    media: list[MediaItem]
    # Hops still to run, the current one first.
    route: list[str]
    max_tokens: int
    seed: int
    attempt: int = 0
    hop_index: int = 0
