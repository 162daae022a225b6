"""Batched decode over a paged KV cache, optionally as CUDA graphs.

The per-sequence path (``TorchEngine._decode_forward``) runs the Hugging Face
model on one sequence's DynamicCache: one forward per token per sequence,
each a few hundred small kernel launches. Here every running sequence
advances in one forward: keys and values live in fixed-size blocks of one
pool ``[layers, blocks, kv_heads, block_size, head_dim]``, each sequence
holds a list of blocks (its row of ``tables``, the block tables), the new
token of each row is written at its own position through its table, and
attention reads each row's prefix through it (stages/torch_engine/block_pool.py
says which blocks are free). Memory goes to the tokens sequences hold, not
to a fixed slot per sequence. Shapes are fixed per batch bucket (and, for
the masked attention, length bucket), so on CUDA each step replays a
captured graph: launch overhead goes, what is left is reading the weights
and the KV cache.

The layers are the model's own modules (norms, projections, MLP), called
on a batch of rows; only attention over the cache and the rotary embedding
are written here, the way the decoder-only families compute them (Qwen2,
Llama; Qwen-VL's M-RoPE is plain RoPE once every position row is the same,
as it is for every token after the prompt).

Running sequences stay packed in rows ``0..n-1``: a step runs rows
``0..bucket-1``; a finished sequence's row is refilled with the last one
(its block table moves, not its cache).

Greedy tokens are chosen inside the step (argmax, EOS masked below a
request's min_tokens), and a row's input token can come from the previous
step's choice on the device (``feed``): the next step can be queued before
the host has read the last one's tokens (``launch``), so the GPU does not
wait on the host between steps, as vLLM's async scheduling.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from stages import cuda_graph
from stages.progress import counted
from stages.sampling import Logprobs, SamplingConfig
from stages.torch_engine.block_pool import NULL_BLOCK, BlockPool, blocks_for
from stages.torch_engine.decode_attention import gather_blocks, length_mask
from stages.torch_engine.fused_decode import (
    FusedKernels,
    FusedLayer,
    can_fuse,
    default_attention,
    fuse_layer,
    project_out,
)
from stages.torch_engine.fused_lora import NO_LORA, LayerLora
from stages.torch_engine.row_sampling import MAX_TOP, RowSampling
from stages.torch_engine.sampling import best_index

# Batch sizes a step is padded up to (each a captured graph on CUDA).
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
# Sequences of the longest length the pool holds when its memory is not given.
DEFAULT_POOL_SEQUENCES = 32
# The masked attention reads the cache up to the next multiple of this (at
# least): the padding is work, each multiple a graph to capture.
LENGTH_QUANTUM = 128
# Tokens per KV block (vLLM's default).
BLOCK_SIZE = 16


class StepInputs(NamedTuple):
    """Per row of a step: its last token (used where ``feed`` < 0), rotary
    position, write position (tokens already in its blocks), the row of the
    previous step's ``sampled`` to take the token from instead (-1: none),
    whether EOS is masked for its choice (min_tokens not reached), whether
    its choice is wanted (1) or the row only rewrites its pending token (0:
    its ``sampled`` entry keeps the fed token), the block the write
    position lies in (the step enters it in the row's table: a sequence's
    table grows with the steps that need a new block), the row's draw
    for this token where it samples (``sampling.draw_key``; else 0), and
    its LoRA adapter's slot (stages/torch_engine/lora.py; 0: none)."""

    tokens: list[int]
    positions: list[int]
    write_at: list[int]
    feed: list[int]
    mask_eos: list[int]
    asked: list[int]
    block: list[int]
    draws: list[int]
    lora: list[int]


