"""Token selection: greedy, or temperature / top-k / top-p sampling, as a
request's ``SamplingConfig`` (stages/sampling.py) asks.

The random draw for the token at index ``i`` (0 = first generated token)
comes from a generator seeded with ``(seed, i)`` only, so a worker that takes
a request over after a crash and resumes at index ``i`` draws the same token
as the first attempt would have, given the same logits. The draw happens on
the CPU (one uniform number, inverse CDF in float64), so it does not depend on
the device's RNG either.
"""

from __future__ import annotations

import torch

from stages.sampling import Logprobs, SamplingConfig

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def token_seed(seed: int, index: int) -> int:
    """Seed of the draw for the token at `index`: a hash of (seed, index), 63 bits."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (index & _MASK64)) >> 1


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

    scores = logits.detach().to(device="cpu", dtype=torch.float32) / config.temperature
    probs, ids = _candidates(scores, config)
    if config.top_p < 1.0:
        # Keep the smallest prefix whose mass reaches top_p (at least one token).
        before = torch.cumsum(probs, dim=0) - probs
        probs = probs.masked_fill(before >= config.top_p, 0.0)
    if config.min_p > 0.0:
        # transformers' MinPLogitsWarper: relative to the most likely token,
        # so the same after top-k or top-p as before them.
        probs = probs.masked_fill(probs < config.min_p * probs.max(), 0.0)
    cdf = torch.cumsum(probs, dim=0)
    gen = torch.Generator(device="cpu").manual_seed(token_seed(config.seed, index))
    u = torch.rand((), generator=gen, dtype=torch.float64)
    # cdf[pick] > target >= cdf[pick - 1], so probs[pick] > 0; only a product
    # u * total that rounds up to total can run past the end.
    pick = int(torch.searchsorted(cdf, u * cdf[-1], right=True).item())
    if pick >= cdf.numel():
        pick = int(torch.nonzero(probs > 0).flatten()[-1])
    return int(ids[pick]) if ids is not None else pick


_TOP_P_PREFIXES = (1024, 16384)


def _candidates(scores: torch.Tensor, config: SamplingConfig) -> tuple[torch.Tensor, torch.Tensor | None]:
    """float64 probabilities of the tokens still in play, and their ids (None: all, in id order).

    With top-k or top-p the candidates come sorted by descending score. A
    full sort of the vocabulary costs ~20 ms on a CPU, so top-p first tries
    the best 1024, then 16384 tokens, and sorts everything only if those hold
    less than top_p of the mass.
    """
    vocab = scores.numel()
    if 0 < config.top_k < vocab:
        values, ids = torch.topk(scores, config.top_k)
        return torch.softmax(values, dim=0).double(), ids
    if config.top_p >= 1.0:
        return torch.softmax(scores, dim=0).double(), None
    log_total = torch.logsumexp(scores, dim=0)
    for size in _TOP_P_PREFIXES:
        if size >= vocab:
            break
        values, ids = torch.topk(scores, size)
        probs = torch.exp(values - log_total).double()
        if float(probs.sum()) >= config.top_p:
            return probs, ids
    values, ids = torch.sort(scores, descending=True, stable=True)
    return torch.exp(values - log_total).double(), ids


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
        logits = _without(logits, stops)
    return torch.argmax(logits)


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
