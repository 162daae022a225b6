"""Token selection: greedy, or temperature / top-k / top-p / min-p sampling,
as a request's ``SamplingConfig`` (stages/sampling.py) asks.

A sampled token is the Gumbel-max of the kept tokens' scores: the argmax of
each score plus a Gumbel noise that is a hash of the row's draw key and the
token's id (``gumbel``), the key fixed by ``(seed, i)`` for the token at
index ``i`` (``draw_key``). So a worker that takes a request over after a
crash and resumes at index ``i`` draws the same token as the first attempt
would have, given the same logits; a row draws the same whatever else shares
its batch; and logits that differ in their last bits (the batched step's
and a single forward's) change the token only where two noisy scores nearly
tie, not wherever a cumulative sum crosses a boundary. One function
(``sample_rows``) samples every row of a batched decode step on the device
and the host's single choices alike.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from stages.sampling import Logprobs, SamplingConfig

_MASK64 = (1 << 64) - 1


def best_index(scores: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Each row's argmax, the first index on ties as generate()'s, taken from
    ``max``: the same indices, and on CPU torch's argmax over a vocabulary
    row is 3 to 4 times slower (32 rows of 151,936, one core: 12.6 ms
    against 2.9), more than the tiny model's whole step without it. On CPU
    over a vocabulary's last dimension, found by blocks (``_first_max_by_blocks``)."""
    if scores.device.type == "cpu" and scores.shape[dim] >= _BLOCKS_FROM and dim in (-1, scores.dim() - 1):
        return _first_max_by_blocks(scores)
    return scores.max(dim).indices


# Found by blocks from this many scores on (a vocabulary, not a handful of rows).
_BLOCKS_FROM = 4096
_BLOCK = 128


