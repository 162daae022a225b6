"""Media intake: URL policy (SSRF guard), fetching, and safe image, video and audio decoding."""

from stages.media.audio import DecodedAudio, decode_audio, load_audio, load_audio_base64, sniff_audio
from stages.media.fetch import DataURL, MediaFetcher, PolicyResolver, parse_data_url
from stages.media.image import decode_image, load_image, sniff_format
from stages.media.policy import MediaPolicy, address_block_reason, check_address, check_remote_url
from stages.media.video import DecodedVideo, VideoOptions, decode_video, fetch_capped, load_video, sniff_container

__all__ = [
    "DataURL",
    "DecodedAudio",
    "DecodedVideo",
    "MediaFetcher",
    "MediaPolicy",
    "PolicyResolver",
    "VideoOptions",
    "address_block_reason",
    "check_address",
    "check_remote_url",
    "decode_audio",
    "decode_image",
    "decode_video",
    "fetch_capped",
    "load_audio",
    "load_audio_base64",
    "load_image",
    "load_video",
    "parse_data_url",
    "sniff_audio",
    "sniff_container",
    "sniff_format",
]
