"""What media a deployment may fetch and decode: schemes, addresses, local paths, sizes.

The address checks here are the SSRF guard. ``check_url`` looks at a URL before any
connection; the fetcher's resolver (``stages.media.fetch.PolicyResolver``) calls
``check_address`` on every address DNS returns, so the address a socket is opened to
is always one that was checked.
"""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
import math
import socket
from pathlib import Path

from yarl import URL

from schemas.errors import UrlNotAllowed
from schemas.processed import MediaKind
from schemas.settings import setting

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

MiB = 1024 * 1024

# Formats decode_image can sniff and size from the header; allowed_formats must pick from these.
DECODABLE_FORMATS = frozenset({"JPEG", "PNG", "WEBP", "GIF"})

# Refused even with allow_internal: they hand out cloud credentials and never serve images.
METADATA_ADDRESSES = frozenset(
    {
        ipaddress.ip_address("169.254.169.254"),  # AWS, GCP, Azure, OpenStack
        ipaddress.ip_address("fd00:ec2::254"),  # AWS over IPv6
        ipaddress.ip_address("100.100.100.200"),  # Alibaba Cloud
    }
)

_CGNAT = ipaddress.ip_network("100.64.0.0/10")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")

# A URL this long is not a media link anyone means; it only costs parsing and logging.
MAX_URL_CHARS = 8192