def _first_max_by_blocks(scores: torch.Tensor) -> torch.Tensor:
    """``scores.max(-1).indices`` in a fifth of its time on CPU (32 rows of
    151,936: 0.63 against 3.84 ms on two cores, 1.27 against 6.17 on one):
    ``max`` with indices walks each row on one thread, unvectorised, where
    ``amax`` streams it in SIMD. So each block of ``_BLOCK`` scores' max by
    ``amax``, then the first block that holds the row's max, then the first
    index of it there: the first index of the max over the row, as ``max``
    gives. A row with a NaN (no score equals its max) takes ``max`` itself.
    Rows stored vocabulary-major (a [vocab, rows] product seen transposed)
    are read in place, by columns."""
    n = scores.shape[-1]
    whole = n - n % _BLOCK
    if scores.dim() == 2 and scores.stride(-1) != 1 and scores.stride(0) == 1:
        by_vocab = scores.t()
        cols = torch.arange(scores.shape[0])
        blocks = by_vocab[:whole].view(whole // _BLOCK, _BLOCK, -1)
        index = _first_max(blocks.amax(1).t(), lambda first: blocks[first, :, cols], scores[:, whole:])
    else:
        flat = scores.reshape(-1, n)
        rows = torch.arange(flat.shape[0])
        blocks = flat[:, :whole].view(flat.shape[0], whole // _BLOCK, _BLOCK)
        index = _first_max(blocks.amax(-1), lambda first: blocks[rows, first], flat[:, whole:])
    if index is None:
        return scores.max(-1).indices
    return index.reshape(scores.shape[:-1])


def _first_max(
    block_max: torch.Tensor, block: Callable[[torch.Tensor], torch.Tensor], tail: torch.Tensor
) -> torch.Tensor | None:
    """Each row's first index of its max, from its blocks' maxima
    [rows, blocks], its scores in a given block of each row (``block``:
    [rows, _BLOCK]) and its scores past the last whole block; None where a
    row's max is nowhere (a NaN)."""
    best = block_max.amax(-1, keepdim=True)
    if tail.shape[-1]:
        best = torch.maximum(best, tail.amax(-1, keepdim=True))
    holds = block_max == best
    first = holds.to(torch.uint8).argmax(-1)
    index = first * _BLOCK + block(first).argmax(-1)
    found = holds.any(-1)
    if tail.shape[-1]:
        index = torch.where(found, index, block_max.shape[-1] * _BLOCK + tail.argmax(-1))
        found = found | (tail == best).any(-1)
    return index if bool(found.all()) else None


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def token_seed(seed: int, index: int) -> int:
    """Seed of the draw for the token at `index`: a hash of (seed, index), 63 bits."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (index & _MASK64)) >> 1


def draw_key(seed: int, index: int) -> int:
    """The 32-bit key of the draw for the token at ``index``."""
    return token_seed(seed, index) >> 31


_M32 = 0xFFFFFFFF


def weyl(vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Each token id's term of ``gumbel``'s hash: a Weyl sequence of the
    ids, int64 holding 32 bits. Made once, outside compiled code: inductor
    folds ``arange(n) * c`` into an int32 index expression, which Triton
    refuses for a ``c`` past 2**31 (and which would wrap under a smaller one)."""
    ids = torch.arange(vocab, dtype=torch.int64, device=device)
    return (ids * 0x9E3779B9) & _M32


def gumbel(keys: torch.Tensor, vocab: int, ids: torch.Tensor | None = None) -> torch.Tensor:
    """Standard Gumbel noise [rows, vocab] in float32, a pure function of
    each row's key and the token id (murmur3's finalizer over the key mixed
    with a Weyl sequence of the id). ``ids``: ``weyl(vocab)``, made ahead."""
    if ids is None:
        ids = weyl(vocab, keys.device)
    # int64 lanes: each product of two 32-bit numbers keeps its low 32 bits under the mask.
    x = (keys[:, None] ^ ids) & _M32
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _M32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _M32
    x = x ^ (x >> 16)
    return -torch.log(-torch.log(uniform(x)))


def uniform(bits: torch.Tensor) -> torch.Tensor:
    """32-bit integers to float32 strictly within (0, 1): their top 23 bits
    and a half. (24 bits and a half round up to 1 at the top, where the
    noise would be infinite and a masked token's -inf score NaN.)"""
    return ((bits >> 9).float() + 0.5) * 2.0**-23


# Sampling parameters of a row, in this order in ``sample_rows``' ``params``.
TEMPERATURE, TOP_K, TOP_P, MIN_P = range(4)


def sampling_params(config: SamplingConfig) -> list[float]:
    """``config``'s row of ``sample_rows``' ``params`` (temperature 0: greedy)."""
    return [config.temperature, float(max(config.top_k, 0)), config.top_p, config.min_p]


def select_token(
    logits: torch.Tensor,
    config: SamplingConfig,
    index: int,
    eos_token_ids: torch.Tensor | None = None,
    generated: list[int] | None = None,
) -> int:
    """Pick the token at `index` from next-token `logits` (shape [vocab]).

    The penalties and the logit bias first (``generated``: the tokens
    generated before this one), then EOS ids set to -inf while index <
    min_tokens, as transformers' MinNewTokensLogitsProcessor does. Greedy is
    argmax (first index on ties, like generate()).
    """
    if config.adjusts:
        logits = adjusted(logits, config, generated or [])
    if config.greedy:
        return int(greedy_choice(logits, config, index, eos_token_ids).item())
    stops = stopping_ids(eos_token_ids, config)
    if stops is not None and index < config.min_tokens:
        logits = _without(logits, stops)

    params = torch.tensor([sampling_params(config)], device=logits.device)
    keys = torch.tensor([draw_key(config.seed, index)], device=logits.device)
    return int(sample_rows(logits[None], params, keys, sort_all=logits.is_cuda).item())


# Where a full sort of the vocabulary is slow (a CPU: ~12 ms a row of 152k),
# the best this many tokens first: they hold top_p's mass but for a flat tail.
_PREFIX = 1024


def sample_rows(
    logits: torch.Tensor, params: torch.Tensor, keys: torch.Tensor, sort_all: bool, ids: torch.Tensor | None = None
) -> torch.Tensor:
    """One token per row of ``logits`` [rows, vocab] (adjusted and masked
    already), sampled by the row's ``params`` [rows, 4] (temperature > 0,
    top_k (0: all), top_p, min_p) with its draw ``keys`` [rows] (``draw_key``).

    Scores are the logits over the temperature. Top-k keeps the scores at
    least the k-th best (ties with it too, as vLLM's does); top-p the tokens
    at least as likely as the last of the smallest most-likely-first prefix
    whose mass (float64) reaches top_p; min-p those at least ``min_p`` times
    as likely as the best (transformers' MinPLogitsWarper). The token: the
    Gumbel-max of the kept scores.

    Each row's arithmetic depends on its own values only, so a row samples
    the same token in any batch. ``sort_all``: sort the whole vocabulary
    for top-k and top-p (no branch on the values: what a CUDA graph can
    hold); else the best ``_PREFIX`` first, and all of it only for a row
    they do not settle. ``ids``: ``weyl(vocab)`` made ahead (compiled code must be given it).
    """
    vocab = logits.shape[1]
    temperature, top_k, top_p, min_p = params.unbind(1)
    # A greedy row (temperature 0) of a batch samples at 1; its token is not used.
    scores = logits.float() / torch.where(temperature > 0, temperature, 1.0)[:, None]
    if sort_all or bool(((top_k > 0) | (top_p < 1.0)).any()):
        order = _best_first(scores, top_k, sort_all)
        kth = scores.gather(1, order.gather(1, (top_k.long() - 1).clamp(0, order.shape[1] - 1)[:, None]))
        scores = torch.where((top_k[:, None] > 0) & (scores < kth), float("-inf"), scores)
        probs = torch.softmax(scores, dim=-1).double()
        ranked = probs.gather(1, order)
        kept = _within(ranked, top_p)
        if not sort_all and order.shape[1] < vocab and bool(((kept == order.shape[1]) & (top_p < 1.0)).any()):
            # A row whose prefix all falls within top_p: the tail may hold more.
            ranked = probs.gather(1, torch.sort(scores, dim=1, descending=True, stable=True).indices)
            kept = _within(ranked, top_p)
        cutoff = ranked.gather(1, (kept - 1).clamp(min=0)[:, None])
        scores = torch.where((top_p[:, None] < 1.0) & (probs < cutoff), float("-inf"), scores)
    # min_p = 0: log 0 = -inf, nothing below it.
    floor = scores.amax(1, keepdim=True) + torch.log(min_p)[:, None]
    scores = torch.where(scores < floor, float("-inf"), scores)
    return best_index(scores + gumbel(keys, vocab, ids), 1)


# Eager inside the compiled step: inductor (torch 2.11, Triton, dynamic
# shapes) fails to generate this split scan over gathered probabilities.
@torch.compiler.disable
def _within(ranked: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """How many of each row's best-first probabilities top-p keeps (at least one)."""
    before = torch.cumsum(ranked, dim=1) - ranked
    return (before < top_p[:, None].double()).sum(1)


def _best_first(scores: torch.Tensor, top_k: torch.Tensor, sort_all: bool) -> torch.Tensor:
    """Ids of each row's best scores, best first: all of them (``sort_all``),
    else at least the best ``_PREFIX`` and each row's top_k."""
    vocab = scores.shape[1]
    size = vocab if sort_all else min(vocab, max(_PREFIX, int(top_k.max())))
    if size == vocab:
        return torch.sort(scores, dim=1, descending=True, stable=True).indices
    return torch.topk(scores, size, dim=1).indices


def adjusted(logits: torch.Tensor, config: SamplingConfig, generated: list[int]) -> torch.Tensor:
    """The logits as vLLM's sampler (and generate()'s processors in its
    order) adjust them: ``logit_bias`` added, the repetition penalty on every
    token of the prompt and the output (divided where positive, multiplied
    where negative), then OpenAI's penalties on the tokens generated so far,
    a token's logit less ``frequency_penalty`` times its count and
    ``presence_penalty`` once it occurs."""
    out = logits.float()
    if config.logit_bias:
        ids = torch.tensor([t for t, _ in config.logit_bias], device=out.device)
        out = out.index_add(0, ids, torch.tensor([b for _, b in config.logit_bias], device=out.device))
    if config.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(config.prompt_ids).union(generated)), dtype=torch.long, device=out.device)
        if seen.numel():
            scores = out.index_select(0, seen)
            penalized = torch.where(scores < 0, scores * config.repetition_penalty, scores / config.repetition_penalty)
            out = out.index_copy(0, seen, penalized)
    if generated and (config.presence_penalty or config.frequency_penalty):
        counts = torch.bincount(torch.tensor(generated, device=out.device), minlength=out.shape[-1])[: out.shape[-1]]
        out = out - config.frequency_penalty * counts - config.presence_penalty * (counts > 0).float()
    return out


def greedy_choice(
    logits: torch.Tensor, config: SamplingConfig, index: int, eos_token_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """``select_token``'s greedy choice as a 0-dim tensor on the logits'
    device, not read back: a caller can queue its copy and read it later."""
    stops = stopping_ids(eos_token_ids, config)
    if stops is not None and index < config.min_tokens:
        if logits.device.type == "cpu":
            # Masking only lowers the stops' scores: a first choice that is no
            # stop is the masked row's first choice too, found without the
            # row's copy (a NaN counts as the max both ways). Where reading
            # the choice back is free.
            chosen = best_index(logits.reshape(-1), 0)
            if not bool((stops == chosen).any()):
                return chosen
        logits = _without(logits, stops)
    return best_index(logits.reshape(-1), 0)


def stopping_ids(eos_token_ids: torch.Tensor | None, config: SamplingConfig) -> torch.Tensor | None:
    """The ids masked below ``min_tokens``: the model's EOS and the request's
    ``stop_token_ids`` (vLLM masks both)."""
    if not config.stop_token_ids:
        return eos_token_ids
    extra = torch.tensor(config.stop_token_ids, dtype=torch.long)
    if eos_token_ids is None:
        return extra
    return torch.cat([eos_token_ids, extra.to(eos_token_ids.device)])


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> Logprobs:
    """``token``'s log probability under the model's own distribution
    (``logits`` as the model gave them: no temperature, top-k/p or EOS
    masking, as vLLM's default raw logprobs), and the ``top`` most likely
    tokens' (first index on ties, as ``torch.topk``), in float32."""
    return rows_logprobs(logits[None], [token], top)[0]


def rows_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[Logprobs]:
    """``token_logprobs`` of each row of ``logits`` [rows, vocab] and its token."""
    # On the logits' own device: only the chosen and the best few come back to the host.
    logprobs = torch.log_softmax(logits.detach().float(), dim=-1)
    chosen = logprobs.gather(1, torch.tensor(tokens, device=logprobs.device)[:, None])[:, 0].tolist()
    if not top:
        return [Logprobs(lp) for lp in chosen]
    best = torch.topk(logprobs, top)
    ranked = zip(chosen, best.indices.tolist(), best.values.tolist(), strict=True)
    return [Logprobs(lp, tuple(zip(ids, values, strict=True))) for lp, ids, values in ranked]


def _without(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    # index_fill, not ``masked[ids] = -inf``: the indexing assignment waited for
    # the device on a GPU (a third of a deferred prefill's host time under load).
    return logits.index_fill(0, ids.to(logits.device), float("-inf"))