class Launched:
    """Token choices queued on the device (a step's, or a prefill's), on
    their way to the host; ``tokens()`` waits for them. ``blocking``: the
    waiting thread sleeps rather than spins (one that is not the engine's).
    ``reports``: a step's logprobs (``RowSampling``), copied beside its tokens."""

    def __init__(
        self, sampled: torch.Tensor, n: int, blocking: bool = False, reports: RowSampling | None = None
    ) -> None:
        pinned = sampled.device.type == "cuda"
        self._host = torch.empty(n, dtype=torch.long, pin_memory=pinned)
        # Queued behind the step and before the next one, which overwrites ``sampled``.
        self._host.copy_(sampled[:n], non_blocking=pinned)
        self._reports: torch.Tensor | None = None
        if reports is not None:
            self._reports = torch.empty((n, reports.reports.shape[1]), pin_memory=pinned)
            self._reports.copy_(reports.reports[:n], non_blocking=pinned)
        self._event = torch.cuda.Event(blocking=blocking) if pinned else None
        if self._event is not None:
            self._event.record()
        # The reports on the host as lists, made once: a row at a time cost a
        # tensor index and a copy each.
        self._report_rows: list[list[float]] | None = None

    def tokens(self) -> list[int]:
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()

    def logprobs(self, row: int, top: int) -> Logprobs:
        """Row ``row``'s chosen token's logprob and the ``top`` best (after ``tokens()``)."""
        assert self._reports is not None, "a step launched without its reports"
        if self._report_rows is None:
            self._report_rows = self._reports.tolist()
        chosen, *rest = self._report_rows[row]
        ids, values = rest[:MAX_TOP][:top], rest[MAX_TOP:][:top]
        return Logprobs(chosen, tuple(zip(map(int, ids), values, strict=True)))


@dataclass
class ChunkRows:
    """A chunk of a long prompt's prefill, carried by a step (a mixed step):
    its rows [T, hidden] beside the step's in each layer's projections,
    their rotary cos and sin [T, 1, d], where each row's key and value go
    (``blocks``, ``offsets`` [T]), each row's adapter slot (None: the decoder
    holds none), and its attention ((q [T, heads, d], layer) → [T, heads *
    d], over the prompt's blocks). ``hidden``: the chunk's last row after
    the final norm, once the step has run (the caller applies the head)."""

    embeds: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    blocks: torch.Tensor
    offsets: torch.Tensor
    slots: torch.Tensor | None
    attend: Callable[[torch.Tensor, int], torch.Tensor]
    hidden: torch.Tensor | None = None


@dataclass(frozen=True)
class DecoderShape:
    layers: int
    heads: int
    kv_heads: int
    head_dim: int