@dataclasses.dataclass(frozen=True)
class MediaPolicy:
    # Internal addresses and plain http: for in-cluster or development use only.
    allow_internal: bool = setting(
        False, flag="allow-internal-media", help="allow http:// and internal (loopback, private) media URLs"
    )
    max_bytes: int = setting(
        20 * MiB, flag="image-max-bytes", help="bytes of one image (or embeddings payload), inline or fetched"
    )
    fetch_timeout_s: float = setting(10.0, flag="media-fetch-timeout", help="seconds for one media download")
    max_redirects: int = 3
    # width*height cap, checked from the header before any pixel is decoded.
    max_pixels: int = setting(
        40_000_000, flag="image-max-pixels", help="width x height of one image, checked before decoding"
    )
    allowed_formats: frozenset[str] = frozenset({"JPEG", "PNG", "WEBP"})
    # file: URLs are served only from under these directories; empty refuses file: entirely.
    allowed_local_dirs: tuple[str, ...] = setting(
        (),
        flag="media-dir",
        split=False,
        help="serve file:// media from under this directory (repeatable; none: file:// is refused)",
    )
    # CIDRs refused even with allow_internal (e.g. a control-plane range next to the cluster).
    denied_networks: tuple[str, ...] = ()

    # Video (stages.media.video). A video costs far more than an image to decode, so it has its
    # own caps. video_max_bytes caps a video whether inline (data:), downloaded or a local file.
    video_max_bytes: int = setting(
        64 * MiB, flag="video-max-bytes", help="bytes of one video, inline, fetched or a local file"
    )
    video_max_duration_s: float = setting(600.0, flag="video-max-seconds", help="seconds of one video")
    # However it is sampled; also the default for max_frames.
    video_max_frames: int = setting(32, help="frames sampled from one video at most (max_frames cap)")
    # Qwen2-VL's default.
    video_default_fps: float = setting(2.0, help="sampling rate when a request gives no num_frames or fps")
    # Model input, not archive: aspect kept.
    video_max_pixels: int = setting(
        1280 * 720, flag="video-frame-max-pixels", help="sampled frames larger than this are scaled down"
    )
    # Frames larger than this are refused before any pixel is decoded (DCI 4K, either way round).
    video_max_source_pixels: int = 4096 * 2160

    # Audio (stages.media.audio). 30 s is the window Whisper-style encoders (Whisper, Qwen2-Audio)
    # see; their feature extractors silently cut anything longer, so refuse it instead.
    audio_max_bytes: int = setting(16 * MiB, help="bytes of one audio clip")
    audio_max_duration_s: float = setting(30.0, flag="audio-max-seconds", help="seconds of one audio clip")

    # Decoded images, video frames and audio samples an encoding worker keeps by content
    # (stages.media.decoded), so media seen again skip decoding; 0 turns it off.
    decoded_cache_bytes: int = setting(
        256 * MiB, help="bytes of decoded media an encoding worker keeps by content (0: off)"
    )

    # Media items one encoder call may take from several requests waiting together
    # (stages.torch_engine.encode_batcher). 1: each request alone, generate()'s
    # exact embeddings.
    encode_batch_items: int = setting(
        1,
        flag="encode-batch",
        help="media items one encoder call takes from requests waiting together (1: each alone, exact embeddings; "
        "more: GPU throughput, last-bit differences)",
    )

    # Processes that decode media beside the worker (stages.media.decode_pool).
    decode_processes: int | None = setting(
        None,
        flag="media-processes",
        help="processes that decode images, video and audio off the worker's GIL (0: threads of the worker; "
        "unset: 4 on a GPU worker, at most a quarter of the cores; threads on a CPU one)",
    )

    # Where media are decoded (stages.media.frontend): give every process of a deployment the same.
    frontend_decode: bool = setting(
        False,
        help="the process that processes requests (the bridge, or processor workers) fetches and decodes their "
        "media and hands the pixels, frames and samples to the encoding workers by the tensor transport; "
        "encoding workers read them (give the bridge and every worker the same)",
    )

    def __post_init__(self) -> None:
        if self.decode_processes is not None and self.decode_processes < 0:
            raise ValueError("MediaPolicy.decode_processes must be 0 or more")
        for name in (
            "max_bytes",
            "max_pixels",
            "video_max_bytes",
            "video_max_frames",
            "video_max_pixels",
            "video_max_source_pixels",
            "audio_max_bytes",
            "encode_batch_items",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"MediaPolicy.{name} must be positive")
        for name in ("video_max_duration_s", "video_default_fps", "audio_max_duration_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"MediaPolicy.{name} must be positive and finite")
        if self.decoded_cache_bytes < 0:
            raise ValueError("MediaPolicy.decoded_cache_bytes must be >= 0")
        if self.fetch_timeout_s <= 0:
            raise ValueError("MediaPolicy.fetch_timeout_s must be positive")
        if self.max_redirects < 0:
            raise ValueError("MediaPolicy.max_redirects must be >= 0")
        # A plain set or list would make the policy unhashable and mutable from outside.
        object.__setattr__(self, "allowed_formats", frozenset(f.upper() for f in self.allowed_formats))
        unknown = self.allowed_formats - DECODABLE_FORMATS
        if unknown or not self.allowed_formats:
            raise ValueError(
                f"MediaPolicy.allowed_formats must be a non-empty subset of {sorted(DECODABLE_FORMATS)}, "
                f"got {sorted(self.allowed_formats)}"
            )
        object.__setattr__(self, "allowed_local_dirs", tuple(str(d) for d in self.allowed_local_dirs))
        object.__setattr__(self, "denied_networks", tuple(self.denied_networks))
        self.denied  # noqa: B018 - parse now so a bad CIDR fails at startup, not on the first request

    @functools.cached_property
    def denied(self) -> tuple[IPNetwork, ...]:
        return tuple(ipaddress.ip_network(n, strict=False) for n in self.denied_networks)

    @functools.cached_property
    def local_roots(self) -> tuple[Path, ...]:
        # Resolved once so a symlinked root (e.g. /tmp -> /private/tmp) compares against real paths.
        return tuple(Path(d).resolve() for d in self.allowed_local_dirs)

    def max_bytes_of(self, kind: MediaKind) -> int:
        """Bytes one item of ``kind`` may have, inline or fetched."""
        if kind is MediaKind.VIDEO:
            return self.video_max_bytes
        if kind is MediaKind.AUDIO:
            return self.audio_max_bytes
        return self.max_bytes

    def formats_text(self) -> str:
        return ", ".join(sorted(self.allowed_formats))


def _embedded_ipv4(ip: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address a v6 address carries and reaches (mapped, NAT64, 6to4), if any."""
    if not isinstance(ip, ipaddress.IPv6Address):
        return None
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip in _NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return ip.sixtofour


def parse_ip(text: str) -> IPAddress:
    # Resolvers hand back link-local v6 with a zone ("fe80::1%eth0"); the zone doesn't change what it is.
    return ipaddress.ip_address(text.split("%", 1)[0])


def address_block_reason(ip: IPAddress, policy: MediaPolicy) -> str | None:
    """Why ``policy`` forbids connecting to ``ip``, or None if it may be used."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.scope_id:
        ip = parse_ip(str(ip))
    inner = _embedded_ipv4(ip)
    if ip in METADATA_ADDRESSES or inner in METADATA_ADDRESSES:
        return "a cloud metadata address"
    for net in policy.denied:
        if ip in net or (inner is not None and inner in net):
            return f"in denied network {net}"
    if policy.allow_internal:
        return None
    if inner is not None:
        # Judge the IPv4 address that is really reached; the v6 wrapper ranges look "reserved".
        ip = inner
    checks: tuple[tuple[bool, str], ...] = (
        (ip.is_unspecified, "unspecified"),
        (ip.is_loopback, "loopback"),
        (ip.is_link_local, "link-local"),
        (ip.is_multicast, "multicast"),
        (isinstance(ip, ipaddress.IPv4Address) and ip in _CGNAT, "carrier-grade NAT (shared)"),
        (ip.is_private, "private"),
        (ip.is_reserved, "reserved"),
        (not ip.is_global, "not globally routable"),
    )
    for hit, what in checks:
        if hit:
            return f"a {what} address"
    return None


def check_address(ip: IPAddress, policy: MediaPolicy, host: str | None = None) -> None:
    """Raise UrlNotAllowed if ``policy`` forbids connecting to ``ip``."""
    reason = address_block_reason(ip, policy)
    if reason is not None:
        via = f"host {host!r} resolves to {ip}, which is" if host and host != str(ip) else f"{ip} is"
        raise UrlNotAllowed(f"media URL not allowed: {via} {reason}")


def short_url(url: str | URL, limit: int = 120) -> str:
    """A URL cut down for error messages (data: URLs can be megabytes)."""
    text = str(url)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_remote_url(url: URL, policy: MediaPolicy) -> None:
    """Scheme and literal-address checks for an http(s) URL, run before every request and redirect.

    Hostnames are checked later, by the resolver, on the addresses actually connected to.
    """
    scheme = url.scheme.lower()
    if scheme == "http" and not policy.allow_internal:
        raise UrlNotAllowed(f"media URL not allowed: plain http: is refused, use https: ({short_url(url)})")
    if scheme not in ("http", "https"):
        raise UrlNotAllowed(f"media URL not allowed: scheme {scheme + ':'!r} cannot be fetched ({short_url(url)})")
    host = url.raw_host
    if not host:
        raise UrlNotAllowed(f"media URL not allowed: no host in {short_url(url)}")
    try:
        ip = parse_ip(host)
    except ValueError:
        ip = None
    if ip is None:
        # Legacy numeric forms (2130706433, 127.1, 0x7f.1) are addresses in disguise; refuse them
        # rather than guess how a resolver will read them.
        try:
            socket.inet_aton(host)
        except OSError:
            return
        raise UrlNotAllowed(f"media URL not allowed: non-canonical IPv4 host {host!r}")
    check_address(ip, policy)


def resolve_local_path(url: URL, policy: MediaPolicy) -> Path:
    """The real path a file: URL names, if it lies under an allowed directory."""
    if not policy.local_roots:
        raise UrlNotAllowed("media URL not allowed: file: URLs are disabled")
    if url.host not in (None, "", "localhost"):
        raise UrlNotAllowed(f"media URL not allowed: file: URL names a remote host {url.host!r}")
    raw = url.path
    if not raw.startswith("/") or "\x00" in raw:
        raise UrlNotAllowed(f"media URL not allowed: file: URL needs an absolute path ({short_url(url)})")
    # resolve() collapses ".." and follows every symlink, so the containment test sees the real target.
    real = Path(raw).resolve()
    if not is_under_roots(real, policy):
        raise UrlNotAllowed(f"media URL not allowed: {raw!r} is outside the allowed media directories")
    return real


def is_under_roots(path: Path, policy: MediaPolicy) -> bool:
    return any(path == root or path.is_relative_to(root) for root in policy.local_roots)
