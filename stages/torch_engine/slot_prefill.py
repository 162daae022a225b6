"""One prompt's prefill on a GPU: the fused layer weights, the keys and
values written straight into the prompt's blocks of the batch decoder's
pool, each prompt length bucket one CUDA graph.

The model's modules launch some thirty kernels a layer, each preceded by
Python: a 2B model's prefill of 20 tokens cost as much as one of 300 on an
H100 (31 ms against 38, 2026-11-27), bound by launches, not by compute. A
graph replays those launches in a few microseconds each. The prompt is
padded up to its bucket at the end: attention is causal, so no real token
sees a padding row, and the padding's keys and values land past the prompt
in its last block, where decode steps write over them before any step
reads them, or in the null block past its blocks. The cache then needs no
copy into the pool afterwards either.

Each layer's pieces around attention (norm, projection, RoPE and the cache
write; the MLP) are compiled where the decode step's are (``compiled``, on
a GPU by default): their elementwise work fused, a 320-token prefill of the 2B preset ran
4.2 ms on an H100 against 6.2 ms from graphs of the modules' kernel
sequence (435 kernels against 1134; 2026-11-28).

A prompt whose first blocks are a cached prefix (prefix caching) runs the
same way from the first position past it: its rows are the rest of the
prompt, each attending over the prefix's blocks and the rows before it,
read through the prompt's block table (the Triton decode kernel, one row
per token, where the decode step runs it; SDPA under a mask elsewhere).
Each bucket has a graph of that form too. Through the modules instead,
the prefix's blocks were copied out of the pool, the rest ran some thirty
kernels a layer from Python, and the cache was copied back: a prefill
took 12.7 ms of the engine thread where a graphed one took 2.9 (H200, 64
clients, a fifth of the prompts partly cached, 2026-11-28), so under load
a partial hit cost more than it saved.

A chunk of a long prompt (chunked prefill, ``run(chunk=True)``) runs the
same layers, its rows attending over the blocks the chunks before it filled
by SDPA under a mask: the decode kernel's one query a row would read the
whole prefix again for each of a chunk's thousands of rows (twice the
prefill's time through graphs, H200, 2026-11-29). Its first chunk is a
prompt like any (its bucket's graph); each later one replays a graph too,
its rows padded to the chunk length's bucket (``chunk_tokens``) and its
attention over the table's first ``span`` positions, a power of two blocks
(one graph for each). Without graphs a 512-token chunk of the 2B preset
took 26.6 ms of the host for 7.2 ms of the GPU's work (H200, 2026-12-02):
launches, not matrix products, were its time; through its graph it ran
8.1 ms against 21.4 eager in one call (``mmpipe bench decode --chunk 512``).

The arithmetic is the fused decode step's (stages/torch_engine/fused_decode.py):
the models' own, with concatenated projections, so in bf16 it rounds
differently from the modules in the last bits. Only where the fused step
runs (CUDA by default); the CPU keeps the modules and generate()'s exact
tokens.
"""

from __future__ import annotations

import bisect
from typing import Any

import torch
import torch.nn.functional as F

from stages import compiled as compiled_options
from stages import cuda_graph
from stages.device_copy import to_device
from stages.progress import counted
from stages.torch_engine.batch_decoder import BatchDecoder, ChunkRows
from stages.torch_engine.block_pool import NULL_BLOCK
from stages.torch_engine.decode_attention import gather_blocks
from stages.torch_engine.fused_decode import FusedLayer, after_attention, project_out, project_qkv, rms_norm, rope
from stages.torch_engine.fused_lora import NO_LORA, ProjectionLora
from stages.torch_engine.kernels import triton_decode

# Prompt lengths a graph is captured for; a longer prompt runs the modules.
# Between powers of two, steps of a quarter of the one below: past 128
# tokens a prompt is padded by under a quarter, where powers of two alone
# padded it up to nearly double (the 2B preset's 281-token image prompt ran
# as 512, its prefill 9.7 ms of the GPU a request, as long as the vision
# tower's: H100, 64 clients, 2026-11-28). More graphs cost little memory:
# they share one pool, captured largest first.
BUCKETS = (16, 32, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048)