def supports(model: Any) -> bool:
    """Whether the model's language model is a decoder this module can run."""
    lm = _language_model(model)
    if lm is None or not hasattr(lm, "layers") or not hasattr(lm, "rotary_emb"):
        return False
    attn = lm.layers[0].self_attn
    config = lm.config
    plain = getattr(config, "sliding_window", None) is None or not getattr(config, "use_sliding_window", False)
    return all(hasattr(attn, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")) and plain


def _language_model(model: Any) -> Any:
    inner = getattr(model, "model", None)
    return getattr(inner, "language_model", None) or inner


class BatchDecoder:
    """``fused``: the layer step of stages.torch_engine.fused_decode
    (compiled on CUDA) instead of the model's modules; default: on CUDA only.
    ``max_slots``: rows of a step (sequences decoded together); ``max_len``:
    tokens one sequence may hold; ``num_blocks``: the pool's blocks of
    ``block_size`` tokens (default: ``max_slots`` sequences of ``max_len``,
    plus the null block)."""

    def __init__(
        self,
        model: Any,
        max_slots: int,
        max_len: int,
        use_graphs: bool,
        fused: bool | None = None,
        eos_ids: Iterable[int] = (),
        num_blocks: int | None = None,
        block_size: int = BLOCK_SIZE,
        compile: bool = True,
    ) -> None:
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"KV block size {block_size}: a power of two")
        self.model = model
        self.lm = _language_model(model)
        attn = self.lm.layers[0].self_attn
        config = self.lm.config
        self.shape = DecoderShape(
            layers=len(self.lm.layers),
            heads=int(config.num_attention_heads),
            kv_heads=int(config.num_key_value_heads),
            head_dim=int(attn.head_dim),
        )
        self.scaling = float(attn.scaling)
        self.device = next(model.parameters()).device
        self.dtype = next(self.lm.parameters()).dtype
        self.max_slots = max_slots
        self.max_len = max_len
        self.block_size = block_size
        self.blocks_per_seq = blocks_for(max_len, block_size)
        if num_blocks is None:
            # Rows are a cap (vLLM's max_num_seqs, 256): the pool, not the rows, sizes memory.
            num_blocks = min(max_slots, DEFAULT_POOL_SEQUENCES) * self.blocks_per_seq + 1
        self.pool = BlockPool(num_blocks)
        s = self.shape
        size = (s.layers, num_blocks, s.kv_heads, block_size, s.head_dim)
        self.keys = torch.zeros(size, dtype=self.dtype, device=self.device)
        self.values = torch.zeros(size, dtype=self.dtype, device=self.device)
        # Row r's blocks; entries past them (and free rows) are the null block.
        self.tables = torch.full((max_slots, self.blocks_per_seq), NULL_BLOCK, dtype=torch.long, device=self.device)
        rotary = self.lm.rotary_emb
        self.inv_freq = rotary.inv_freq.to(self.device, torch.float32)
        self.attention_scaling = float(getattr(rotary, "attention_scaling", 1.0))
        # Static inputs of a step (graphs read them from these addresses).
        # One tensor, so a step's inputs go to the device in one copy.
        self._inputs = torch.zeros(len(StepInputs._fields), max_slots, dtype=torch.long, device=self.device)
        (
            self.tokens,
            self.positions,
            self.write_at,
            self.feed,
            self.mask_eos,
            self.asked,
            self.block,
            self.draws,
            self.lora,
        ) = self._inputs
        # Each row's chosen token of the last step, where the next step can
        # feed it from; past them, a cell per row for a prefill's token
        # (``hold_first``): a sequence whose prefill's token has not reached
        # the host yet can take a step, fed that token from here.
        self.sampled = torch.zeros(2 * max_slots, dtype=torch.long, device=self.device)
        self._free_cells = list(range(max_slots, 2 * max_slots))
        # Penalties, logit bias and logprobs in the step, made for the first row that asks for them.
        self.row_sampling: RowSampling | None = None
        eos = sorted(set(eos_ids))
        self._eos = torch.tensor(eos, dtype=torch.long, device=self.device) if eos else None
        self.rows = torch.arange(max_slots, device=self.device)
        # The Triton attention's (one per (row, kv head)), zero between its launches.
        self._counters = torch.zeros(max_slots * s.kv_heads, dtype=torch.int32, device=self.device)
        self.use_graphs = use_graphs and self.device.type == "cuda"
        self._graphs: dict[tuple[int, int, bool, bool], tuple[Any, torch.Tensor]] = {}
        fused = self.device.type == "cuda" if fused is None else fused
        # The step's penalties and logprobs compiled where the fused step is.
        self._compile_extras = compile and self.device.type == "cuda" and (fused is None or fused)
        self.fused: list[FusedLayer] | None = None
        # The loaded LoRA adapters as the fused step takes them, by layer
        # (stages/torch_engine/fused_lora.py; None: no adapter loaded).
        self.adapters: list[LayerLora] | None = None
        if fused and all(can_fuse(layer) for layer in self.lm.layers) and hasattr(self.lm.norm, "variance_epsilon"):
            self.fused = [fuse_layer(layer) for layer in self.lm.layers]
            self.kernels = FusedKernels(
                compile=compile and self.device.type == "cuda",
                attention=default_attention(self.device, self.dtype, self.shape.head_dim),
            )

    @property
    def nbytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()

    @property
    def bytes_per_block(self) -> int:
        return self.nbytes // self.pool.num_blocks

    def blocks_for(self, tokens: int) -> int:
        return blocks_for(tokens, self.block_size)

    # -- block tables -----------------------------------------------------------

    def table_row(self, blocks: list[int]) -> torch.Tensor:
        """A block table on the host: ``blocks``, then the null block."""
        return torch.tensor(blocks + [NULL_BLOCK] * (self.blocks_per_seq - len(blocks)), dtype=torch.long)

    def set_table(self, row: int, blocks: list[int]) -> None:
        """Row ``row`` reads and writes ``blocks`` (queued in stream order)."""
        self.tables[row].copy_(self.table_row(blocks), non_blocking=True)

    def move_row(self, src: int, dst: int) -> None:
        """Row ``src``'s sequence continues in row ``dst`` (keeps running rows
        packed); ``src`` is left free, its table the null block's."""
        self.tables[dst].copy_(self.tables[src])
        self.tables[src].fill_(NULL_BLOCK)
        if self.row_sampling is not None:
            self.row_sampling.move_row(src, dst)

    def set_sampling(self, row: int, config: SamplingConfig, counted: list[int]) -> None:
        """Row ``row``'s request's penalties, bias and sampling, where it has
        any or rows with them have run (``counted``: its generated tokens the steps
        will not feed; see ``RowSampling.set_row``)."""
        if self.row_sampling is None and (config.adjusts or config.logprobs is not None or not config.greedy):
            self._make_row_sampling()
        if self.row_sampling is not None:
            self.row_sampling.set_row(row, config, counted)

    def _make_row_sampling(self) -> None:
        if self.row_sampling is None:
            vocab = int(self.model.get_output_embeddings().weight.shape[0])
            eos = [] if self._eos is None else self._eos.tolist()
            self.row_sampling = RowSampling(self.max_slots, vocab, self.device, eos, self._compile_extras)

    def hold_first(self, token: torch.Tensor) -> int:
        """A prefill's token (one, on the device) kept for a step to feed:
        the ``feed`` index that reads it (-1: no cell free). A cell is the
        sequence's until ``free_first``: rows move, cells do not, so a later
        prefill never writes over a token a step has yet to read."""
        if not self._free_cells:
            return -1
        cell = self._free_cells.pop()
        self.sampled[cell : cell + 1].copy_(token.reshape(1))
        return cell

    def is_cell(self, feed: int) -> bool:
        return feed >= self.max_slots

    def free_first(self, feed: int) -> None:
        """A cell ``hold_first`` gave back (a step launched after now that
        reads it runs after every one queued before: stream order)."""
        if self.is_cell(feed):
            self._free_cells.append(feed)

    def clear_row(self, row: int) -> None:
        self.tables[row].fill_(NULL_BLOCK)

    # -- a sequence's cache -----------------------------------------------------

    def _index(self, blocks: list[int]) -> torch.Tensor:
        return torch.tensor(blocks, dtype=torch.long, device=self.device)

    def load(self, blocks: list[int], layers: list[tuple[torch.Tensor, torch.Tensor]], skip: int = 0) -> None:
        """Copy one sequence's cache (per layer [1, kv_heads, length, head_dim])
        into the first of ``blocks`` it fills, but for its first ``skip``
        blocks (a cached prefix's, there already)."""
        length = layers[0][0].shape[2]
        index = self._index(blocks[skip : self.blocks_for(length)])
        if not len(index):
            return
        start = skip * self.block_size
        for i, (k, v) in enumerate(layers):
            self.keys[i].index_copy_(0, index, to_blocks(k[0, :, start:], self.block_size).to(self.dtype))
            self.values[i].index_copy_(0, index, to_blocks(v[0, :, start:], self.block_size).to(self.dtype))

    def read(self, blocks: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of ``blocks``, per layer keys and values [len(blocks), kv_heads, block_size, head_dim]."""
        index = self._index(blocks)
        return [
            (self.keys[i].index_select(0, index), self.values[i].index_select(0, index))
            for i in range(self.shape.layers)
        ]

    def to_host(self, blocks: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of ``blocks`` in host memory (pinned, queued in stream order
        on a GPU: the blocks may be reused by what is queued after)."""
        index = self._index(blocks)
        pinned = self.device.type == "cuda"
        out = []
        for i in range(self.shape.layers):
            pair = []
            for pool in (self.keys[i], self.values[i]):
                host = torch.empty((len(blocks), *pool.shape[1:]), dtype=self.dtype, pin_memory=pinned)
                host.copy_(pool.index_select(0, index), non_blocking=pinned)
                pair.append(host)
            out.append((pair[0], pair[1]))
        return out

    def from_host(self, blocks: list[int], host: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """``to_host``'s copies into ``blocks`` (as many)."""
        index = self._index(blocks)
        pinned = self.device.type == "cuda"
        for i, (k, v) in enumerate(host):
            self.keys[i].index_copy_(0, index, k.to(self.device, non_blocking=pinned))
            self.values[i].index_copy_(0, index, v.to(self.device, non_blocking=pinned))

    def block_views(self, blocks: list[int]) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
        """Per layer, the views [kv_heads, block_size, head_dim] of each of
        ``blocks``' keys and values: where a sequence's cache can be written
        in place."""
        return [
            ([self.keys[i, b] for b in blocks], [self.values[i, b] for b in blocks]) for i in range(self.shape.layers)
        ]

    # -- a step ---------------------------------------------------------------

    @torch.inference_mode()
    def step(
        self,
        tokens: list[int],
        positions: list[int],
        lengths: list[int],
        feed: list[int] | None = None,
        mask_eos: list[int] | None = None,
        asked: list[int] | None = None,
        block: list[int] | None = None,
        draws: list[int] | None = None,
        lora: list[int] | None = None,
        extras: bool = False,
        samples: bool = False,
        chunk: ChunkRows | None = None,
    ) -> torch.Tensor:
        """Logits [n, vocab] of one new token for slots 0..n-1; their greedy
        choices land in ``sampled[:n]``.

        ``tokens[i]`` is row i's last token (not yet in its cache),
        ``positions[i]`` its rotary position and ``lengths[i]`` the number of
        tokens already in its blocks (where the new one is written, through
        its block table). The rest as ``StepInputs`` (default: no feed, no
        EOS mask, every row asked, each write in the block its table has).
        ``extras``: the rows' penalties, bias and logprobs too (``row_sampling``);
        ``samples``: and rows that sample draw their tokens (implies ``extras``).
        ``chunk``: a prompt chunk's rows to run in the same forward (the
        fused step only, without a graph): each layer's weights are read
        once for both, where a chunk between two steps read them twice and
        held the running rows' next token for the chunk's whole forward.
        """
        if chunk is not None and self.fused is None:
            raise ValueError("a chunk in a step needs the fused layers")
        n = len(tokens)
        if n > self.max_slots:
            raise ValueError(f"{n} sequences for {self.max_slots} slots")
        if max(lengths) + 1 > self.max_len:
            raise ValueError(f"a sequence of {max(lengths) + 1} tokens; the decoder holds {self.max_len}")
        bucket = _bucket(n, self.max_slots)
        if self.fused is not None and not self.kernels.masked:
            span = 0  # attention reads each row's own length: one graph per bucket
        else:
            quantum = max(LENGTH_QUANTUM, self.block_size)
            span = min(self.blocks_per_seq * self.block_size, -(-(max(lengths) + 1) // quantum) * quantum)
        pad = bucket - n
        # Padding rows (free: their tables are the null block's) write position 0 of it and read only it.
        zeros = [0] * pad
        rows = [
            tokens + zeros,
            positions + zeros,
            lengths + zeros,
            (feed or [-1] * n) + [-1] * pad,
            (mask_eos or [0] * n) + zeros,
            (asked or [1] * n) + zeros,
            (block or [-1] * n) + [NULL_BLOCK] * pad,
            (draws or [0] * n) + zeros,
            (lora or [0] * n) + zeros,
        ]
        self._inputs[:, :bucket].copy_(torch.tensor(rows), non_blocking=True)
        extras = extras or samples
        if extras and self.row_sampling is None:
            raise ValueError("a step with extras before any row asked for them")
        if chunk is not None:
            return self._forward_fused(bucket, span, extras, samples, chunk)[:n]
        if not self.use_graphs:
            return self._forward(bucket, span, extras, samples)[:n]
        graph, out = self._graph(bucket, span, extras, samples)
        graph.replay()
        return out[:n]

    def launch(
        self, inputs: StepInputs, extras: bool = False, samples: bool = False, chunk: ChunkRows | None = None
    ) -> Launched:
        """Queue a step (with ``chunk``: a mixed one, as ``step``); its tokens
        are read later (the next step may be queued first)."""
        self.step(*inputs, extras=extras, samples=samples, chunk=chunk)
        return Launched(self.sampled, len(inputs.tokens), reports=self.row_sampling if extras or samples else None)

    def capture(self) -> list[int]:
        """Capture the step's graph for every batch size a step can pad to,
        as vLLM does at start: a batch size first seen under load would
        otherwise hold every running sequence while it compiles and
        captures (the likely cause of a 1 s stall in a GPU benchmark). Only where one graph
        serves every length (unmasked attention; a masked step has a graph
        per length as well), and only before any sequence holds a row:
        the capture's steps write the null block.
        Returns the batch sizes captured."""
        if not self.use_graphs or self.fused is None or self.kernels.masked:
            return []
        sizes = sorted({_bucket(n, self.max_slots) for n in range(1, self.max_slots + 1)})
        # The steps with penalties and logprobs, and with sampling rows, too: the
        # first request asking for them would otherwise compile and capture under load.
        self._make_row_sampling()
        variants = ((False, False), (True, False), (True, True))
        with torch.inference_mode():
            graphs = [(bucket, extras, samples) for bucket in sizes for extras, samples in variants]
            for bucket, extras, samples in counted("decode graphs", graphs, len(graphs)):
                self._graph(bucket, 0, extras, samples)
        return sizes

    def forget_graphs(self) -> None:
        """The modules changed (a LoRA adapter wrapped or its stacks remade):
        graphs captured over the old ones would replay them."""
        if self._graphs and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # none of them still queued
        self._graphs.clear()

    def _graph(self, bucket: int, span: int, extras: bool = False, samples: bool = False) -> tuple[Any, torch.Tensor]:
        # A step with extras (or samples) is a graph of its own (captured at start with the others).
        key = (bucket, span, extras, samples)
        if key not in self._graphs:
            # The warm-ups run the step for real: each writes ``sampled`` (the
            # next one would feed from it: a launched step's token, not read
            # yet, would be lost) and counts the fed tokens. Put both back.
            state = [self.sampled]
            if extras and self.row_sampling is not None:
                state.append(self.row_sampling.counts)
            saved = [t.clone() for t in state]
            self._graphs[key] = cuda_graph.capture(lambda: self._forward(bucket, span, extras, samples), warmups=2)
            for t, kept in zip(state, saved, strict=True):
                t.copy_(kept)
        return self._graphs[key]

    def _forward(self, bucket: int, span: int, extras: bool = False, samples: bool = False) -> torch.Tensor:
        if self.fused is not None:
            return self._forward_fused(bucket, span, extras, samples)
        s = self.shape
        blocks, offsets = self._write_address(bucket)
        table = self.tables[:bucket, : span // self.block_size]
        cos, sin = self._rotary(self.positions[:bucket])
        mask = length_mask(bucket, span, self.write_at)[:, None, None, :]  # [bucket, 1, 1, span]
        tokens = self._fed_tokens(bucket)
        hidden = self.lm.embed_tokens(tokens)[:, None, :]  # [b, 1, hidden]
        for i, layer in enumerate(self.lm.layers):
            attn = layer.self_attn
            residual = hidden
            x = layer.input_layernorm(hidden)
            q = attn.q_proj(x).view(bucket, 1, s.heads, s.head_dim).transpose(1, 2)
            k = attn.k_proj(x).view(bucket, 1, s.kv_heads, s.head_dim).transpose(1, 2)
            v = attn.v_proj(x).view(bucket, 1, s.kv_heads, s.head_dim).transpose(1, 2)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            self.keys[i][blocks, :, offsets] = k[:, :, 0]
            self.values[i][blocks, :, offsets] = v[:, :, 0]
            keys = gather_blocks(self.keys[i], table)
            values = gather_blocks(self.values[i], table)
            out = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, scale=self.scaling, enable_gqa=s.kv_heads != s.heads
            )
            out = out.transpose(1, 2).reshape(bucket, 1, s.heads * s.head_dim)
            hidden = residual + attn.o_proj(out)
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        hidden = self.lm.norm(hidden)[:, 0]
        head = self.model.lm_head
        by_vocab = self.device.type == "cpu" and bucket >= _VOCAB_MAJOR_FROM and not extras
        if by_vocab and isinstance(head, torch.nn.Linear):
            logits = _vocab_major(head, hidden)
        else:
            logits = head(hidden)
        return self._choose(bucket, logits, tokens, extras, samples)

    def _forward_fused(
        self, bucket: int, span: int, extras: bool, samples: bool, chunk: ChunkRows | None = None
    ) -> torch.Tensor:
        assert self.fused is not None
        s, k = self.shape, self.kernels
        blocks, offsets = self._write_address(bucket)
        cos, sin = (t[:, 0] for t in self._rotary(self.positions[:bucket]))  # [b, 1, d]
        table = self.tables[:bucket, : span // self.block_size] if k.masked else self.tables[:bucket]
        step = k.prepare(bucket, span, self.write_at, table, self._counters)
        tokens = self._fed_tokens(bucket)
        hidden = self.lm.embed_tokens(tokens)  # [b, hidden]
        delta = None
        # Without adapters the pieces take no slots (the graphs compiled before adapters existed).
        slots = self.lora[:bucket] if self.adapters is not None else None
        if chunk is not None:
            # The chunk's rows after the step's: one projection of each kind over both.
            hidden = torch.cat([hidden, chunk.embeds.to(hidden.dtype)])
            cos, sin = torch.cat([cos, chunk.cos]), torch.cat([sin, chunk.sin])
            blocks, offsets = torch.cat([blocks, chunk.blocks]), torch.cat([offsets, chunk.offsets])
            if slots is not None:
                assert chunk.slots is not None
                slots = torch.cat([slots, chunk.slots])
        for i, w in enumerate(self.fused):
            keys, values = self.keys[i], self.values[i]
            lo = self.adapters[i] if self.adapters is not None else NO_LORA
            hidden, q = k.before_attention(
                hidden,
                delta,
                w.ln1,
                w.qkv,
                w.qkv_bias,
                w.eps,
                cos,
                sin,
                s.heads,
                s.kv_heads,
                keys,
                values,
                blocks,
                offsets,
                lo.qkv,
                slots,
            )
            if chunk is None:
                attended = k.attend(q, keys, values, step, self.scaling)
            else:
                stepped = k.attend(q[:bucket], keys, values, step, self.scaling)
                attended = torch.cat([stepped, chunk.attend(q[bucket:], i)])
            projected = project_out(attended, w.o, lo.o, slots, k.project)
            hidden, delta = k.after_attention(
                hidden, projected, w.ln2, w.gate_up, w.down, w.eps, lo.gate_up, lo.down, slots
            )
        assert delta is not None
        norm = self.lm.norm
        if chunk is not None:
            # Only the chunk's last row makes a token (the caller's head: its adapter's).
            chunk.hidden = k.final(hidden[-1:], delta[-1:], norm.weight, float(norm.variance_epsilon))
            hidden, delta = hidden[:bucket], delta[:bucket]
        logits: torch.Tensor = self.model.lm_head(k.final(hidden, delta, norm.weight, float(norm.variance_epsilon)))
        return self._choose(bucket, logits, tokens, extras, samples)

    def _write_address(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's block and offset in it where this step's key and value
        go; a block given in the inputs is entered in the row's table first."""
        rows, write_at = self.rows[:bucket], self.write_at[:bucket]
        index = write_at // self.block_size
        given = self.block[:bucket]
        blocks = torch.where(given >= 0, given, self.tables[rows, index])
        self.tables[rows, index] = blocks
        return blocks, write_at % self.block_size

    def _fed_tokens(self, bucket: int) -> torch.Tensor:
        # Read before this step writes ``sampled`` (stream order): the previous step's choices.
        feed = self.feed[:bucket]
        return torch.where(feed >= 0, self.sampled[feed.clamp(min=0)], self.tokens[:bucket])

    def _choose(
        self, bucket: int, logits: torch.Tensor, tokens: torch.Tensor, extras: bool = False, samples: bool = False
    ) -> torch.Tensor:
        """Greedy choices into ``sampled`` (generate()'s argmax: first index
        on ties; EOS at -inf below min_tokens, in the logits returned too,
        as the host's sampling would mask them); a row not asked keeps its
        fed token there, for a later step to feed again. With ``extras``,
        each row's bias and penalties before the argmax, and its logprobs
        (of the logits as the model gave them) after; with ``samples``, the
        draws of the rows that sample."""
        sampled = None
        if extras:
            assert self.row_sampling is not None
            # Reads the logits before the EOS mask below: the reports are of the model's own.
            draws = self.draws if samples else None
            sampled = self.row_sampling.step(bucket, logits, tokens, self.asked, self.mask_eos, draws)
        if self._eos is not None:
            eos = logits[:, self._eos]
            logits[:, self._eos] = torch.where(self.mask_eos[:bucket, None] > 0, float("-inf"), eos)
        if sampled is None:
            sampled = torch.where(self.asked[:bucket] > 0, best_index(logits), tokens)
        self.sampled[:bucket] = sampled
        return logits

    def _rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # As the models' rotary embeddings: float32 angles, cat(freqs, freqs),
        # scaled, then the activations' dtype. [b, 1, 1, head_dim]
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.attention_scaling).to(self.dtype)
        sin = (emb.sin() * self.attention_scaling).to(self.dtype)
        return cos[:, None, None, :], sin[:, None, None, :]


def to_blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """One sequence's keys or values [kv_heads, length, d] → [blocks,
    kv_heads, block_size, d], zeros past ``length`` (contiguous)."""
    kv, length, d = x.shape
    n = blocks_for(length, block_size)
    padded = x.new_zeros(kv, n * block_size, d)
    padded[:, :length] = x
    return padded.view(kv, n, block_size, d).transpose(0, 1).contiguous()


def from_blocks(blocks: torch.Tensor, length: int) -> torch.Tensor:
    """``to_blocks`` undone: [blocks, kv_heads, block_size, d] → [kv_heads, length, d]."""
    n, kv, block_size, d = blocks.shape
    return blocks.transpose(0, 1).reshape(kv, n * block_size, d)[:, :length]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos) + (rotated * sin)


# Rows from which a CPU step's head is a vocabulary-major product. Below it
# ``linear``: a few rows gain little from the product (8 rows of the tiny
# model on two cores, in process: 7.4 against 8.9 ms), and it keeps both
# cores from the worker's host side for that little.
_VOCAB_MAJOR_FROM = 16


def _vocab_major(head: torch.nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    """``head(hidden)`` for several rows on CPU, as a [rows, vocab] view of
    a vocabulary-major product: the weights times the rows, which torch's
    CPU BLAS spreads over the threads by vocabulary (32 rows of the tiny model's
    151,936 × 64 head on two cores: 7 ms against 16 for ``linear``, which
    runs this shape on about one). The sums are over the same 64 products
    a logit; their last bits may differ from ``linear``'s, as ``linear``'s
    own do between one row and several. One row keeps ``linear`` (what
    generate() computes, bit for bit), as do a few (``_VOCAB_MAJOR_FROM``)."""
    out = torch.mm(head.weight, hidden.t())
    if head.bias is not None:
        out += head.bias[:, None]
    return out.t()


def _bucket(n: int, max_slots: int) -> int:
    i = bisect.bisect_left(BATCH_BUCKETS, n)
    return min(BATCH_BUCKETS[i] if i < len(BATCH_BUCKETS) else max_slots, max_slots)
