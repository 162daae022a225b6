"""The engine: a Hugging Face model class run directly on torch.

Calls are synchronous and meant for a worker thread. Prefill runs each
prompt on its own (or several padded together, ``prefill_together``);
decode steps every sequence in the batch decoder's slots in one forward
(stages/torch_engine/batch_decoder.py), a sequence that does not fit one on
its own.

Each sequence (stages/torch_engine/sequence.py) owns its KV cache (a
DynamicCache, or blocks of the batch decoder's pool and a row of its
steps), its rope delta (M-RoPE shift of text positions after images) and its
generated token ids. A token returned by prefill, step or collect is
already appended to the sequence but not yet in its cache; the next step
feeds it.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import structlog
import torch

from schemas.errors import ContextLengthExceeded, InvalidMedia, InvalidRequest
from schemas.processed import MediaKind
from stages import compute_threads
from stages.device_copy import tensor_on, to_device
from stages.families import Grid, Media, MediaEmbedding, family_for_architecture
from stages.families.tower_graphs import TowerGraphs
from stages.prefix_keys import MediaSpan, block_keys
from stages.progress import Step, no_transformers_bars, on_terminal
from stages.sampling import Logprobs, SamplingConfig
from stages.torch_engine import batch_decoder, metrics, row_sampling
from stages.torch_engine.batch_decoder import BatchDecoder, ChunkRows, Launched, from_blocks, to_blocks
from stages.torch_engine.block_pool import blocks_for
from stages.torch_engine.fused_lora import refill
from stages.torch_engine.grammar import Grammars
from stages.torch_engine.lora import LoraAdapter, LoraSet, read_adapter
from stages.torch_engine.sampling import greedy_choice, rows_logprobs, select_token, token_logprobs
from stages.torch_engine.sequence import KvState, Launch, Sequence
from stages.torch_engine.settings import DecodeSettings, parse_memory
from stages.torch_engine.slot_prefill import SlotPrefill
from stages.torch_engine.slots import SlotTable

log = structlog.get_logger(__name__)


def _default_dtype(device: str) -> torch.dtype:
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


class TorchEngine:
    def __init__(
        self,
        model_dir: Path,
        device: str = "cpu",
        dtype: torch.dtype | None = None,
        max_model_len: int | None = None,
        decode: DecodeSettings | None = None,
    ) -> None:
        from transformers import AutoConfig, AutoTokenizer

        self.model_dir = Path(model_dir)
        self.device = torch.device(device)
        self.dtype = dtype or _default_dtype(device)
        config = AutoConfig.from_pretrained(str(self.model_dir))
        architectures = list(getattr(config, "architectures", None) or [])
        if not architectures:
            raise ValueError(f"{self.model_dir}/config.json names no architectures")
        self.family = family_for_architecture(architectures[0])(self.model_dir, config)
        loading = Step("model_load", path=str(self.model_dir), device=str(self.device), dtype=str(self.dtype))
        # transformers' own bar on a terminal; not in a log.
        with contextlib.nullcontext() if on_terminal() else no_transformers_bars():
            model: Any = self.family.model_class.from_pretrained(str(self.model_dir), dtype=self.dtype)
        self.model = model.to(self.device).eval()
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        loading.done(architecture=architectures[0], gib=round(weights / 2**30, 3))
        self.family.on_loaded(self.model, self.device, self.dtype)
        decode = decode or DecodeSettings()
        if self.device.type == "cuda":
            self.family.tower_graphs = TowerGraphs(decode.tower_graphs)
            if decode.torch_compile and decode.encodes:
                self.family.compile_tower(self.model)
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
        # A call's size (``_sized``): a new token through the layers, a row
        # through the LM head, a token and a place it attends to.
        self._flops_token, self._flops_row, self._flops_pair = _call_flops(self.model, config)
        limit = self.family.max_position_embeddings
        self.max_model_len = min(max_model_len or limit, limit)
        self.eos_token_ids: frozenset[int] = frozenset(_eos_ids(self.model, config))
        # On the device: masking EOS there needs no copy (and no wait) per token.
        self._eos_tensor = torch.tensor(sorted(self.eos_token_ids), dtype=torch.long, device=self.device)
        # Structured output's compiler, made for the first request that asks for it.
        self._grammars: Grammars | None = None
        # One forward at a time per engine: torch releases the GIL, and the
        # model's modules are not meant for concurrent calls.
        self._lock = threading.Lock()
        self._expansions: dict[tuple[Any, ...], _Expanded] = {}
        self._expansions_lock = threading.Lock()
        # A prefill's token settles on whichever thread waits for it first
        # (the hop's, or the engine's in ``collect``); a step's inputs read
        # each sequence's tokens and write position under it, never halfway
        # through a settle.
        self._settle_lock = threading.Lock()
        # A KV hand-off travels in blocks of this many tokens.
        self.block_size = decode.block_size
        self.max_num_batched_tokens = decode.max_num_batched_tokens
        self.prefix_caching = decode.prefix_caching
        self._decode_settings = decode
        # 0: awake; 1 or 2: asleep at that level (``sleep``).
        self.sleeping = 0
        # The KV pool's event log (KV events), kept across a sleep for the pool made on waking.
        self._pool_log: Any = None
        # LoRA adapters loaded (``load_lora``), and the sequences made with one
        # (an adapter a live one uses cannot be unloaded).
        self._loras = LoraSet()
        self._lora_seqs: weakref.WeakSet[Sequence] = weakref.WeakSet()
        # --max-loras, --max-lora-rank (None: no limit, the stacks sized to what is loaded).
        if decode.max_loras < 0 or decode.max_lora_rank < 1:
            raise ValueError(
                f"--max-loras {decode.max_loras}, --max-lora-rank {decode.max_lora_rank}: 0 or more, 1 or more"
            )
        self._lora_room = (decode.max_loras, decode.max_lora_rank) if decode.max_loras > 0 else None
        self._build_decoder(decode)

    def _build_decoder(self, decode: DecodeSettings) -> None:
        """The batch decoder (its KV pool), the graphed prefill and their CUDA graphs, as ``decode`` asks."""
        self.decoder: BatchDecoder | None = None
        if decode.batched and batch_decoder.supports(self.model):
            max_len = min(decode.max_len, self.max_model_len)
            self.decoder = BatchDecoder(
                self.model,
                max_slots=decode.slots,
                max_len=max_len,
                use_graphs=decode.cuda_graphs,
                fused=decode.fused,
                eos_ids=self.eos_token_ids,
                num_blocks=self._pool_blocks(decode, max_len),
                block_size=decode.block_size,
                compile=decode.torch_compile,
            )
            log.info(
                "kv_cache_allocated",
                blocks=self.decoder.pool.num_blocks,
                block_size=self.decoder.block_size,
                tokens=self.decoder.pool.capacity * self.decoder.block_size,
                gib=round(self.decoder.nbytes / 2**30, 3),
            )
        self._slot_prefill: SlotPrefill | None = None
        if self.decoder is not None and self.decoder.fused is not None and decode.graph_prefill_len > 0:
            compiled = decode.torch_compile and self.device.type == "cuda"
            self._slot_prefill = SlotPrefill(
                self.decoder, decode.cuda_graphs, decode.graph_prefill_len, compiled, past=decode.prefix_caching
            )
            self._slot_prefill.chunk_tokens = self._chunk_len() if self.max_num_batched_tokens > 0 else 0
        if not decode.decodes and self._slot_prefill is None:
            self.decoder = None  # a role that ends at prefill would never use it
        self._slots = SlotTable(self.decoder) if self.decoder is not None else None
        if self.decoder is not None:
            if self.decoder.fused is not None:
                # Those loaded before a sleep; with --max-loras room for the rest too, before the graphs.
                self.decoder.adapters = self._loras.fused(self.model, self._lora_room)
            started = time.monotonic()
            capturing = self.device.type == "cuda" and decode.cuda_graphs
            if capturing:
                log.info("cuda_graphs_capturing", compile=decode.torch_compile, max_num_seqs=decode.slots)
            # Captured with the output head's adapters too, where it has them.
            with self._loras.for_step(self.decoder.lora, [], graphed=True):
                sizes = self.decoder.capture() if decode.decodes else []
            lengths: list[int] = []
            if self._slot_prefill is not None:
                with self._loras.for_step(self._slot_prefill.lora_slot, [], graphed=True):
                    lengths = self._slot_prefill.capture()
            if sizes or lengths:
                log.info(
                    "cuda_graphs_captured",
                    batch_sizes=sizes,
                    prefill_lengths=lengths,
                    seconds=round(time.monotonic() - started, 2),
                )

    def _pool_blocks(self, decode: DecodeSettings, max_len: int) -> int | None:
        """The KV pool's blocks for ``--kv-cache-memory`` (None: the decoder's default)."""
        if decode.kv_cache_memory is None:
            return None
        fraction, size = parse_memory(decode.kv_cache_memory)
        if fraction is not None:
            size = int(fraction * _free_memory(self.device))
        assert size is not None
        fam = self.family
        itemsize = torch.empty(0, dtype=self.dtype).element_size()
        per_block = 2 * fam.num_hidden_layers * fam.num_key_value_heads * decode.block_size * fam.head_dim * itemsize
        blocks = int(size // per_block)
        # As vLLM refuses a max_model_len its KV cache cannot hold: one
        # sequence of the longest the decoder takes must fit, beside the
        # null block, or such a sequence could never finish.
        longest = blocks_for(max_len, decode.block_size)
        if blocks - 1 < longest:
            raise ValueError(
                f"--kv-cache-memory {decode.kv_cache_memory}: {size} bytes hold {max(blocks - 1, 0)} KV blocks of "
                f"{decode.block_size} tokens ({per_block} bytes each), fewer than one sequence of "
                f"--decode-max-len {max_len} needs ({longest}): give it more memory or lower --decode-max-len"
            )
        return blocks

    # -- media --------------------------------------------------------------

    def prepare(self, media: list[Media]) -> list[Media]:
        """What of ``encode``'s work needs no model (an image processor's
        resize and normalisation), for any thread: ``encode`` then runs the
        tower alone."""
        return self.family.prepare(media, self.device)

    def encode(self, media: list[Media]) -> list[MediaEmbedding]:
        """Embeddings of each decoded media item (one encoder call per kind).

        Pass a request's media in one call, as generate() does: an encoder
        forward over a different set of items may round differently.
        """
        with self._lock, torch.inference_mode():
            return self.family.encode(self.model, media)

    def from_precomputed(self, embeddings: torch.Tensor, grid: Grid) -> MediaEmbedding:
        """Embeddings a client computed with this model's encoder, checked
        against the model before they meet its language model."""
        hidden = self.family.hidden_size
        if embeddings.shape[1] != hidden:
            raise InvalidMedia(f"precomputed embeddings of width {embeddings.shape[1]}; this model's is {hidden}")
        try:
            checked = self.family.embeddings_grid(grid, int(embeddings.shape[0]))
        except ValueError as exc:
            raise InvalidMedia(f"precomputed embeddings: {exc}") from None
        if not bool(torch.isfinite(embeddings).all()):
            raise InvalidMedia("precomputed embeddings hold NaN or infinite values")
        # On this engine's device, as encode()'s are: a prompt mixing both
        # kinds concatenates them.
        return MediaEmbedding(to_device(embeddings, self.device, self.dtype), checked, MediaKind.IMAGE)

    # -- LoRA adapters ------------------------------------------------------

    def load_lora(self, name: str, path: str | Path) -> None:
        """Load the LoRA adapter at ``path`` (PEFT's ``save_pretrained``
        directory) as ``name``, for prompts that ask for it (``prefill``'s
        ``loras``). Again with the same path: nothing to do. InvalidRequest
        for an adapter this engine cannot apply (stages/torch_engine/lora.py
        says which) or another path under a loaded name."""
        if not name:
            raise InvalidRequest("a LoRA adapter needs a name")
        loaded = self._loras.adapters.get(name)
        if loaded is not None:
            if loaded.path == Path(path).resolve():
                return
            raise InvalidRequest(f"LoRA adapter {name!r} is loaded from {loaded.path}; unload it first to load {path}")
        if self.sleeping or self.model is None:
            raise InvalidRequest(f"the engine is asleep (level {self.sleeping}): wake it up to load an adapter")
        adapter = read_adapter(name, path, self.model)
        self._check_room(adapter)
        with self._lock:
            self._loras.add(adapter)
            try:
                self._adapters_changed()
            except BaseException:
                self._loras.remove(name)
                raise
        log.info("lora_loaded", name=name, path=str(adapter.path), modules=len(adapter.modules))

    def unload_lora(self, name: str) -> bool:
        """Unload adapter ``name`` (False: none of that name); InvalidRequest
        while a sequence that uses it is not released."""
        if name not in self._loras.adapters:
            return False
        with self._lock:
            users = [seq for seq in self._lora_seqs if seq.lora_name == name and not seq.released]
            if users:
                raise InvalidRequest(f"LoRA adapter {name!r} is in use by {len(users)} running sequences")
            self._loras.remove(name)
            self._adapters_changed()
        log.info("lora_unloaded", name=name)
        return True

    def _check_room(self, adapter: LoraAdapter) -> None:
        """InvalidRequest for an adapter past ``--max-loras``' room."""
        if self._lora_room is None:
            return
        most, rank = self._lora_room
        if len(self._loras.adapters) >= most:
            raise InvalidRequest(f"--max-loras {most}: that many LoRA adapters are loaded; unload one first")
        top = max((w.rank for w in adapter.modules.values()), default=0)
        if top > rank:
            raise InvalidRequest(f"LoRA adapter {adapter.name!r}: rank {top} is past --max-lora-rank {rank}")
        head = self.model.get_output_embeddings()
        if any(self.model.get_submodule(t) is head for t in adapter.modules):
            # The graphs captured at start run the head as it was: a wrapper on it now would not replay.
            raise InvalidRequest(f"LoRA adapter {adapter.name!r}: with --max-loras, an adapter on the output head")

    def _adapters_changed(self) -> None:
        """The loaded adapters changed: the wrapped modules' stacks and the
        fused step's made again, and no graph captured over the old ones
        (those wait for a step or prefill that needs them: the first after a
        load captures, on a GPU compiles too). With ``--max-loras`` the fused
        step's stacks are written in place instead, its graphs kept."""
        decoder = self.decoder
        if self._lora_room is not None and decoder is not None and decoder.adapters is not None:
            self._loras.apply(self.model)  # the modules' wrappers (eager, never graphed)
            made = self._loras.fused(self.model, self._lora_room)
            assert made is not None
            refill(decoder.adapters, made)
            return
        if self.decoder is not None:
            self.decoder.forget_graphs()  # none still queued reads the old stacks
        if self._slot_prefill is not None:
            self._slot_prefill.forget_graphs()
        if self.model is None:
            return
        self._loras.apply(self.model)
        if self.decoder is not None and self.decoder.fused is not None:
            self.decoder.adapters = self._loras.fused(self.model)

    def loras(self) -> list[str]:
        """The names of the adapters loaded."""
        return self._loras.names()

    def _with_lora(self, seq: Sequence, name: str | None) -> None:
        # Its steps run the adapter; unload_lora sees it while it lives.
        if name is not None:
            seq.lora_name, seq.lora = name, self._loras.slot(name)
            self._lora_seqs.add(seq)

    # -- generation ---------------------------------------------------------

    def prefill(
        self,
        prompt_token_ids: list[list[int]],
        media: list[list[MediaEmbedding]],
        sampling: list[SamplingConfig],
        emitted: list[list[int]] | None = None,
        defer: bool = False,
        embeds: list[torch.Tensor | None] | None = None,
        loras: list[str | None] | None = None,
    ) -> list[tuple[Sequence, int]]:
        """Run each prompt; return its sequence state and the next token.

        ``embeds[i]``: prompt ``i`` as input embeddings [tokens, hidden] (a
        client's ``prompt_embeds``; its ids then only stand for its places).
        ``loras[i]``: the LoRA adapter (``load_lora``'s name) prompt ``i``
        and its sequence run with (None: the model alone); ModelNotFound
        for one not loaded.

        ``defer``: on a GPU, a greedy sequence's next token is not waited for
        (that wait is for everything queued on the device, other requests'
        steps included, and it held the engine's one thread): -1 is returned
        in its place, and ``settle`` waits for it and appends it.

        A prompt holds one placeholder per media item; it is expanded to the
        item's token count here. `emitted[i]` are tokens an earlier attempt
        already streamed: they are fed one decode step at a time (not as one
        chunk with the prompt) so the state, and the token returned (index
        len(emitted[i])), are bit-identical to the uninterrupted run.
        """
        n = len(prompt_token_ids)
        emitted = emitted if emitted is not None else [[] for _ in range(n)]
        if not len(media) == len(sampling) == len(emitted) == n:
            raise ValueError("prefill: prompt_token_ids, media, sampling and emitted differ in length")
        given = embeds if embeds is not None else [None] * n
        adapters = loras if loras is not None else [None] * n
        if len(adapters) != n:
            raise ValueError("prefill: prompt_token_ids and loras differ in length")
        for name in adapters:
            self._loras.slot(name)  # every name known before any prompt runs
        jobs = zip(prompt_token_ids, media, sampling, emitted, given, adapters, strict=True)
        return [self._prefill_one(p, im, s, e, defer, g, a) for p, im, s, e, g, a in jobs]

    def chunked(self, expanded_len: int) -> bool:
        """Whether a prompt of this many tokens (media expanded) prefills in chunks."""
        budget = self.max_num_batched_tokens
        return 0 < budget < expanded_len

    def start_prefill(
        self,
        prompt_token_ids: list[int],
        media: list[MediaEmbedding],
        sampling: SamplingConfig,
        lora: str | None = None,
    ) -> Prefilling:
        """A long prompt to prefill chunk by chunk (``prefill_chunk``), one
        engine call each, so that running sequences step between the chunks
        instead of waiting for the whole prompt (``--max-num-batched-tokens``).
        Holds nothing until its first chunk; ``drop_prefill`` lets go of what
        it holds if it is not run to its end."""
        if any(not m.encoded for m in media):
            raise MediaNotEncoded("a chunked prefill looks up no cached prefix: each medium needs encoding")
        self._loras.slot(lora)
        ids, positions, delta = self._prepare(prompt_token_ids, media, [])
        with self._lock, torch.inference_mode():
            embeds = self.family.embed_prompt(self.model, ids, media)
        # Cached once its blocks hold it (a later turn reuses it); not looked up yet.
        keys = self._keys(prompt_token_ids, media, self._loras.salt(lora))
        return Prefilling(len(ids), positions, delta, embeds, sampling, keys=keys, ids=ids, lora=lora)

    def prefill_chunk(self, prefilling: Prefilling, defer: bool = False) -> tuple[Sequence, int] | None:
        """The next chunk of ``prefilling`` through the model, over the cache
        of the chunks before it; after the last, its sequence and next token
        (as ``prefill`` gives them), else None. Chunked, the prompt's keys and
        values are the same computation over other matrix shapes: their last
        bits may differ from one forward's.

        Where the fused layers prefill into the pool (a GPU's default), the
        prompt's blocks are taken at its first chunk (after the blocks of a
        cached prefix, which it starts past) and each chunk writes its keys
        and values straight into them; elsewhere (or with no room in the
        pool then) the chunks run through the model's modules over a cache
        of their own, which moves into blocks when the sequence joins the
        batch decoder."""
        return self._prefill_chunk(prefilling, defer, "alone")

    def _prefill_chunk(self, p: Prefilling, defer: bool, how: str) -> tuple[Sequence, int] | None:
        if p.done >= p.length:
            raise ValueError("the prompt is prefilled already")
        metrics.PREFILL_CHUNKS.labels(how).inc()
        if p.into_blocks is None:
            with self._lock:
                p.into_blocks = self._chunks_into_blocks(p)
        if p.into_blocks:
            return self._chunk_into_blocks(p, defer)
        end = p.length if self.max_num_batched_tokens <= 0 else min(p.length, p.done + self.max_num_batched_tokens)
        slot = self._loras.slot(p.lora)
        with self._lock, torch.inference_mode(), self._loras.for_rows([slot], self.device):
            logits, p.cache = self.family.forward(
                self.model, p.positions[..., p.done : end], p.cache, inputs_embeds=p.embeds[:, p.done : end]
            )
        p.done = end
        if end < p.length:
            return None
        seq = p.sequence(p.cache)
        self._with_lora(seq, p.lora)
        p.cache = p.embeds = None
        return seq, self._select(seq, logits, defer)

    def drop_prefill(self, prefilling: Prefilling) -> None:
        """A chunked prefill given up before its last chunk: its blocks go
        back (those of a cached prefix stay cached)."""
        p = prefilling
        if p.blocks and self.decoder is not None:
            with self._lock:
                self.decoder.pool.free(p.blocks)
                self._count_blocks()
        p.blocks, p.cache, p.embeds = None, None, None

    def _chunk_len(self) -> int:
        """Tokens a chunk prefilled into blocks takes: the budget, within the
        graphed prefill's longest, in whole blocks (each chunk starts on a
        block's first position)."""
        prefill = self._slot_prefill
        if prefill is None:
            return 0
        budget = self.max_num_batched_tokens if self.max_num_batched_tokens > 0 else prefill.max_tokens
        return min(budget, prefill.max_tokens) // self.block_size * self.block_size

    def _chunks_into_blocks(self, p: Prefilling) -> bool:
        """Whether ``p``'s chunks prefill into blocks of the pool, their
        blocks taken if so (a cached prefix's first, held: the chunks start
        past it)."""
        decoder, slots = self.decoder, self._slots
        if decoder is None or slots is None or self._chunk_len() == 0:
            return False
        # One the decoder could never hold to its end decodes on its own cache.
        if decoder.blocks_for(p.length + p.sampling.max_tokens) > decoder.blocks_per_seq:
            return False
        hit = self._cached_prefix(p.keys, p.length)
        need = decoder.blocks_for(p.length) - len(hit)
        if not decoder.pool.can_allocate(need + self._spare()):
            decoder.pool.free(hit)
            return False
        p.blocks = hit + decoder.pool.allocate(need)
        p.done = p.cached = len(hit) * self.block_size
        self._count_blocks()
        return True

    def _chunk_into_blocks(self, p: Prefilling, defer: bool) -> tuple[Sequence, int] | None:
        prefill = self._slot_prefill
        assert prefill is not None and p.blocks is not None
        end = min(p.length, p.done + self._chunk_len())
        slot = self._loras.slot(p.lora)
        with self._lock, torch.inference_mode(), self._loras.for_step(prefill.lora_slot, [slot], False):
            logits = prefill.run(
                p.embeds[0, p.done : end], p.positions[..., p.done : end], p.blocks, start=p.done, lora=slot, chunk=True
            )
            p.done = end
            return self._chunked_sequence(p, logits, defer) if end == p.length else None

    def _chunked_sequence(self, p: Prefilling, logits: torch.Tensor, defer: bool) -> tuple[Sequence, int]:
        """A prompt whose last chunk went into its blocks: its sequence (in a
        decoder row where one is free) and first token (under the lock)."""
        slots = self._slots
        assert slots is not None
        seq = p.sequence()
        p.blocks = p.embeds = None  # the sequence's now
        try:
            self._with_lora(seq, p.lora)
            self._register_prefix(seq)
            # A row now where one is free; else the batch decoder seats it as others leave (``_admit``).
            if slots.can_take(p.length, held=seq.blocks):
                slots.take(seq, p.length)
            return seq, self._select(seq, logits, defer)
        except BaseException:
            slots.free(seq)  # nobody else holds it yet
            raise

    def _carried_chunk(self, p: Prefilling) -> tuple[ChunkRows, int] | None:
        """``p``'s next chunk as rows a decode step carries, and where it
        ends; None where its chunks do not prefill into blocks (under the
        lock; decides that at its first chunk)."""
        if p.done >= p.length:
            raise ValueError("the prompt is prefilled already")
        if p.into_blocks is None:
            p.into_blocks = self._chunks_into_blocks(p)
        prefill = self._slot_prefill
        # With graphs the chunk replays its own after the step: in the step's
        # forward it took that graphless forward along (see ``launch``).
        if not p.into_blocks or prefill is None or prefill.use_graphs:
            return None
        assert p.blocks is not None
        end = min(p.length, p.done + self._chunk_len())
        rows = prefill.chunk_rows(
            p.embeds[0, p.done : end], p.positions[..., p.done : end], p.blocks, p.done, self._loras.slot(p.lora)
        )
        return rows, end

    def _carried_done(
        self, p: Prefilling, rows: ChunkRows, end: int, defer: bool
    ) -> tuple[Sequence, int] | BaseException | None:
        """After the step that carried ``p``'s chunk: as ``prefill_chunk``
        gives it, or the error that ends the prompt (not the step's rows)."""
        metrics.PREFILL_CHUNKS.labels("mixed").inc()
        try:
            p.done = end
            if end < p.length:
                return None
            assert rows.hidden is not None
            with self._loras.for_rows([self._loras.slot(p.lora)], self.device):
                logits = self.model.lm_head(rows.hidden)[0]
            return self._chunked_sequence(p, logits, defer)
        except Exception as exc:
            log.error("chunk_failed", error=repr(exc), exc_info=exc)
            return exc

    def prompt_logprobs(self, prompt_ids: list[int], top: int, lora: str | None = None) -> list[Logprobs]:
        """Each text prompt token's logprob after the first, under the model's
        output at the place before it, and the ``top`` most likely tokens
        there (first index on ties). A forward of the prompt of its own, in
        slices of ``_PROMPT_LOGPROBS_SLICE`` tokens over one cache, so that
        no more than a slice's logits are held at once."""
        out: list[Logprobs] = []
        slot = self._loras.slot(lora)
        ids = tensor_on([prompt_ids], self.device, torch.long)
        positions, _ = self.family.prompt_positions(prompt_ids, [])
        cache = None
        with self._lock, torch.inference_mode(), self._loras.for_rows([slot], self.device):
            for start in range(0, len(prompt_ids) - 1, _PROMPT_LOGPROBS_SLICE):
                end = min(start + _PROMPT_LOGPROBS_SLICE, len(prompt_ids) - 1)
                logits, cache = self.family.forward(
                    self.model, positions[..., start:end], cache, input_ids=ids[:, start:end], all_logits=True
                )
                out += rows_logprobs(logits, prompt_ids[start + 1 : end + 1], top)
        return out

    def settle(self, seq: Sequence) -> int:
        """The token ``prefill(defer=True)`` chose for ``seq``, once it is on
        the host (waits for it; any thread), appended to the sequence. A
        step may have taken the sequence meanwhile (fed that token on the
        device) and ``collect`` settled it first: the same token."""
        pending = seq.pending
        if pending is not None:
            [token] = pending.tokens()
            with self._settle_lock:
                if seq.pending is pending:
                    seq.output_ids.append(token)
                    seq.pending = None
        # Deferred only for a prompt's first token (nothing resumed after it).
        return seq.output_ids[0]

    def step(self, seqs: list[Sequence]) -> list[int | None]:
        """One decode step: each sequence gets one new token, appended to it.

        Sequences in (or admitted now to) the batch decoder advance there
        together, in one forward; those that never fit it (no decoder, too
        long) one by one. One that fits the decoder but not now (its blocks
        are not free, or it was swapped out for an older one to grow) takes
        no step: None in its place.
        """
        return self.step_carrying(seqs, None)[0]

    def step_carrying(
        self, seqs: list[Sequence], chunk: Prefilling | None
    ) -> tuple[list[int | None], tuple[Sequence, int] | BaseException | None]:
        """``step``, carrying ``chunk``'s next chunk as ``launch`` does (where
        the host chooses a row's token and the batch cannot be launched: a
        grammar, say): the tokens, and what the chunk gave (``Launch.chunk``).
        A step that raises ran no chunk."""
        for seq in seqs:
            if seq.released:
                raise ValueError("step on a released sequence")
            if seq.inflight:
                raise ValueError("step on a sequence whose launched step is not collected")
        for seq in seqs:
            if seq.pending is not None:
                self.settle(seq)  # from the host here: the step feeds the last of its tokens
            self._drop_cell(seq)
            if seq.length >= self.max_model_len:
                raise ContextLengthExceeded(f"sequence reached the model's context of {self.max_model_len} tokens")
        _drop_prompt_logits(seqs)
        with self._lock, torch.inference_mode(), self._sized_step(seqs, chunk):
            with self._settle_lock:
                batched = self._grown([seq for seq in seqs if self._admit(seq)])
                inputs = self._slots.step_inputs({q.slot for q in batched}) if batched and self._slots else None
            carried, failed = self._chunk_rows(chunk, bool(batched))
            out: tuple[Sequence, int] | BaseException | None = failed
            chosen: dict[int, int] = {}
            if batched:
                assert self.decoder is not None and inputs is not None
                # Every row steps (a row not asked for writes the same key and
                # value again: idempotent); only the asked ones take a token.
                extras, samples = self._extras(batched)
                with self._loras.for_step(self.decoder.lora, inputs.lora, self.decoder.use_graphs):
                    logits = self.decoder.step(
                        *inputs, extras=extras, samples=samples, chunk=carried[0] if carried else None
                    )
                chosen = self._select_batch(batched, logits, extras)
            if chunk is not None and carried is not None:
                out = self._carried_done(chunk, *carried, defer=True)
            tokens = [chosen[id(q)] if q.slot >= 0 else None if self._ever_fits(q) else self._step_one(q) for q in seqs]
        return tokens, self._chunk_after_step(chunk, carried, out)

    def _chunk_rows(
        self, chunk: Prefilling | None, stepping: bool
    ) -> tuple[tuple[ChunkRows, int] | None, BaseException | None]:
        """A step's chunk as rows for its forward (None: it cannot ride it),
        or the error that ends its prompt (under the lock, after the running
        rows took their blocks: a chunk that finds none left goes the
        modules' way)."""
        if chunk is None or not stepping:
            return None, None
        try:
            return self._carried_chunk(chunk), None
        except Exception as exc:  # the prompt's error, not the running rows'
            log.error("chunk_failed", error=repr(exc), exc_info=exc)
            return None, exc

    def _chunk_after_step(
        self, chunk: Prefilling | None, carried: Any, out: tuple[Sequence, int] | BaseException | None
    ) -> tuple[Sequence, int] | BaseException | None:
        """What a step's chunk gave: ``out`` where it rode the step (or
        failed), else its own forward now, queued behind the step."""
        if chunk is None or carried is not None or out is not None:
            return out
        try:
            return self._prefill_chunk(chunk, True, "after_step")
        except Exception as exc:
            log.error("chunk_failed", error=repr(exc), exc_info=exc)
            return exc

    def launch(self, seqs: list[Sequence], chunk: Prefilling | None = None) -> Launch | None:
        """Queue one step of ``seqs`` on the device and return without waiting
        for it; ``collect`` reads its tokens and appends them. A sequence with
        a launched step not yet collected feeds that step's token from the
        device, so the next step can be queued before the host has read the
        last one (the decode loop keeps one step ahead: the GPU never waits
        for the host between steps). None, with nothing queued, where the
        batch cannot go this way: a sequence whose token the host chooses (a
        grammar, stop ids masked below min_tokens) or that never fits the
        batch decoder; ``step`` it instead, once
        nothing launched is left uncollected. A sequence that fits the
        decoder but not now (its blocks are not free, or it was swapped out
        for an older one to grow) is not in the step: ``collect`` gives None
        in its place.

        A step may run for a sequence that the previous step's token ends (it
        is launched before that token is read): it writes one position past
        the last token, in a block it is given, and its token is dropped.

        ``chunk``: a long prompt whose next chunk the step carries, as vLLM
        v1 mixes prefill and decode in one batch: in the step's forward
        where its chunks prefill into blocks without graphs (each weight read
        once for the chunk and the rows), else just after the step (with
        graphs, the chunk's own: on an H200 a step of 8 rows of the 2B preset
        carrying a 512-token chunk ran 28.0 ms without a graph, against 1.9 ms
        for the step's graph and 8.1 for the chunk's);
        ``Launch.chunk`` has what it gave. A launch that returns None (or raises) ran no chunk.
        In float32 a chunk's keys and values are the chunk path's sums over
        other matrix shapes: the last bits may differ from it."""
        decoder, slots = self.decoder, self._slots
        if decoder is None or slots is None:
            return None
        for seq in seqs:
            if seq.released:
                raise ValueError("launch on a released sequence")
            # Its prefill's token may still be on its way to the host where a
            # step can feed it from the device (a cell, or a launched step's row).
            if seq.pending is not None and seq.feed_row < 0:
                raise ValueError("launch on a sequence whose prefill token is not settled")
            if not self._in_batch(seq):
                return None
            wanted = seq.generated_ahead < seq.sampling.max_tokens
            if wanted and seq.ahead + 1 >= self.max_model_len:
                raise ContextLengthExceeded(f"sequence reached the model's context of {self.max_model_len} tokens")
        _drop_prompt_logits(seqs)
        with self._lock, torch.inference_mode(), self._sized_step(seqs, chunk):
            if any(not self._admit(seq) and not self._ever_fits(seq) for seq in seqs):
                return None
            with self._settle_lock:
                stepped = self._grown([seq for seq in seqs if seq.slot >= 0])
                inputs = slots.step_inputs({seq.slot for seq in stepped})
            carried, failed = self._chunk_rows(chunk, bool(stepped))
            out: tuple[Sequence, int] | BaseException | None = failed
            launched = None
            # None of them in a row (each waits for blocks, the one running
            # swapped out just now to let an older prompt's blocks be): no
            # step to queue, and where no other sequence holds a row the
            # decoder has no row to step at all. The chunk still runs, alone.
            if stepped:
                with self._loras.for_step(decoder.lora, inputs.lora, decoder.use_graphs):
                    launched = decoder.launch(inputs, *self._extras(stepped), chunk=carried[0] if carried else None)
            for seq in stepped:
                seq.inflight += 1
                decoder.free_first(seq.feed_row)  # read by this step, and by no later one
                seq.feed_row = seq.slot
            if chunk is not None and carried is not None:
                out = self._carried_done(chunk, *carried, defer=True)
        out = self._chunk_after_step(chunk, carried, out)
        return Launch([(seq, seq.slot) for seq in seqs], launched, carried=chunk is not None, chunk=out)

    def collect(self, launch: Launch) -> list[int | None]:
        """The tokens of a launched step (waits for it), each appended to its
        sequence unless that was released meanwhile (None: not in the step)."""
        launched = launch.launched
        values = launched.tokens() if launched is not None else []
        with self._lock:
            tokens: list[int | None] = []
            for seq, row in launch.rows:
                if row < 0 or launched is None:
                    tokens.append(None)
                    continue
                seq.inflight -= 1
                if not seq.inflight:
                    seq.feed_row = -1
                if seq.pending is not None:
                    self.settle(seq)  # its prefill's token comes before this step's (and is on the host by now)
                if not seq.released:
                    if seq.sampling.logprobs is not None:
                        seq.logprobs[seq.num_generated] = launched.logprobs(row, seq.sampling.logprobs)
                    seq.output_ids.append(values[row])
                tokens.append(values[row])
            return tokens

    def _in_batch(self, seq: Sequence) -> bool:
        """Whether the batch decoder's step chooses ``seq``'s tokens (else the host does)."""
        s = seq.sampling
        return s.on_device or (s.batchable and row_sampling.fits(s))

    def _extras(self, seqs: list[Sequence]) -> tuple[bool, bool]:
        """Whether a step of ``seqs`` applies penalties or reports logprobs on
        the device, and whether a row of it samples there."""
        stepped = [q for q in seqs if self._in_batch(q)]
        samples = any(not q.sampling.greedy for q in stepped)
        return samples or any(not q.sampling.on_device for q in stepped), samples

    def _grown(self, seqs: list[Sequence]) -> list[Sequence]:
        """``seqs`` (in the decoder) with a block each for this step's write;
        those swapped out to make room are left out."""
        if not seqs:
            return seqs
        assert self._slots is not None and self.decoder is not None
        preempted = self._slots.grow(seqs)
        if preempted:
            metrics.PREEMPTIONS.inc(len(preempted))
            log.info("kv_preempted", sequences=len(preempted), free_blocks=self.decoder.pool.num_free)
        self._count_blocks()
        return [seq for seq in seqs if seq.slot >= 0]

    def _count_blocks(self) -> None:
        decoder = self.decoder
        if decoder is not None:
            pool = decoder.pool
            metrics.KV_USAGE.set(1 - pool.num_free / pool.capacity)

    def admissible(self, seqs: list[Sequence]) -> list[bool]:
        """Which of ``seqs`` a step can take now, first come first served:
        one in the batch decoder, or never to be in it (it steps on its own
        cache), goes; one that needs blocks goes if they are free beside
        those taken by the ones before it, and once one must wait, the ones
        behind it that need blocks wait too, but for one that holds blocks
        already, which goes if the rest it needs is free. (Read without the
        engine's lock: a step admits again, and one it cannot take waits a
        step.)"""
        decoder, slots = self.decoder, self._slots
        if decoder is None or slots is None:
            return [True] * len(seqs)
        free, rows = decoder.pool.num_free, decoder.max_slots - slots.taken
        out, waiting = [], False
        for seq in seqs:
            if seq.slot >= 0 or not self._ever_fits(seq):
                out.append(True)
                continue
            # One swapped out comes back as it was, with the block its next
            # write needs (swapped out for want of it, back into just its own
            # blocks its next step would swap it out again); a new one leaves
            # a few blocks to grow into.
            swapped = seq.swapped  # once: the engine's thread may take it meanwhile
            short = 0 if swapped else decoder.blocks_for(seq.length) - len(seq.blocks)
            if swapped:
                need = max(len(swapped[0][0]), seq.ahead // decoder.block_size + 1)
            else:
                need = short + self._spare()
            if not swapped and seq.blocks and not seq.receiving:
                # It holds blocks already (a prompt chunked into them, a
                # cached prefix it prefilled past, a hand-off's READ): it goes
                # ahead of one waiting for blocks if the rest it needs is
                # free, as its running to its end frees what it holds. Held
                # back, the two could wait on each other for ever (seen: a
                # lone sequence swapped out, first in line, short of the
                # blocks that a prompt behind it held or shared with it).
                joins = rows >= 1 and need <= free
                if joins:
                    free, rows = free - max(short, 0), rows - 1
                waiting = waiting or not joins
                out.append(joins)
                continue
            waiting = waiting or need > free or rows < 1
            if not waiting:
                free, rows = free - need, rows - 1
            out.append(not waiting)
        return out

    def unblock(self, seqs: list[Sequence]) -> bool:
        """With no sequence running and none of ``seqs`` (the waiting, first
        in line first) admissible: the blocks waiting ones hold are let go,
        the last in line's first, until the first in line fits. A cached
        prefix's shares go (the sequence's own cache holds those positions
        too: it joins into fresh blocks), a cache held in blocks goes to the
        host (it comes back as a swapped-out one). Held, they could wait for
        ever: each short of blocks another holds, and none running to free
        them (seen: two prompts each holding a cached prefix, one worker,
        `--kv-cache-memory` for about one conversation). Whether anything
        was let go."""
        decoder, slots = self.decoder, self._slots
        if decoder is None or slots is None or not seqs:
            return False
        let_go = False
        with self._lock, torch.inference_mode():
            for seq in reversed(seqs):
                if self.admissible(seqs)[0]:
                    break
                if seq.slot >= 0 or seq.swapped or seq.receiving or not seq.blocks:
                    continue
                if seq.cache is not None:
                    decoder.pool.free(seq.blocks)
                    seq.blocks = []
                else:
                    slots.swap_out(seq)
                let_go = True
            self._count_blocks()
        if let_go:
            log.info("kv_waiting_let_go", waiting=len(seqs), free_blocks=decoder.pool.num_free)
        return let_go

    def has_room(self) -> bool:
        """Whether the pool has blocks for more than a few tokens: below that,
        a worker takes no more requests until running ones leave."""
        decoder = self.decoder
        return decoder is None or decoder.pool.num_free > self._spare()

    def _spare(self) -> int:
        """Blocks a new sequence leaves free for running ones to grow into
        (vLLM's watermark: 1% of the pool)."""
        decoder = self.decoder
        return 0 if decoder is None else max(1, decoder.pool.capacity // 100)

    def _ever_fits(self, seq: Sequence) -> bool:
        # The pool holds one sequence of the decoder's longest at least (checked at start).
        decoder = self.decoder
        return decoder is not None and decoder.blocks_for(_budget(seq)) <= decoder.blocks_per_seq

    def _drop_cell(self, seq: Sequence) -> None:
        """Its prefill's token no longer fed from a cell (the host has it, or it is gone)."""
        if self.decoder is not None and self.decoder.is_cell(seq.feed_row):
            self.decoder.free_first(seq.feed_row)
            seq.feed_row = -1

    def release(self, seq: Sequence) -> None:
        self._drop_cell(seq)
        if seq.cache is not None and seq.prefix_keys and seq.slot < 0 and not seq.receiving:
            self._keep_prefix(seq)
        seq.cache = None
        seq.swapped = None
        seq.prompt_logits = None
        if seq.slot < 0 and not seq.blocks and not seq.receiving:
            return
        assert self._slots is not None
        with self._lock:
            self._slots.free(seq)
            self._count_blocks()

    def _keep_prefix(self, seq: Sequence) -> None:
        """A sequence that ends before it ever stepped (one token asked for,
        or its first was its last) still leaves its prompt's full blocks in
        the cache, as vLLM's do: where its prefill ran through the model's
        modules (not into the pool), its cache moves into blocks here, which
        are freed at once and stay cached until the pool needs them."""
        if self.decoder is None or not self.prefix_caching:
            return
        with self._lock, torch.inference_mode(), self._settle_lock:
            self._admit(seq)

    def _admit(self, seq: Sequence) -> bool:
        """Whether ``seq`` is (now) in the batch decoder; its cache moves to its blocks."""
        if seq.slot >= 0:
            return True
        if seq.receiving:
            raise ValueError("step on a sequence whose KV cache is still arriving")
        decoder, slots = self.decoder, self._slots
        if decoder is None or slots is None:
            return False
        if seq.swapped is not None:
            if not slots.can_swap_in(seq):
                return False
            slots.swap_in(seq)
            return True
        if not self._ever_fits(seq) or not slots.can_take(seq.length, held=seq.blocks):
            return False
        cached = len(seq.blocks)  # a cached prefix's, there already
        slots.take(seq, seq.length)
        if seq.cache is not None:  # else a chunked prefill wrote its whole prompt into its blocks
            decoder.load(seq.blocks, [(layer.keys, layer.values) for layer in seq.cache.layers], skip=cached)
            seq.cache = None
        self._register_prefix(seq)
        return True

    # -- hand-off between engines ------------------------------------------

    def export_kv(self, seq: Sequence) -> tuple[list[torch.Tensor], KvState]:
        """Per-layer keys and values (``[k0, v0, k1, v1, ...]``, each
        ``kv_shape``: the cache's ``length - 1`` positions in blocks) and the
        state beside them.

        The sequence's last token is not in the cache yet: the receiving
        engine feeds it with its first step, as this one would have.
        """
        if seq.released:
            raise ValueError("export of a released sequence")
        if seq.pending is not None:
            raise ValueError("export of a sequence whose prefill token is not settled")
        tensors: list[torch.Tensor] = []
        # Its cache, until the decoder takes it, is the whole prompt's (its
        # blocks then are only a cached prefix's).
        if seq.blocks and seq.cache is None:
            assert self.decoder is not None
            with self._lock:
                layers = self.decoder.read(seq.blocks[: blocks_for(seq.length - 1, self.block_size)])
        else:
            layers = [
                (to_blocks(layer.keys[0], self.block_size), to_blocks(layer.values[0], self.block_size))
                for layer in seq.cache.layers
            ]
        for keys, values in layers:
            tensors += [keys, values]
        return tensors, KvState(seq.prompt_len, list(seq.output_ids), seq.rope_delta)

    def kv_shape(self, state: KvState, block_size: int | None = None) -> tuple[int, ...]:
        """The shape of each of the ``2 * layers`` tensors of a hand-off of
        ``state`` in blocks of ``block_size`` (default this engine's)
        (checked: a valid next token, room left in the context)."""
        length = _cached(state)
        if not state.output_ids or any(not 0 <= t < self.family.vocab_size for t in state.output_ids):
            raise InvalidRequest("KV hand-off without a valid next token")
        if length + 1 >= self.max_model_len:
            raise ContextLengthExceeded(f"sequence of {length + 1} tokens fills the context of {self.max_model_len}")
        size = block_size or self.block_size
        fam = self.family
        return (blocks_for(length, size), fam.num_key_value_heads, size, fam.head_dim)

    def import_kv(
        self, tensors: list[torch.Tensor], state: KvState, sampling: SamplingConfig, lora: str | None = None
    ) -> Sequence:
        """A sequence from another engine's ``export_kv`` (blocks of any
        size): checked against this model's shape, moved to this engine's
        device and dtype. ``lora``: the adapter it was prefilled with (its
        steps here run it too)."""
        self._loras.slot(lora)
        from transformers import DynamicCache

        layers = self.family.num_hidden_layers
        if len(tensors) != 2 * layers:
            raise InvalidRequest(f"KV cache of {len(tensors) // 2} layers for a model of {layers}")
        size = int(tensors[0].shape[2]) if tensors[0].dim() == 4 else 0
        want = self.kv_shape(state, size) if size > 0 else None
        for t in tensors:
            if want is None or tuple(t.shape) != want:
                raise InvalidRequest(
                    f"KV tensor of shape {tuple(t.shape)}; this model and sequence need "
                    f"{self.kv_shape(state)} (in blocks of any size)"
                )
        length = _cached(state)
        moved = [from_blocks(to_device(t, self.device, self.dtype), length)[None] for t in tensors]
        cache = DynamicCache(ddp_cache_data=list(zip(moved[0::2], moved[1::2], strict=True)))
        seq = Sequence(
            prompt_len=state.prompt_len,
            output_ids=list(state.output_ids),
            sampling=sampling,
            rope_delta=state.rope_delta,
            cache=cache,
        )
        self._with_lora(seq, lora)
        return seq

    def reserve_kv(
        self, state: KvState, sampling: SamplingConfig, lora: str | None = None
    ) -> tuple[Sequence, list[list[torch.Tensor]]] | None:
        """Blocks of the batch decoder's pool for a sequence whose KV cache is
        still to arrive, and their views (per tensor of ``[k0, v0, k1, v1,
        ...]``, its blocks in order, each [kv_heads, block_size, head_dim])
        for a transport to READ the cache straight into: no copy after the
        transfer. Call ``received`` once it is there, or ``abandon``
        (``tainted`` if a READ into it may still run). None where the
        sequence would not go to the batch decoder: ``import_kv`` then.
        ``lora``: as ``import_kv``'s."""
        self._loras.slot(lora)
        shape = self.kv_shape(state)
        decoder, slots = self.decoder, self._slots
        if decoder is None or slots is None:
            return None
        seq = Sequence(
            prompt_len=state.prompt_len,
            output_ids=list(state.output_ids),
            sampling=sampling,
            rope_delta=state.rope_delta,
            cache=None,
            receiving=True,
        )
        self._with_lora(seq, lora)
        with self._lock:
            if not self._ever_fits(seq) or not slots.can_take(_cached(state), self._spare()):
                return None
            slots.hold(seq, _cached(state))
            # A step launched for the blocks' last owner may still be queued:
            # the READ, which the device's queue does not order, waits for it.
            seq.quiet = torch.cuda.Event() if self.device.type == "cuda" else None
            if seq.quiet is not None:
                seq.quiet.record()
        views = decoder.block_views(seq.blocks[: shape[0]])
        return seq, [pieces for pair in views for pieces in pair]

    def wait_quiet(self, seq: Sequence) -> None:
        """Until nothing queued before ``reserve_kv`` can write ``seq``'s
        blocks (blocks; any thread)."""
        if seq.quiet is not None:
            seq.quiet.synchronize()
            seq.quiet = None

    def received(self, seq: Sequence) -> None:
        """The KV cache reserved for ``seq`` has arrived: it steps from now on."""
        assert self._slots is not None
        with self._lock:
            self._slots.place(seq)
            seq.receiving = False

    def abandon(self, seq: Sequence, tainted: bool) -> None:
        """A reserved sequence whose cache will not arrive. ``tainted``: a
        READ into its blocks could not be cancelled, so they are never used
        again."""
        if not tainted:
            self.release(seq)
            return
        assert self._slots is not None
        with self._lock:
            self._slots.leak(seq)
            seq.receiving = False

    def resume(self, seq: Sequence, emitted: list[int]) -> int:
        """Bring ``seq`` in line with the tokens a client already has and
        select the next one.

        ``emitted`` starts with the sequence's own outputs where the two
        agree; from the first disagreement on, the client's tokens win: they
        replace the sequence's pending token and are fed one step each.
        """
        done = seq.output_ids[:-1]
        if emitted[: len(done)] != done:
            raise ValueError("emitted tokens disagree with tokens already in the cache")
        with self._lock, torch.inference_mode():
            seq.output_ids[-1] = emitted[len(done)]
            logits = self._decode_forward(seq)
            return self._continue(seq, logits, emitted[len(done) + 1 :])

    def fork(self, src: Sequence, sampling: SamplingConfig) -> tuple[Sequence, int] | None:
        """A new sequence of ``src``'s prompt that samples by ``sampling``:
        ``src``'s prompt keys and values copied (from its cache, or its
        blocks once the decoder took it), its first token chosen from the
        logits ``src``'s prefill gave (kept while ``src.forkable``). So the
        ``n`` choices of a prompt cost one prefill. None where ``src`` can
        no longer give them (released, swapped out, past its first step)."""
        from transformers import DynamicCache

        with self._lock, torch.inference_mode():
            logits = src.prompt_logits
            if logits is None or src.released or src.swapped is not None or src.pending is not None:
                return None
            n = src.prompt_len
            if src.cache is not None:
                layers = [(layer.keys[:, :, :n].clone(), layer.values[:, :, :n].clone()) for layer in src.cache.layers]
            else:
                assert self.decoder is not None
                read = self.decoder.read(src.blocks[: blocks_for(n, self.block_size)])
                layers = [(from_blocks(k, n)[None], from_blocks(v, n)[None]) for k, v in read]
            seq = Sequence(
                prompt_len=n,
                output_ids=[],
                sampling=sampling,
                rope_delta=src.rope_delta,
                cache=DynamicCache(ddp_cache_data=layers),
                cached_tokens=src.cached_tokens,
            )
            self._with_lora(seq, src.lora_name)  # the same prompt through the same adapter
            token = self._select(seq, logits)
        metrics.PREFILL_FORKS.inc()
        return seq, token

    # -- internals ----------------------------------------------------------

    def prefill_together(
        self,
        jobs: list[tuple[list[int], list[MediaEmbedding], SamplingConfig]],
        loras: list[str | None] | None = None,
    ) -> list[tuple[Sequence, int]]:
        """Several new prompts in one forward (``--prefill-batch``): left-padded
        to the longest, padding masked out, each prompt's own positions; then
        each sequence gets its own cache (its rows of the batch's) and token.
        One prompt alone is ``prefill`` exactly; together, the matrix products
        run over other shapes and can round differently in the last bits.
        ``loras[i]``: job ``i``'s adapter, as ``prefill``'s."""
        adapters: list[str | None] = loras if loras is not None else [None] * len(jobs)
        if len(adapters) != len(jobs):
            raise ValueError("prefill_together: jobs and loras differ in length")
        if len(jobs) == 1:
            prompt, media, sampling = jobs[0]
            return self.prefill([prompt], [media], [sampling], loras=adapters)
        slots = [self._loras.slot(name) for name in adapters]
        from stages.torch_engine.prefill_together import padded_forward, padded_groups

        if any(not m.encoded for _, media, _ in jobs for m in media):
            raise MediaNotEncoded("prompts prefilled together look up no cached prefix: each medium needs encoding")
        prepared = [self._prepare(prompt, media, []) for prompt, media, _ in jobs]
        out: list[tuple[Sequence, int] | None] = [None] * len(jobs)
        with self._lock, torch.inference_mode():
            for group in padded_groups([len(ids) for ids, _, _ in prepared]):
                embeds = [self.family.embed_prompt(self.model, prepared[i][0], jobs[i][1]) for i in group]
                positions = [prepared[i][1] for i in group]
                with self._loras.for_rows([slots[i] for i in group], self.device):
                    logits, caches = padded_forward(self.model, self.family, embeds, positions)
                for i, row, cache in zip(group, logits, caches, strict=True):
                    ids, _, delta = prepared[i]
                    seq = Sequence(
                        prompt_len=len(ids), output_ids=[], sampling=jobs[i][2], rope_delta=delta, cache=cache
                    )
                    self._with_lora(seq, adapters[i])
                    out[i] = (seq, self._select(seq, row))
        return [o for o in out if o is not None]

    def _prepare(
        self, prompt: list[int], media: list[MediaEmbedding], emitted: list[int]
    ) -> tuple[list[int], torch.Tensor, int]:
        """The prompt's ids with media expanded, its positions and rope delta (checked)."""
        fam = self.family
        for item in media:
            if fam.num_tokens(item) != item.num_tokens:
                raise InvalidRequest(
                    f"{item.kind.value} grid {item.grid_thw} does not match {item.num_tokens} embeddings"
                )
        try:
            ids = self._expanded(prompt, media).ids
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        # The prompt's ids, not the expanded ones: placeholders are in the vocabulary.
        if any(t and (min(t) < 0 or max(t) >= fam.vocab_size) for t in (prompt, emitted)):
            raise InvalidRequest(f"token id outside the vocabulary (size {fam.vocab_size})")
        if len(ids) + len(emitted) >= self.max_model_len:
            raise ContextLengthExceeded(
                f"prompt of {len(ids)} tokens (media expanded) plus {len(emitted)} resumed tokens leaves no room "
                f"in the model's context of {self.max_model_len}"
            )
        positions, delta = fam.prompt_positions(ids, media)
        return ids, positions, delta

    def _sized(self, tokens: int, rows: int, pairs: int, places: int) -> contextlib.AbstractContextManager[None]:
        """On a CPU, a call of ``tokens`` through the layers, ``rows``
        through the LM head and ``pairs`` attended over a context of
        ``places`` (the longest): on one thread where it is small
        (``compute_threads.sized``)."""
        if self.device.type != "cpu" or places > compute_threads.SMALL_CALL_PLACES:
            return contextlib.nullcontext()
        return compute_threads.sized(self._flops(tokens, rows, pairs))

    def _flops(self, tokens: int, rows: int, pairs: int) -> float:
        return tokens * self._flops_token + rows * self._flops_row + pairs * self._flops_pair

    def small_prefill(self, places: int) -> bool:
        """Whether the prefill of a prompt of ``places`` (media expanded),
        none of them cached, is a small call (``_sized``): on a CPU, one
        core's work, brief enough to run on its caller's thread
        (``EngineThread.call_or_release``'s ``small``)."""
        return (
            self.device.type == "cpu"
            and places <= compute_threads.SMALL_CALL_PLACES
            and self._flops(places, 1, places * places) < compute_threads.SMALL_CALL_FLOPS
        )

    def _sized_step(self, seqs: list[Sequence], chunk: Prefilling | None) -> contextlib.AbstractContextManager[None]:
        """A decode step of ``seqs`` as ``_sized`` sizes it (with a prompt's
        chunk riding it: as large)."""
        if chunk is not None or self.device.type != "cpu":
            return contextlib.nullcontext()  # off a CPU, no per-step work for it
        lengths = [seq.length for seq in seqs]
        return self._sized(len(seqs), len(seqs), sum(lengths), max(lengths, default=0))

    def _prefill_one(
        self,
        prompt: list[int],
        media: list[MediaEmbedding],
        sampling: SamplingConfig,
        emitted: list[int],
        defer: bool = False,
        given: torch.Tensor | None = None,
        lora: str | None = None,
    ) -> tuple[Sequence, int]:
        fam = self.family
        slot = self._loras.slot(lora)
        ids, positions, delta = self._prepare(prompt, media, emitted)
        if given is not None and (given.dim() != 2 or given.shape[0] != len(ids)):
            raise InvalidRequest(f"prompt embeddings of shape {list(given.shape)} for a prompt of {len(ids)} places")
        # Embeddings given have no ids to key a cached prefix by.
        keys = self._keys(prompt, media, self._loras.salt(lora)) if not emitted and given is None else []
        needed = self._not_encoded_end(prompt, media)
        with self._lock, torch.inference_mode(), contextlib.ExitStack() as sized:
            embeds = (
                fam.embed_prompt(self.model, ids, media)
                if given is None
                else to_device(given, self.device, self.dtype)[None]
            )
            hit = self._cached_prefix(keys, len(ids))
            if len(hit) * self.block_size < needed:
                if hit and self.decoder is not None:
                    self.decoder.pool.free(hit)
                raise MediaNotEncoded(f"the cached prefix no longer holds the first {needed} tokens")
            cached = len(hit) * self.block_size
            # From here to its token: on one thread where the part not cached is small.
            sized.enter_context(self._sized(len(ids) - cached, 1, (len(ids) - cached) * len(ids), len(ids)))
            if not emitted:
                slotted = self._prefill_into_slot(
                    embeds, positions, len(ids), sampling, delta, defer, keys, ids, hit, slot
                )
                if slotted is not None:
                    self._with_lora(slotted[0], lora)
                    return slotted
            # Past a cached prefix (``hit``'s blocks, held), the rest through the
            # model's modules, attending over the prefix's keys and values read
            # from the pool: the same computation over fewer rows, whose last
            # bits may differ from one whole pass's.
            try:
                with self._loras.for_rows([slot], self.device):
                    logits, cache = fam.forward(
                        self.model, positions[..., cached:], self._past(hit), inputs_embeds=embeds[:, cached:]
                    )
            except BaseException:
                if hit and self.decoder is not None:
                    self.decoder.pool.free(hit)
                raise
            seq = Sequence(
                prompt_len=len(ids),
                output_ids=[],
                sampling=sampling,
                rope_delta=delta,
                cache=cache,
                blocks=hit,
                prefix_keys=keys,
                prefix_ids=ids,
                cached_tokens=cached,
            )
            self._with_lora(seq, lora)
            if not emitted:
                return seq, self._select(seq, logits, defer)
            return seq, self._continue(seq, logits, emitted)

    # -- prefix caching ---------------------------------------------------

    def prefix_cached(self, prompt: list[int], media: list[MediaEmbedding], lora: str | None = None) -> int:
        """How many of the prompt's tokens (media expanded) the prefix cache
        holds now: a look that holds nothing (the blocks can go before a
        prefill takes them).

        Off the engine's thread and lock (under load a look waited there
        behind steps and prefills): it reads the pool's maps while a step
        may change them, which can only make the answer stale, and a stale
        answer is advice that prefill checks again."""
        decoder = self.decoder
        if not self.prefix_caching or decoder is None:
            return 0
        if lora is not None and lora not in self._loras.slots:
            return 0  # its prefill fails: nothing to reuse
        try:
            expanded = self._expanded(prompt, media)
        except ValueError:
            return 0  # prefill refuses it, with the reason
        keys = self._keys(prompt, media, self._loras.salt(lora))
        return len(decoder.pool.cached(keys[: (len(expanded.ids) - 1) // self.block_size])) * self.block_size

    def prefix_covers(self, prompt: list[int], media: list[MediaEmbedding], lora: str | None = None) -> bool:
        """Whether the prefix the prompt finds cached now holds every media
        item's tokens (``media``: their digests and sizes, not yet encoded),
        so prefill would compute none of them (``prefix_cached``'s look)."""
        if not media:
            return False
        end = _media_end(prompt, media, set(self.family.placeholder_ids.values()))
        return self.prefix_cached(prompt, media, lora) >= end

    def _not_encoded_end(self, prompt: list[int], media: list[MediaEmbedding]) -> int:
        """Where the last item the encoder skipped ends in the expanded
        prompt (0: none skipped): the cached prefix must reach that far."""
        last = max((i for i, m in enumerate(media) if not m.encoded), default=-1)
        if last < 0:
            return 0
        return _media_end(prompt, media[: last + 1], set(self.family.placeholder_ids.values()))

    def _expanded(self, prompt: list[int], media: list[MediaEmbedding]) -> _Expanded:
        """The prompt with its media expanded (ValueError: placeholders and
        items do not match), and its blocks' keys once asked for, kept for
        the last few prompts: a later turn's prompt is expanded and keyed by
        the encoder's look at the prefix, the hop's and prefill's own, each
        the same 1,600 tokens (1.2 ms of a cached turn's 7 on 2 vCPUs)."""
        key = (tuple(prompt), tuple((m.kind, m.num_tokens, m.digest) for m in media))
        with self._expansions_lock:
            found = self._expansions.get(key)
        if found is not None:
            return found
        found = _Expanded(self.family.expand_placeholders(prompt, media))
        with self._expansions_lock:
            if len(self._expansions) >= _EXPANSIONS_KEPT:
                del self._expansions[next(iter(self._expansions))]
            self._expansions[key] = found
        return found

    def _keys(self, prompt: list[int], media: list[MediaEmbedding], salt: str | None) -> list[int]:
        """``_prefix_keys`` of the prompt, through ``_expanded``'s memory."""
        expanded = self._expanded(prompt, media)
        keys = expanded.keys.get(salt)
        if keys is None:
            keys = expanded.keys[salt] = self._prefix_keys(prompt, expanded.ids, media, salt)
        return keys

    def _prefix_keys(
        self, prompt: list[int], ids: list[int], media: list[MediaEmbedding], salt: str | None = None
    ) -> list[int]:
        """The content keys of the expanded prompt's full blocks, up to the
        first media item whose content is unknown (no digest: its blocks
        could not be told from another item's). ``salt``: a LoRA adapter's,
        in the first block's key and so in every key after: blocks computed
        through an adapter are shared only with prompts of the same adapter
        (and its same weights), never with the model alone's."""
        if not self.prefix_caching or self._slots is None:
            return []
        spans: list[MediaSpan] = []
        placeholders = set(self.family.placeholder_ids.values())
        at, item = 0, 0
        for token in prompt:
            if token not in placeholders:
                at += 1
                continue
            m = media[item]
            if not m.digest:
                ids = ids[: at - at % self.block_size]
                break
            spans.append(MediaSpan(at, m.num_tokens, m.digest))
            at += m.num_tokens
            item += 1
        return block_keys(ids, self.block_size, spans, salt)

    def _cached_prefix(self, keys: list[int], length: int) -> list[int]:
        """The pool's blocks holding the longest cached run of ``keys``, held
        for the caller; at least the prompt's last token is left to prefill
        (its logits give the first token)."""
        if not self.prefix_caching or self.decoder is None:
            return []
        # Every prompt counts as looked up, as vLLM counts them (one shorter than a block has no key).
        metrics.PREFIX_QUERIES.inc(length)
        if not keys:
            return []
        pool = self.decoder.pool
        hit = pool.cached(keys[: (length - 1) // self.block_size])
        metrics.PREFIX_HITS.inc(len(hit) * self.block_size)
        pool.share(hit)
        return hit

    def _past(self, hit: list[int]) -> Any:
        """A cache holding ``hit``'s blocks' keys and values (None: no blocks)."""
        if not hit:
            return None
        from transformers import DynamicCache

        assert self.decoder is not None
        cached = len(hit) * self.block_size
        return DynamicCache(
            ddp_cache_data=[
                (from_blocks(k, cached)[None], from_blocks(v, cached)[None]) for k, v in self.decoder.read(hit)
            ]
        )

    def reset_prefix_cache(self) -> int | None:
        """Forget every cached prefix (running sequences keep their blocks);
        returns how many blocks were cached (None: this engine holds no KV
        pool, so no prefix cache)."""
        if self.decoder is None:
            return None
        with self._lock:
            cleared = self.decoder.pool.reset()
        log.info("prefix_cache_reset", blocks=cleared)
        return cleared

    # -- sleep and wake (vLLM's: lend the device's memory back) --------------

    def held_bytes(self) -> dict[str, int]:
        """Bytes this engine holds on its device: the model's weights there,
        and the KV pool's (what ``sleep`` gives back)."""
        weights = 0
        if self.model is not None:
            weights = sum(
                p.numel() * p.element_size() for p in self.model.parameters() if p.device.type == self.device.type
            )
        return {"weights": weights, "kv_cache": self.decoder.nbytes if self.decoder is not None else 0}

    @property
    def holding(self) -> int:
        """Sequences that hold rows of the batch decoder (or blocks of its pool awaiting a row)."""
        return 0 if self._slots is None else self._slots.taken

    def sleep(self, level: int) -> dict[str, int]:
        """Give the device's memory back, as vLLM's sleep mode: level 1 frees
        the KV pool (its cached prefixes forgotten; its graphs with it) and
        moves the weights to host memory; level 2 drops the weights too
        (``wake_up`` reloads them from the checkpoint). No sequence may hold
        the pool. Returns ``held_bytes`` as they were."""
        if level not in (1, 2):
            raise ValueError(f"sleep level {level}: 1 (weights to host memory) or 2 (weights dropped)")
        if self.sleeping:
            raise RuntimeError(f"the engine sleeps already (level {self.sleeping})")
        held = self.held_bytes()
        with self._lock:
            if self._slots is not None and len(self._slots):
                raise RuntimeError(f"{len(self._slots)} sequences still hold the KV cache")
            if self.decoder is not None:
                self.decoder.pool.reset()  # the router hears the prefixes went (AllBlocksCleared)
                self._pool_log = self.decoder.pool.log
            self.decoder, self._slot_prefill, self._slots = None, None, None
            # The tower's graphs hold their memory pools (and level 2's weights): made again on waking.
            self.family.tower_graphs = TowerGraphs(0)
            if level == 2:
                self.model = None
                self._loras.forget_model()
            elif self.device.type != "cpu":
                self.model = self.model.to("cpu")
            self.sleeping = level
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        log.info("engine_asleep", level=level, freed_bytes=sum(held.values()) - sum(self.held_bytes().values()))
        return held

    def wake_up(self) -> None:
        """Back from ``sleep``: the weights on the device again (reloaded
        from the checkpoint after level 2), a new KV pool and its graphs."""
        if not self.sleeping:
            return
        started = time.monotonic()
        with self._lock:
            if self.model is None:
                with contextlib.nullcontext() if on_terminal() else no_transformers_bars():
                    model: Any = self.family.model_class.from_pretrained(str(self.model_dir), dtype=self.dtype)
                self.model = model.eval()
            self.model = self.model.to(self.device)
            if self._loras.adapters:
                # A reloaded model has none of the wrappers; kept on the host, they go on again.
                self._loras.apply(self.model)
            self.family.on_loaded(self.model, self.device, self.dtype)
            decode = self._decode_settings
            if self.device.type == "cuda":
                # Graphs and compiled code of the tower were made over the weights as they were.
                self.family.tower_graphs = TowerGraphs(decode.tower_graphs)
                if decode.torch_compile and decode.encodes:
                    self.family.compile_tower(self.model)
            self._build_decoder(decode)
            if self.decoder is not None:
                self.decoder.pool.log = self._pool_log
            self.sleeping = 0
        log.info("engine_awake", seconds=round(time.monotonic() - started, 2), **self.held_bytes())

    def _register_prefix(self, seq: Sequence) -> None:
        """Its prompt's full blocks are computed: cached under their keys
        (and each run of blocks newly cached told as one BlockStored)."""
        if seq.prefix_keys and self.decoder is not None:
            pool, keys = self.decoder.pool, seq.prefix_keys
            new = [i for i, (block, key) in enumerate(zip(seq.blocks, keys, strict=False)) if pool.register(block, key)]
            if pool.log is not None:
                size = self.block_size
                for first, last in _runs(new):
                    parent = keys[first - 1] if first else None
                    pool.log.stored(keys[first : last + 1], parent, seq.prefix_ids[first * size : (last + 1) * size])
        seq.prefix_keys, seq.prefix_ids = [], []

    def _prefill_into_slot(
        self,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        length: int,
        sampling: SamplingConfig,
        delta: int,
        defer: bool = False,
        keys: list[int] | None = None,
        ids: list[int] | None = None,
        hit: list[int] | None = None,
        lora: int = 0,
    ) -> tuple[Sequence, int] | None:
        """The graphed prefill straight into the batch decoder's blocks, where
        the prompt (past a cached prefix: ``hit``'s blocks, held, which the
        sequence then holds) fits a graph and the sequence the pool (else
        None: the modules, the prefix still held). ``lora``: its adapter's slot."""
        prefill, slots = self._slot_prefill, self._slots
        held = list(hit or [])
        cached = len(held) * self.block_size
        seq = Sequence(
            prompt_len=length,
            output_ids=[],
            sampling=sampling,
            rope_delta=delta,
            cache=None,
            blocks=held,
            cached_tokens=cached,
        )
        if prefill is None or slots is None or not prefill.fits(length - cached) or not self._ever_fits(seq):
            return None
        if held and not prefill.past:
            return None
        if not slots.can_take(length, self._spare(), held=held):
            return None
        slots.take(seq, length)
        try:
            with self._loras.for_step(prefill.lora_slot, [lora], prefill.use_graphs):
                logits = prefill.run(embeds[0, cached:], positions[..., cached:], seq.blocks, start=cached, lora=lora)
        except BaseException:
            slots.free(seq)
            raise
        # Queued on the stream before any later prefill or step that reads them.
        seq.prefix_keys, seq.prefix_ids = keys or [], ids or []
        self._register_prefix(seq)
        return seq, self._select(seq, logits, defer)

    def _continue(self, seq: Sequence, logits: torch.Tensor, emitted: list[int]) -> int:
        # Emitted tokens go in one decode step each, not as one chunk: the
        # state, and the token selected after them, are then bit-identical
        # to the uninterrupted run's.
        for tok in emitted:
            seq.output_ids.append(tok)
            logits = self._decode_forward(seq)
        return self._select(seq, logits)

    def _step_one(self, seq: Sequence) -> int:
        return self._select(seq, self._decode_forward(seq))

    def _decode_forward(self, seq: Sequence) -> torch.Tensor:
        if seq.slot >= 0:
            raise ValueError("a sequence in the batch decoder steps only with the batch")
        # Feed the last token (not yet in the cache); its position is its
        # index shifted by the rope delta, the same in all three M-RoPE rows.
        index = seq.length - 1
        positions = self.family.decode_positions(index + seq.rope_delta)
        input_ids = tensor_on([[seq.output_ids[-1]]], self.device, torch.long)
        with self._loras.for_rows([seq.lora], self.device):
            logits, seq.cache = self.family.forward(self.model, positions, seq.cache, input_ids=input_ids)
        return logits

    def _select_batch(self, seqs: list[Sequence], logits: torch.Tensor, extras: bool) -> dict[int, int]:
        """Tokens of batched sequences (by id): those the step chose (argmax,
        EOS masked until min_tokens as select_token does; with ``extras``
        after their penalties, with their logprobs) read in one device sync
        for them all; the others chosen on the host."""
        assert self.decoder is not None
        stepped = [q for q in seqs if self._in_batch(q)]
        chosen: dict[int, int] = {}
        if stepped:
            rows = logits.shape[0]
            # With extras, the tokens and reports in one sync; else the tokens alone, as ever.
            got = Launched(self.decoder.sampled, rows, reports=self.decoder.row_sampling) if extras else None
            sampled = got.tokens() if got is not None else self.decoder.sampled[:rows].tolist()
            for q in stepped:
                if q.sampling.logprobs is not None:
                    assert got is not None  # a row that asks for logprobs makes the step one with extras
                    q.logprobs[q.num_generated] = got.logprobs(q.slot, q.sampling.logprobs)
                q.output_ids.append(sampled[q.slot])
                chosen[id(q)] = sampled[q.slot]
        if structured := [q for q in seqs if q.sampling.structured is not None]:
            # Every structured row's mask in one call on the step's logits.
            self._mask(logits, [(q, q.slot) for q in structured])
        for q in seqs:
            if id(q) not in chosen:
                chosen[id(q)] = self._select(q, logits[q.slot], masked=True)
        return chosen

    def _mask(self, logits: torch.Tensor, rows: list[tuple[Sequence, int]]) -> None:
        """The tokens each row's grammar does not allow next, at -inf in place."""
        if self._grammars is None:
            self._grammars = Grammars(self.tokenizer, logits.shape[-1], self.eos_token_ids)
        grammars = self._grammars
        states = []
        for seq, row in rows:
            if seq.grammar is None:
                assert seq.sampling.structured is not None
                seq.grammar = grammars.state(seq.sampling.structured)
            states.append((seq.grammar, seq.output_ids, row))
        grammars.mask(logits, states)

    def _select(self, seq: Sequence, logits: torch.Tensor, defer: bool = False, masked: bool = False) -> int:
        if not seq.output_ids and seq.prompt_logits is None:
            # The prefill's: what a choice of the same prompt forks from
            # (``fork``). A copy on a GPU: a graphed prefill's output is
            # overwritten by the next. A CPU's are the forward's own (0.3 ms a
            # prefill to copy a 151,936-token row on two cores).
            seq.prompt_logits = logits.detach() if logits.device.type == "cpu" else logits.detach().clone()
        if defer and logits.is_cuda and seq.sampling.on_device and not seq.output_ids:
            chosen = greedy_choice(logits.float(), seq.sampling, seq.num_generated, self._eos_tensor)
            seq.pending = Launched(chosen.reshape(1), 1, blocking=True)
            if seq.slot >= 0 and self.decoder is not None:
                # A step can take it before the host has its token (``launch``): fed from a cell.
                seq.feed_row = self.decoder.hold_first(chosen)
            return -1
        if seq.sampling.structured is not None and not masked:
            logits = logits.float().clone()[None]
            self._mask(logits, [(seq, 0)])
            logits = logits[0]
        token = select_token(logits.float(), seq.sampling, seq.num_generated, self._eos_tensor, seq.output_ids)
        if seq.sampling.logprobs is not None:
            seq.logprobs[seq.num_generated] = token_logprobs(logits, token, seq.sampling.logprobs)
        seq.output_ids.append(token)
        return token


# Prompt tokens whose logits one slice of ``prompt_logprobs`` holds at once.
_PROMPT_LOGPROBS_SLICE = 512

# Prompts whose expansion and keys ``_expanded`` keeps (a hit's three looks
# come one after another; prompts prefilled together, a batch of them).
_EXPANSIONS_KEPT = 16


@dataclass(eq=False)
class _Expanded:
    """A prompt with its media expanded, and its blocks' keys by LoRA salt.
    Shared by every caller: never changed in place."""

    ids: list[int]
    keys: dict[str | None, list[int]] = field(default_factory=dict)


def _drop_prompt_logits(seqs: list[Sequence]) -> None:
    # A sequence steps past its prefill: its logits go, but where a fork waits for them.
    for seq in seqs:
        if not seq.forkable:
            seq.prompt_logits = None


class MediaNotEncoded(Exception):
    """A prompt whose media the encoder skipped (their tokens were cached)
    finds them cached no longer: encode them and prefill again."""


def _media_end(prompt: list[int], media: list[MediaEmbedding], placeholders: set[int]) -> int:
    """Where the expanded prompt's ``len(media)``-th media item ends."""
    at = item = 0
    for token in prompt:
        if item == len(media):
            break
        if token in placeholders:
            at += media[item].num_tokens
            item += 1
        else:
            at += 1
    return at


@dataclass(eq=False)
class Prefilling:
    """A prompt part way through a chunked prefill (``TorchEngine.start_prefill``)."""

    length: int
    positions: torch.Tensor
    delta: int
    embeds: Any
    sampling: SamplingConfig
    cache: Any = None
    # Positions of the prompt in the cache so far.
    done: int = 0
    # Content keys of its full blocks (prefix caching), and the ids they cover.
    keys: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    # Its LoRA adapter's name (None: none).
    lora: str | None = None
    # Whether its chunks go straight into blocks of the pool (None: not decided
    # until its first chunk), the blocks they fill, and how many of its
    # positions a cached prefix gave.
    into_blocks: bool | None = None
    blocks: list[int] | None = None
    cached: int = 0

    def sequence(self, cache: Any = None) -> Sequence:
        """Its sequence once its last chunk is done: its cache the chunks'
        (``cache``, the modules'), or in its blocks."""
        return Sequence(
            prompt_len=self.length,
            output_ids=[],
            sampling=self.sampling,
            rope_delta=self.delta,
            cache=cache,
            blocks=list(self.blocks or []),
            cached_tokens=self.cached,
            prefix_keys=self.keys,
            prefix_ids=self.ids,
        )


def _runs(indices: list[int]) -> list[tuple[int, int]]:
    """Runs of consecutive ``indices`` (ascending), as (first, last) pairs."""
    runs: list[tuple[int, int]] = []
    for i in indices:
        if runs and runs[-1][1] == i - 1:
            runs[-1] = (runs[-1][0], i)
        else:
            runs.append((i, i))
    return runs


def _budget(seq: Sequence) -> int:
    """Positions ``seq`` can come to write: its prompt and every token it
    may make (a step launched past its last token writes the last one): a
    sequence the decoder could never hold to its end steps on its own."""
    return seq.prompt_len + seq.sampling.max_tokens


def _cached(state: KvState) -> int:
    """Positions a handed-off cache holds (its last token is not in it yet)."""
    return state.prompt_len + len(state.output_ids) - 1


def _free_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    import os

    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def checkpoint_eos_ids(model_dir: Path, config: Any) -> frozenset[int]:
    """The EOS ids ``_eos_ids`` finds, from a checkpoint's generation config
    read alone (an engine that does not load the model here: vLLM, SGLang)."""
    from transformers import GenerationConfig

    try:
        generation: Any = GenerationConfig.from_pretrained(str(model_dir))
    except OSError:
        generation = None
    return frozenset(_eos_ids(SimpleNamespace(generation_config=generation), config))


def _eos_ids(model: Any, config: Any) -> set[int]:
    # generate() stops on (and MinNewTokens masks) the generation config's
    # EOS list; the model config's single id is only a fallback.
    for source in (getattr(model, "generation_config", None), config.get_text_config(), config):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            return {value}
        if isinstance(value, (list, tuple)) and value:
            return {int(v) for v in value}
    return set()


def _call_flops(model: Any, config: Any) -> tuple[float, float, float]:
    """Floating-point operations of a new token through the language model's
    layers, of a row through its LM head, and of a token attending to one
    place (every layer's scores and values). A model whose decoder is not
    found counts all its weights a token: every call large."""
    head = model.get_output_embeddings()
    row = float(head.weight.numel()) if head is not None else 0.0
    text = getattr(config, "text_config", None) or config
    hidden = getattr(text, "hidden_size", None) or (head.weight.shape[1] if head is not None else 0)
    layers = getattr(text, "num_hidden_layers", None) or 0
    try:
        decoder = model.get_decoder()
        lookup = decoder.get_input_embeddings()
        token = float(sum(p.numel() for p in decoder.parameters()) - (lookup.weight.numel() if lookup else 0))
    except (AttributeError, NotImplementedError):
        token = float(sum(p.numel() for p in model.parameters()))
    return 2.0 * token, 2.0 * row, 4.0 * layers * hidden