def mrope_section(config: Any) -> list[int] | None:
    """Qwen-VL's split of the rotary frequencies between the temporal,
    height and width position rows (None: one position row)."""
    for name in ("rope_parameters", "rope_scaling"):
        params = getattr(config, name, None)
        if isinstance(params, dict) and params.get("mrope_section"):
            return [int(n) for n in params["mrope_section"]]
    return None


class SlotPrefill:
    """Prefill of one prompt of up to ``max_tokens`` tokens into blocks of
    ``decoder``'s pool (which must run the fused step). ``past``: graphs
    for prompts past a cached prefix too (prefix caching on)."""

    def __init__(
        self,
        decoder: BatchDecoder,
        use_graphs: bool,
        longest: int = BUCKETS[-1],
        compiled: bool = False,
        past: bool = False,
    ) -> None:
        if decoder.fused is None:
            raise ValueError("slot prefill needs the batch decoder's fused layers")
        self.decoder = decoder
        self.fused: list[FusedLayer] = decoder.fused
        self.buckets = [b for b in BUCKETS if b <= min(longest, decoder.max_len)]
        self.max_tokens = self.buckets[-1] if self.buckets else 0
        lm, s = decoder.lm, decoder.shape
        self.mrope = mrope_section(lm.config)
        device, dtype = decoder.device, decoder.dtype
        n = max(self.max_tokens, 1)
        # Static inputs: every graph reads its prompt from these addresses.
        self._embeds = torch.zeros(n, int(lm.config.hidden_size), dtype=dtype, device=device)
        self._cos = torch.zeros(n, 1, s.head_dim, dtype=dtype, device=device)
        self._sin = torch.zeros(n, 1, s.head_dim, dtype=dtype, device=device)
        # The prompt's block table (the null block past its blocks).
        self._table = torch.zeros(decoder.blocks_per_seq, dtype=torch.long, device=device)
        self._last = torch.zeros(1, dtype=torch.long, device=device)
        self._write_at = torch.arange(n, device=device)
        # Past a cached prefix: where the rows start, and how many are the prompt's.
        self._start = torch.zeros(1, dtype=torch.long, device=device)
        self._count = torch.zeros(1, dtype=torch.long, device=device)
        # The prompt's LoRA adapter slot (0: none), read where the decoder holds adapters.
        self.lora_slot = torch.zeros(1, dtype=torch.long, device=device)
        # The Triton kernel's (one per (row, kv head)), zero between its launches.
        triton = decoder.kernels.attention == "triton"
        self._counters = torch.zeros(n * s.kv_heads, dtype=torch.int32, device=device) if triton else None
        self.past = past
        self.use_graphs = use_graphs and device.type == "cuda"
        self._before = torch.compile(_before_attention, **compiled_options.OPTIONS) if compiled else _before_attention
        self._after = torch.compile(after_attention, **compiled_options.OPTIONS) if compiled else after_attention
        # Tokens a chunk of a long prompt takes (0: no graphs for chunks past the first).
        self.chunk_tokens = 0
        # By (bucket, past a prefix, span: a chunk's positions attended, 0 where not a chunk).
        self._graphs: dict[tuple[int, bool, int], tuple[Any, torch.Tensor]] = {}

    def fits(self, length: int) -> bool:
        return 0 < length <= self.max_tokens

    def bucket_for(self, length: int) -> int:
        """The captured length a prompt of ``length`` tokens runs as."""
        return self.buckets[bisect.bisect_left(self.buckets, length)]

    @torch.inference_mode()
    def run(
        self,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        blocks: list[int],
        start: int = 0,
        lora: int = 0,
        chunk: bool = False,
    ) -> torch.Tensor:
        """Next-token logits [vocab] of a prompt given as embeddings [L,
        hidden] and its positions (the family's layout); its keys and values
        are in ``blocks`` after. ``start``: the prompt's first ``start``
        positions are a cached prefix already in ``blocks`` (whole blocks),
        and ``embeds`` and ``positions`` are the rest's. ``lora``: the
        prompt's adapter slot (the decoder's ``adapters``; 0: none).

        ``chunk``: the rows are one chunk of a long prompt (chunked
        prefill), ``start`` the chunks' before it: run without a graph, the
        rows past ``start`` attending over the blocks by SDPA under a mask.
        The decode kernel's form (one query a row, each row reading every
        position before it) suits a few rows past a long prefix and not a
        chunk of thousands (each would read the whole prefix again); a chunk
        is bound by its matrix products. With graphs a chunk past the
        first replays its span's graph (padded to ``chunk_tokens``' bucket)."""
        length = int(embeds.shape[0])
        if not self.fits(length):
            raise ValueError(f"a prompt of {length} tokens; slot prefill takes 1 to {self.max_tokens}")
        d = self.decoder
        if start % d.block_size or start < 0 or d.blocks_for(start + length) > len(blocks):
            raise ValueError(f"a prefix of {start} tokens and {length} more in {len(blocks)} blocks of {d.block_size}")
        cos, sin = self._rotary(positions)
        self._embeds[:length].copy_(embeds)
        self._cos[:length].copy_(cos)
        self._sin[:length].copy_(sin)
        self._table.copy_(d.table_row(blocks), non_blocking=True)
        self._last.fill_(length - 1)
        if lora and d.adapters is None:
            raise ValueError(f"adapter slot {lora}, and the decoder holds no adapters")
        self.lora_slot.fill_(lora)
        past = start > 0
        if past:
            self._start.fill_(start)
            self._count.fill_(length)
        graphed = self.use_graphs and not (chunk and past and not self.chunk_tokens)
        bucket, span = self.bucket_for(length), 0
        if chunk and past:
            bucket, span = (
                self.chunk_form(length, start) if graphed else (bucket, d.blocks_for(start + length) * d.block_size)
            )
        if not graphed:
            return self._forward(bucket, past, span)
        graph, out = self._graph(bucket, past, span)
        graph.replay()
        return out

    def chunk_form(self, length: int, start: int) -> tuple[int, int]:
        """The rows and the span a chunk of ``length`` tokens past ``start``
        runs as in its graph."""
        if not 0 < length <= self.chunk_tokens:
            raise ValueError(f"a chunk of {length} tokens; chunks take up to {self.chunk_tokens}")
        return self.bucket_for(self.chunk_tokens), self.span_for(start + length)

    def span_for(self, positions: int) -> int:
        """The positions a chunk past ``positions`` - its length attends over
        in its graph: a power of two blocks, within the table."""
        d = self.decoder
        blocks = 1 << max(d.blocks_for(positions) - 1, 0).bit_length()
        return min(blocks, d.blocks_per_seq) * d.block_size

    def chunk_spans(self) -> list[int]:
        """Every span a chunk past the first can take (``span_for``)."""
        d = self.decoder
        if not self.chunk_tokens or self.chunk_tokens >= d.max_len:
            return []
        spans = [self.span_for(self.chunk_tokens + 1)]
        while spans[-1] < d.blocks_per_seq * d.block_size:
            spans.append(self.span_for(spans[-1] + 1))
        return spans

    def chunk_rows(
        self, embeds: torch.Tensor, positions: torch.Tensor, blocks: list[int], start: int, lora: int = 0
    ) -> ChunkRows:
        """One chunk of a long prompt (as ``run(chunk=True)`` takes it) as rows
        for the decoder's next step to carry (``BatchDecoder.step``'s
        ``chunk``): the step's forward writes its keys and values into
        ``blocks`` and attends over them as ``run`` would."""
        length = int(embeds.shape[0])
        d = self.decoder
        if length < 1 or start % d.block_size or start < 0 or d.blocks_for(start + length) > len(blocks):
            raise ValueError(f"a chunk of {length} tokens past {start} in {len(blocks)} blocks of {d.block_size}")
        if lora and d.adapters is None:
            raise ValueError(f"adapter slot {lora}, and the decoder holds no adapters")
        cos, sin = self._rotary(positions)
        # Its own table: the step runs after this returns, and run()'s buffers are a graph's.
        table = d.table_row(blocks).to(d.device, non_blocking=True)
        write_at = start + torch.arange(length, device=d.device)
        span = d.blocks_for(start + length) * d.block_size
        slots = torch.full((length,), lora, dtype=torch.long, device=d.device) if d.adapters is not None else None
        return ChunkRows(
            embeds=to_device(embeds, d.device).to(d.dtype),
            cos=cos,
            sin=sin,
            blocks=table[write_at // d.block_size],
            offsets=write_at % d.block_size,
            slots=slots,
            attend=self._past_attention(write_at, span, table),
        )

    def capture(self) -> list[int]:
        """Capture every bucket's graph (largest first, so the smaller reuse
        its memory): a capture writes the null block. Returns the buckets
        captured."""
        if not self.use_graphs:
            return []
        forms = [(bucket, past, 0) for past in ((False, True) if self.past else (False,)) for bucket in self.buckets]
        if self.chunk_tokens:
            forms += [(self.bucket_for(self.chunk_tokens), True, span) for span in self.chunk_spans()]
        # Largest first: the rest reuse their memory.
        forms.sort(key=lambda form: (form[0] * max(form[2], form[0]), form), reverse=True)
        with torch.inference_mode():
            self._table.zero_()
            self._count.zero_()  # past a prefix: every row padding, written to the null block
            for bucket, past, span in counted("prefill graphs", forms, len(forms)):
                self._graph(bucket, past, span)
        return list(self.buckets)

    def forget_graphs(self) -> None:
        """The adapters changed: graphs captured over the old ones would
        replay them (each bucket captures again when next run)."""
        if self._graphs and self.decoder.device.type == "cuda":
            torch.cuda.synchronize(self.decoder.device)
        self._graphs.clear()

    def _graph(self, bucket: int, past: bool, span: int = 0) -> tuple[Any, torch.Tensor]:
        if (bucket, past, span) not in self._graphs:
            pool = next(iter(self._graphs.values()))[0].pool() if self._graphs else None
            graph = cuda_graph.capture(lambda: self._forward(bucket, past, span), warmups=2, pool=pool)
            self._graphs[bucket, past, span] = graph
        return self._graphs[bucket, past, span]

    def _forward(self, bucket: int, past: bool, span: int = 0) -> torch.Tensor:
        d, s = self.decoder, self.decoder.shape
        rows = self._write_at[:bucket]
        reads = None
        if past:
            write_at = self._start + rows
            real = rows < self._count
            # Padding rows write into the null block and read its first
            # position alone: past the prompt they could run off its table.
            blocks = torch.where(real, self._table[torch.where(real, write_at // d.block_size, 0)], NULL_BLOCK)
            offsets = write_at % d.block_size
            reads = torch.where(real, write_at, 0)
            past_attention = self._past_attention(reads, span)
        else:
            blocks, offsets = self._table[rows // d.block_size], rows % d.block_size
        cos, sin = self._cos[:bucket], self._sin[:bucket]
        hidden = self._embeds[:bucket]
        delta: torch.Tensor | None = None
        slots = self.lora_slot.expand(bucket) if d.adapters is not None else None
        for i, w in enumerate(self.fused):
            lo = d.adapters[i] if d.adapters is not None else NO_LORA
            hidden, q, k, v = self._before(
                hidden, delta, w.ln1, w.qkv, w.qkv_bias, w.eps, cos, sin, s.heads, s.kv_heads,
                d.keys[i], d.values[i], blocks, offsets, lo.qkv, slots,
            )  # fmt: skip
            attended = past_attention(q, i) if reads is not None else _causal_attention(q, k, v, d.scaling)
            projected = project_out(attended, w.o, lo.o, slots)
            hidden, delta = self._after(hidden, projected, w.ln2, w.gate_up, w.down, w.eps, lo.gate_up, lo.down, slots)
        assert delta is not None
        last = (hidden + delta).index_select(0, self._last)
        norm = d.lm.norm
        logits: torch.Tensor = d.model.lm_head(rms_norm(last, norm.weight, float(norm.variance_epsilon)))
        return logits[0]

    def _past_attention(self, reads: torch.Tensor, span: int = 0, table: torch.Tensor | None = None) -> Any:
        """Attention of rows past a cached prefix, row r over positions 0 to
        reads[r] of the prompt's blocks (written already: the prefix's, and
        this layer's rows up to r): (q [bucket, heads, d], layer) → [bucket,
        heads * d]. What every layer shares is made once, here. ``span``:
        SDPA under a mask over the table's first ``span`` positions (whole
        blocks, past every read) even where the Triton kernel runs (0: the
        Triton kernel where it runs, else SDPA over the whole table, so that
        one graph serves every prefix length). ``table``: the prompt's block
        table (default: the graphs' static one)."""
        d = self.decoder
        bucket = int(reads.shape[0])
        table = self._table if table is None else table
        if self._counters is not None and not span:
            lengths = reads + 1
            rows_table = table[None].expand(bucket, -1)  # every row the prompt's table

            def triton(q: torch.Tensor, layer: int) -> torch.Tensor:
                return triton_decode.attend(
                    q, d.keys[layer], d.values[layer], lengths, rows_table, d.scaling, self._counters
                )

            return triton

        span = span or table.shape[0] * d.block_size
        spanned = table[None, : span // d.block_size]
        mask = torch.arange(span, device=reads.device)[None, :] <= reads[:, None]  # [bucket, span]

        def sdpa(q: torch.Tensor, layer: int) -> torch.Tensor:
            keys = gather_blocks(d.keys[layer], spanned)[0]  # [kv_heads, span, d]
            values = gather_blocks(d.values[layer], spanned)[0]
            return _attention(q, keys, values, d.scaling, mask=mask)

        return sdpa

    def _rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [L, 1, head_dim] as the models compute them: float32
        angles, the M-RoPE rows' frequencies interleaved by section, cast
        to the activations' dtype."""
        d = self.decoder
        rows = to_device(positions.reshape(-1, positions.shape[-1]), d.device)  # [1 or 3, L]
        freqs = rows[..., None].float() * d.inv_freq  # [rows, L, head_dim / 2]
        if self.mrope is not None and rows.shape[0] == 3:
            parts = freqs.split(self.mrope, dim=-1)
            freqs = torch.cat([part[i % 3] for i, part in enumerate(parts)], dim=-1)
        else:
            freqs = freqs[0]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * d.attention_scaling).to(d.dtype)
        sin = (emb.sin() * d.attention_scaling).to(d.dtype)
        return cos[:, None, :], sin[:, None, :]


def _before_attention(
    hidden: torch.Tensor,
    delta: torch.Tensor | None,
    ln: torch.Tensor,
    qkv_weight: torch.Tensor,
    qkv_bias: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    heads: int,
    kv_heads: int,
    keys: torch.Tensor,
    values: torch.Tensor,
    blocks: torch.Tensor,
    offsets: torch.Tensor,
    lora: ProjectionLora | None = None,
    slots: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden [L, hidden] (plus the last layer's MLP output) → (hidden, q
    [L, heads, d], k and v [L, kv_heads, d]), RoPE applied; k and v also
    written into a layer's pool keys, values at (blocks[i], offsets[i]).
    ``lora``, ``slots``: the QKV projection's adapters, by row."""
    if delta is not None:
        hidden = hidden + delta
    n, d = hidden.shape[0], cos.shape[-1]
    qkv = project_qkv(rms_norm(hidden, ln, eps), qkv_weight, qkv_bias, lora, slots)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    k, v = rope(k.view(n, kv_heads, d), cos, sin), v.view(n, kv_heads, d)
    keys[blocks, :, offsets] = k
    values[blocks, :, offsets] = v
    return hidden, rope(q.view(n, heads, d), cos, sin), k, v


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
    """q [L, heads, d] over k, v [L, kv_heads, d], causal → [L, heads * d]."""
    return _attention(q, k.transpose(0, 1), v.transpose(0, 1), scaling)


def _attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """q [L, heads, d] over keys, values [kv_heads, S, d]: causal (S = L),
    or where ``mask`` [L, S] → [L, heads * d]."""
    n, heads, d = q.shape
    group = heads // keys.shape[0]
    keys = keys.repeat_interleave(group, dim=0)[None]
    values = values.repeat_interleave(group, dim=0)[None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        keys,
        values,
        attn_mask=None if mask is None else mask[None, None],
        is_causal=mask is None,
        scale=scaling,
    )
    return out[0].transpose(0, 1).reshape(n, heads * d)
