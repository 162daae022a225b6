"""The KV router's index and its keys for a prompt: which worker holds how
much of a prompt in a row, learned media token counts, and keys that are
the engine's own (stages/prefix_keys.py) for prompts with inline media."""

from __future__ import annotations

import base64
import dataclasses

import msgspec

from pipeline.config import PipelineConfig, RouterSettings
from pipeline.router.index import PrefixIndex
from pipeline.router.router import KvRouter
from schemas.control import WorkerLoad
from schemas.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from schemas.processed import MediaItem, MediaKind, ProcessedRequest
from schemas.request import ChatMessage, GenerateRequest, ImagePart, ImageURL, TextPart
from stages.media import item_digest
from stages.prefix_keys import MediaSpan, block_keys

B = 4
PAD = 99


def _stored(keys: list[int], tokens: list[int], parent: int | None = None) -> BlockStored:
    return BlockStored(keys, parent, tokens, B, None, "CPU", None)


def test_a_worker_counts_only_the_blocks_it_holds_in_a_row_from_the_first() -> None:
    index = PrefixIndex()
    index.apply("a", [_stored([1, 2, 3], list(range(12)))])
    index.apply("b", [_stored([1], list(range(4))), _stored([3], list(range(8, 12)), parent=2)])
    assert index.overlaps([1, 2, 3, 4]) == {"a": 3, "b": 1}
    assert index.overlaps([5, 1]) == {}
    index.apply("a", [BlockRemoved([2], "CPU")])
    assert index.overlaps([1, 2, 3]) == {"a": 1, "b": 1}
    index.apply("b", [AllBlocksCleared()])
    assert index.overlaps([1, 2, 3]) == {"a": 1}
    index.forget("a")
    assert index.overlaps([1]) == {} and index.blocks_of("a") == 0


def test_media_token_counts_are_learned_from_placeholder_runs_across_batches() -> None:
    index = PrefixIndex()
    index.placeholders.add(PAD)
    # A run of 6 placeholders from token 2, split over two events (the second's parent the first's last).
    tokens = [1, 2, PAD, PAD, PAD, PAD, PAD, PAD, 3, 4, 5, 6]
    index.apply("a", [_stored([10], tokens[:4]), _stored([11, 12], tokens[4:], parent=10)])
    assert index.lengths(PAD) == [6]
    index.apply("a", [_stored([20, 21], [PAD, PAD, 7, 8, 9, 9, 9, 9])])
    assert index.lengths(PAD) == [2, 6]


def _request(image: bytes) -> ProcessedRequest:
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    request = GenerateRequest("r", "m", [ChatMessage("user", [ImagePart(ImageURL(url)), TextPart("hi")])])
    item = MediaItem(MediaKind.IMAGE, "", placeholder_index=3, part=[0, 0])
    prompt = [5, 6, 7, PAD, 8, 9, 10, 11, 12, 13]
    return ProcessedRequest(request, prompt, [item], ["encode+prefill+decode"], 4, 0)


def _engine_keys(out: ProcessedRequest, image: bytes, n: int) -> tuple[list[int], list[int]]:
    """What the engine keys: the prompt expanded, the image's span with its digest."""
    ids = out.prompt_token_ids[:3] + [PAD] * n + out.prompt_token_ids[4:]
    digest = item_digest(out.media[0], image)
    return block_keys(ids, B, [MediaSpan(3, n, digest)]), ids


def test_the_routers_keys_for_a_prompt_are_the_engines_once_the_media_length_is_seen() -> None:
    router = KvRouter(None, None, dataclasses.replace(PipelineConfig(), router=RouterSettings(mode="kv")))  # type: ignore[arg-type]
    image = b"\x89PNG not really, but bytes all the same"
    out = _request(image)
    keys, ids = _engine_keys(out, image, 5)
    # The router sees a prompt before its blocks are stored: its placeholder is known by then.
    assert router.choose(out) is None
    # Before any blocks are seen, only those before the image: the media's length is unknown.
    assert router.prompt_keys(out, B) == block_keys(out.prompt_token_ids[:0], B)
    router.index.apply("w", [_stored(keys, ids[: len(keys) * B])])
    assert router.prompt_keys(out, B) == keys
    assert router.index.overlaps(router.prompt_keys(out, B)) == {"w": len(keys)}
    # Other bytes behind the same placeholders: the same lengths, no blocks in common past the text.
    other = _request(b"other bytes")
    assert router.index.overlaps(router.prompt_keys(other, B)) == {}


def test_the_encode_hop_is_skipped_for_a_worker_whose_cache_holds_every_media_token() -> None:
    """Past the encode hop, to the prefill worker holding the image's tokens:
    only a worker that takes such requests, only where its cached blocks
    reach past the media, never for a request run again."""
    config = dataclasses.replace(PipelineConfig(), router=RouterSettings(mode="kv"))
    router = KvRouter(None, None, config)  # type: ignore[arg-type]
    image = b"\x89PNG not really, but bytes all the same"
    out = msgspec.structs.replace(_request(image), route=["encode", "prefill+decode"])
    keys, ids = _engine_keys(out, image, 5)
    encode_queue = config.subjects.work("encode")

    def heard(worker: str, takes: bool) -> None:
        router.heard(WorkerLoad("prefill+decode", worker, max_inflight=8, takes_cached_media=takes))

    heard("w", True)
    assert router.place(out) == (encode_queue, out)  # cached nowhere: encoded
    # Blocks past the image's last token (expanded positions 3 to 7, in blocks 0 and 1).
    router.index.apply("w", [_stored(keys[:3], ids[:12])])
    subject, skipped = router.place(out)
    assert subject == config.subjects.routed("prefill+decode", "w")
    assert (skipped.hop, skipped.hop_index, skipped.encode_skipped) == ("prefill+decode", 1, True)
    # Run again (something a hop needed was gone): every hop.
    again = msgspec.structs.replace(out, attempt=1)
    assert router.place(again) == (encode_queue, again)
    # Blocks that stop inside the image: encoded.
    router.index.forget("w")
    router.index.apply("w", [_stored(keys[:1], ids[:4])])
    assert router.place(out) == (encode_queue, out)
    # A worker that does not take requests past the encode hop (another engine): encoded.
    router.index.apply("u", [_stored(keys[:3], ids[:12])])
    heard("u", False)
    assert router.place(out) == (encode_queue, out)
