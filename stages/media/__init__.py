"""Media intake: URL policy (SSRF guard), fetching, safe image, video and audio decoding, and the embedding cache."""

from stages.media.audio import DecodedAudio, decode_audio, load_audio, load_audio_base64, sniff_audio
from stages.media.cache import CachedEmbedding, EmbeddingCache, content_key, item_digest, media_set_key
from stages.media.embeds import PrecomputedEmbedding, parse_embeddings
from stages.media.fetch import DataURL, MediaFetcher, PolicyResolver, parse_data_url
from stages.media.image import decode_image, load_image, sniff_format
from stages.media.policy import MediaPolicy, address_block_reason, check_address, check_remote_url
from stages.media.video import DecodedVideo, VideoOptions, decode_video, load_video, sniff_container

__all__ = [
    "CachedEmbedding",
    "DataURL",
    "DecodedAudio",
    "DecodedVideo",
    "EmbeddingCache",
    "MediaFetcher",
    "MediaPolicy",
    "PolicyResolver",
    "PrecomputedEmbedding",
    "VideoOptions",
    "address_block_reason",
    "check_address",
    "check_remote_url",
    "content_key",
    "decode_audio",
    "decode_image",
    "decode_video",
    "item_digest",
    "load_audio",
    "load_audio_base64",
    "load_image",
    "load_video",
    "media_set_key",
    "parse_data_url",
    "parse_embeddings",
    "sniff_audio",
    "sniff_container",
    "sniff_format",
]
