"""Getting media bytes from data:, http(s): and file: URLs under a MediaPolicy."""

from __future__ import annotations

import asyncio
import binascii
import dataclasses
import errno
import os
import socket
import stat
import sys
import time
import urllib.parse
from functools import partial
from pathlib import Path
from typing import Final, Self

import aiohttp
import pybase64
from aiohttp.abc import AbstractResolver, ResolveResult
from yarl import URL

from schemas.errors import InvalidMedia, MediaFetchFailed, TooLarge, UrlNotAllowed
from stages.media.lru import ByteLRU
from stages.media.policy import (
    MAX_URL_CHARS,
    MediaPolicy,
    check_address,
    check_remote_url,
    is_under_roots,
    parse_ip,
    resolve_local_path,
    short_url,
)

MiB: Final = 1024 * 1024
_CHUNK: Final = 64 * 1024
_REDIRECTS: Final = frozenset({301, 302, 303, 307, 308})
# Decoding base64 this large would stall the event loop for milliseconds; push it to a thread.
_THREAD_DECODE_CHARS: Final = 1 * MiB


@dataclasses.dataclass(frozen=True, slots=True)
class DataURL:
    media_type: str
    data: bytes


# The ASCII characters str.split() drops, as in base64 a client wrapped.
_BASE64_SPACES = " \t\n\r\f\v\x1c\x1d\x1e\x1f"


