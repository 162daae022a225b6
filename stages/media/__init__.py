"""Media intake: URL policy (SSRF guard), fetching, and safe image decoding."""

from stages.media.fetch import DataURL, MediaFetcher, PolicyResolver, parse_data_url
from stages.media.image import decode_image, load_image, sniff_format
from stages.media.policy import MediaPolicy, address_block_reason, check_address, check_remote_url

__all__ = [
    "DataURL",
    "MediaFetcher",
    "MediaPolicy",
    "PolicyResolver",
    "address_block_reason",
    "check_address",
    "check_remote_url",
    "decode_image",
    "load_image",
    "parse_data_url",
    "sniff_format",
]