def max_base64_chars(max_bytes: int) -> int:
    """Base64 text longer than this decodes to more than ``max_bytes`` (4
    characters make 3 bytes): refuse it before decoding."""
    return 4 * (max_bytes // 3 + 1) + 4


def b64decode_lenient(text: str) -> bytes:
    """Standard or URL-safe alphabet, padding optional, whitespace already
    removed. Raises binascii.Error (or ValueError) on anything else."""
    if "-" in text or "_" in text:
        text = text.translate(str.maketrans("-_", "+/"))
    # pybase64 (SIMD, as vLLM decodes media): CPython's decoder held the
    # worker's GIL ~2 ms for one 800 KB image, time the engine's thread waited.
    return pybase64.b64decode(text + "=" * (-len(text) % 4), validate=True)


def parse_data_url(url: str, max_bytes: int) -> DataURL:
    """Parse ``data:[<mediatype>][;base64],<data>``; only base64 payloads are media."""
    if url[:5].lower() != "data:":
        raise InvalidMedia("not a data: URL")
    comma = url.find(",", 5)
    if comma < 0:
        raise InvalidMedia("malformed data: URL: no ',' between the header and the data")
    params = [p.strip() for p in url[5:comma].split(";")]
    media_type = params[0].lower() or "text/plain"
    if len(params) < 2 or params[-1].lower() != "base64":
        raise InvalidMedia("malformed data: URL: media must be base64-encoded (';base64,' missing)")
    payload = url[comma + 1 :]
    if "%" in payload:
        # Some clients percent-encode the payload ('+' -> %2B, '=' -> %3D).
        payload = urllib.parse.unquote(payload)
    if not payload.isascii() or any(space in payload for space in _BASE64_SPACES):
        # Rare (wrapped base64): the split and join copies the whole payload twice.
        payload = "".join(payload.split())
    if len(payload) > max_base64_chars(max_bytes):
        raise TooLarge(f"data: URL payload is over the {max_bytes} byte limit")
    if not payload:
        raise InvalidMedia("malformed data: URL: empty payload")
    try:
        data = b64decode_lenient(payload)
    except (binascii.Error, ValueError) as e:
        raise InvalidMedia(f"malformed data: URL: bad base64 ({e})") from None
    if len(data) > max_bytes:
        raise TooLarge(f"data: URL media is {len(data)} bytes, over the {max_bytes} byte limit")
    return DataURL(media_type, data)


class PolicyResolver(AbstractResolver):
    """A resolver that refuses hosts resolving to any address the policy forbids.

    The connector connects only to addresses this returns, so the check holds at connect
    time for every request and redirect: a DNS answer that changes between a check and the
    connection (rebinding) cannot slip an internal address in.
    """

    def __init__(self, policy: MediaPolicy, inner: AbstractResolver | None = None) -> None:
        self._policy = policy
        self._inner = inner if inner is not None else aiohttp.ThreadedResolver()

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        results = await self._inner.resolve(host, port, family)
        # All or nothing: a name that also points inside is hostile, whichever address would be tried first.
        for result in results:
            check_address(parse_ip(result["host"]), self._policy, host)
        return results

    async def close(self) -> None:
        await self._inner.close()


@dataclasses.dataclass(slots=True)
class _Inflight:
    task: asyncio.Task[bytes]
    # The byte cap the download runs under; callers with a cap at most this may share it.
    max_bytes: int
    waiters: int = 0


class MediaFetcher:
    """Fetches media bytes; one per process, sharing one aiohttp session for all requests.

    Concurrent fetches of one http(s) URL share one download, and recent http(s) results
    are kept in a small LRU (by count, bytes and age). Each call may name its own byte cap
    (video and audio have larger ones than images); the cap travels with the call, not the
    URL, so a shared download or a cached result is checked against every caller's own cap.
    """

    def __init__(
        self,
        policy: MediaPolicy | None = None,
        *,
        cache_max_items: int = 64,
        cache_max_bytes: int = 128 * MiB,
        cache_ttl_s: float = 300.0,
        resolver: AbstractResolver | None = None,
        user_agent: str = "mmpipe-media/1.0",
    ) -> None:
        self._policy = policy if policy is not None else MediaPolicy()
        self._cache_ttl_s = cache_ttl_s
        self._inner_resolver = resolver
        self._user_agent = user_agent
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._inflight: dict[str, _Inflight] = {}
        # Every download still running, including ones abandoned by all their callers.
        self._tasks: set[asyncio.Task[bytes]] = set()
        # (expiry on the monotonic clock, bytes) by URL. Never over the LRU's own byte capacity,
        # whatever cap the download ran under: a 64 MiB video is not kept by a cache sized for
        # images, and the cache never exceeds its budget. A bound <= 0 turns the cache off.
        self._cache: ByteLRU[str, tuple[float, bytes]] = ByteLRU(
            max(cache_max_bytes, 0), lambda entry: len(entry[1]), max_entries=max(cache_max_items, 0)
        )

    @property
    def policy(self) -> MediaPolicy:
        return self._policy

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Abort in-flight downloads and close the session. Idempotent."""
        self._closed = True
        tasks = list(self._tasks)
        self._inflight.clear()
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        session, self._session = self._session, None
        if session is not None:
            await session.close()
        self._cache.clear()

    async def fetch(self, url: str, *, max_bytes: int | None = None) -> bytes:
        """The bytes ``url`` names, within the policy's scheme, address, size and time limits.

        ``max_bytes`` is this call's byte cap (default: the policy's ``max_bytes``, the image
        cap); video and audio pass their own (``policy.video_max_bytes``, ``audio_max_bytes``).
        It bounds data: payloads before decoding, downloads while streaming (after
        decompression) and local files, and TooLarge names it.
        """
        if self._closed:
            raise RuntimeError("MediaFetcher is closed")
        cap = self._policy.max_bytes if max_bytes is None else max_bytes
        if cap <= 0:
            raise ValueError(f"max_bytes must be positive, got {cap}")
        if url[:5].lower() == "data:":
            if len(url) > _THREAD_DECODE_CHARS:
                return (await asyncio.to_thread(parse_data_url, url, cap)).data
            return parse_data_url(url, cap).data
        if len(url) > MAX_URL_CHARS:
            raise UrlNotAllowed(f"media URL not allowed: longer than {MAX_URL_CHARS} characters")
        try:
            parsed = URL(url)
        except (ValueError, TypeError) as e:
            raise UrlNotAllowed(f"media URL not allowed: malformed URL ({e})") from None
        scheme = parsed.scheme.lower()
        if scheme == "file":
            path = resolve_local_path(parsed, self._policy)
            return await asyncio.to_thread(_read_local_file, str(path), self._policy, cap)
        if scheme not in ("http", "https"):
            shown = f"scheme {scheme + ':'!r}" if scheme else "a URL without a scheme"
            raise UrlNotAllowed(f"media URL not allowed: {shown}; use https: or data:")
        check_remote_url(parsed, self._policy)
        cached = self._cache_get(url)
        if cached is None:
            cached = await self._shared_download(url, parsed, cap)
        if len(cached) > cap:
            # Cached, or downloaded for a caller with a larger cap: fine for them, too big here.
            raise TooLarge(f"media at {short_url(parsed)} is {len(cached)} bytes, over the {cap} byte limit")
        return cached

    # -- http(s) --------------------------------------------------------------------------

    async def _shared_download(self, key: str, url: URL, max_bytes: int) -> bytes:
        """Join the download of ``key`` in flight, or start one; the caller checks its own cap.

        A download runs under the cap of the caller that started it. A caller whose cap is no
        larger joins it: the bytes are coming anyway, and it checks the length itself. A caller
        with a larger cap cannot: the running download would stop short of what it may take.
        It starts its own download under its cap and takes the URL's slot, so later callers
        join the larger one; the smaller one goes on for the callers it already has. (Raising
        the cap of a running download instead cannot undo a refusal it already made from the
        Content-Length.) One URL fetched under different caps at once is rare (image and video
        links are different links), so the rule costs at most one extra download then, and no
        download ever runs under a cap larger than some caller's: an image request cannot make
        the fetcher pull a video-sized body.
        """
        entry = self._inflight.get(key)
        if entry is None or entry.max_bytes < max_bytes:
            task = asyncio.get_running_loop().create_task(self._download_and_cache(key, url, max_bytes))
            entry = _Inflight(task, max_bytes)
            self._inflight[key] = entry
            self._tasks.add(task)
            task.add_done_callback(partial(self._download_done, key, entry))
        entry.waiters += 1
        try:
            # shield: a caller that is cancelled leaves; the download goes on for the others.
            return await asyncio.shield(entry.task)
        except TooLarge:
            if entry.max_bytes == max_bytes:
                raise
            # Over the download's larger cap, so over this caller's too: name the caller's cap.
            raise TooLarge(f"media at {short_url(url)} is over the {max_bytes} byte limit") from None
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if entry.task.cancelled() and current is not None and not current.cancelling():
                # The download was aborted under us (close()), not this caller cancelled.
                raise MediaFetchFailed(f"fetch of {short_url(url)} was aborted") from None
            raise
        finally:
            entry.waiters -= 1
            if entry.waiters == 0 and not entry.task.done():
                # Nobody wants it any more; a later caller starts afresh rather than joining a dying task.
                if self._inflight.get(key) is entry:
                    del self._inflight[key]
                entry.task.cancel()

    def _download_done(self, key: str, entry: _Inflight, task: asyncio.Task[bytes]) -> None:
        self._tasks.discard(task)
        if self._inflight.get(key) is entry:
            del self._inflight[key]
        if not task.cancelled():
            # Mark the exception seen: with every waiter gone, asyncio would log it as never retrieved.
            task.exception()

    async def _download_and_cache(self, key: str, url: URL, max_bytes: int) -> bytes:
        data = await self._download(url, max_bytes)
        self._cache_put(key, data)
        return data

    def _get_session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is not None and not self._session.closed:
            if self._loop is not loop:
                raise RuntimeError("MediaFetcher is bound to another event loop")
            return self._session
        connector = aiohttp.TCPConnector(
            resolver=PolicyResolver(self._policy, self._inner_resolver),
            limit=100,
            limit_per_host=16,
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            # Never let one user's fetch set cookies that ride along on another user's fetch.
            cookie_jar=aiohttp.DummyCookieJar(),
            # A proxy from the environment would connect on our behalf, past the address checks.
            trust_env=False,
            headers={"User-Agent": self._user_agent, "Accept": "image/*,*/*;q=0.5"},
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self._policy.fetch_timeout_s),
        )
        self._loop = loop
        return self._session

    async def _download(self, url: URL, max_bytes: int) -> bytes:
        policy = self._policy
        session = self._get_session()
        try:
            # One budget for the whole redirect chain and body, so redirects can't stretch it.
            async with asyncio.timeout(policy.fetch_timeout_s):
                for _ in range(policy.max_redirects + 1):
                    check_remote_url(url, policy)
                    async with session.get(url, allow_redirects=False) as resp:
                        if resp.status in _REDIRECTS:
                            url = _redirect_target(resp, url)
                            continue
                        if not 200 <= resp.status < 300:
                            raise MediaFetchFailed(
                                f"fetching {short_url(url)} failed: HTTP {resp.status} {resp.reason or ''}".rstrip()
                            )
                        return await _read_capped(resp, url, max_bytes)
                raise MediaFetchFailed(f"fetching {short_url(url)} failed: more than {policy.max_redirects} redirects")
        except TimeoutError:
            raise MediaFetchFailed(
                f"fetching {short_url(url)} failed: timed out after {policy.fetch_timeout_s:g}s"
            ) from None
        except aiohttp.ClientConnectorDNSError as e:
            raise MediaFetchFailed(f"fetching {short_url(url)} failed: cannot resolve host ({e.os_error})") from None
        except (aiohttp.ClientError, OSError) as e:
            raise MediaFetchFailed(f"fetching {short_url(url)} failed: {type(e).__name__}: {e}") from None

    # -- cache ----------------------------------------------------------------------------

    def _cache_get(self, key: str) -> bytes | None:
        hit = self._cache.get(key)
        if hit is None:
            return None
        expires, data = hit
        if expires < time.monotonic():
            self._cache.pop(key)
            return None
        return data

    def _cache_put(self, key: str, data: bytes) -> None:
        self._cache.put(key, (time.monotonic() + self._cache_ttl_s, data))


def _redirect_target(resp: aiohttp.ClientResponse, current: URL) -> URL:
    location = resp.headers.get("Location")
    if not location:
        raise MediaFetchFailed(f"fetching {short_url(current)} failed: HTTP {resp.status} without a Location")
    try:
        target = resp.url.join(URL(location))
    except (ValueError, TypeError):
        raise MediaFetchFailed(f"fetching {short_url(current)} failed: bad redirect Location") from None
    if target.scheme.lower() not in ("http", "https"):
        # Never let a remote server steer us to file: or data: content.
        raise UrlNotAllowed(f"media URL not allowed: redirect to scheme {target.scheme + ':'!r}")
    return target


async def _read_capped(resp: aiohttp.ClientResponse, url: URL, max_bytes: int) -> bytes:
    if resp.content_length is not None and resp.content_length > max_bytes:
        raise TooLarge(f"media at {short_url(url)} is {resp.content_length} bytes, over the {max_bytes} byte limit")
    buf = bytearray()
    # Counted after decompression, so a gzip bomb is stopped too.
    async for chunk in resp.content.iter_chunked(_CHUNK):
        buf += chunk
        if len(buf) > max_bytes:
            raise TooLarge(f"media at {short_url(url)} is over the {max_bytes} byte limit")
    return bytes(buf)


# -- file: ------------------------------------------------------------------------------------


def _read_local_file(path: str, policy: MediaPolicy, max_bytes: int) -> bytes:
    # O_NONBLOCK: opening a FIFO must not hang a worker thread. O_NOFOLLOW: a symlink swapped in
    # after resolve() is refused rather than followed.
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise MediaFetchFailed(f"media file not found: {path}") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UrlNotAllowed(f"media URL not allowed: {path} changed into a symlink") from None
        raise MediaFetchFailed(f"cannot open media file {path}: {e.strerror}") from None
    try:
        if sys.platform == "linux":
            # Judge what was actually opened: a directory above may have been swapped after resolve().
            if not is_under_roots(Path(os.readlink(f"/proc/self/fd/{fd}")), policy):
                raise UrlNotAllowed(f"media URL not allowed: {path} is outside the allowed media directories")
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise MediaFetchFailed(f"media path {path} is not a regular file")
        if st.st_size > max_bytes:
            raise TooLarge(f"media file {path} is {st.st_size} bytes, over the {max_bytes} byte limit")
        chunks: list[bytes] = []
        total = 0
        # The file may grow after fstat(); read at most one byte past the cap to notice.
        while total <= max_bytes:
            chunk = os.read(fd, min(max_bytes + 1 - total, MiB))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    finally:
        os.close(fd)
    if total > max_bytes:
        raise TooLarge(f"media file {path} is over the {max_bytes} byte limit")
    return b"".join(chunks)
