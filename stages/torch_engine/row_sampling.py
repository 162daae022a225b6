"""What a batched step does besides a plain argmax, on the device, per row:
OpenAI's ``logit_bias``, vLLM's repetition penalty and OpenAI's presence
and frequency penalties before the choice, the choice itself where the row
samples (temperature, top-k, top-p, min-p at the row's seeded draw), and the
chosen token's logprob and the best ``MAX_TOP`` after it. The host gives a row its
request's parameters when the sequence takes the row; the tokens it
generates are counted here, on the device, as the steps feed them, so the
decode loop still queues a step before the host has read the last one.

The formulas are the host's (stages/torch_engine/sampling.py: ``adjusted``,
``sample_rows`` and ``token_logprobs``), element for element, so a row gives
the same token and logprobs either way. On a GPU the penalties, bias and
logprobs are one compiled function (its elementwise passes over the rows'
vocabulary fused) and the draw another, both in the step's CUDA graph.
"""

from __future__ import annotations

import torch

from stages.sampling import SamplingConfig
from stages.torch_engine.sampling import best_index, sample_rows, sampling_params, weyl

# The most likely tokens a step reports for each row (OpenAI's and vLLM's cap).
MAX_TOP = 20
# logit_bias entries a row takes on the device; a request with more chooses on the host.
MAX_BIAS = 300


def fits(config: SamplingConfig) -> bool:
    """Whether a request's adjustments and logprobs can run in the batched step."""
    return len(config.logit_bias) <= MAX_BIAS and (config.logprobs or 0) <= MAX_TOP


class RowSampling:
    """Per row of the batch decoder: its parameters, its generated tokens'
    counts and whether each token is in its prompt; and the last step's
    ``reports``. ``eos``: the ids a row masks below its min_tokens.
    ``compile``: torch.compile the step's part (on a GPU)."""

    def __init__(self, max_slots: int, vocab: int, device: torch.device, eos: list[int], compile: bool = False) -> None:
        self.vocab = vocab
        self.device = device
        self.counts = torch.zeros(max_slots, vocab, dtype=torch.int32, device=device)
        self.in_prompt = torch.zeros(max_slots, vocab, dtype=torch.bool, device=device)
        # Per row: presence, frequency, repetition (1: none); one tensor, one copy per row set.
        self.params = torch.zeros(max_slots, 3, dtype=torch.float32, device=device)
        self.params[:, 2] = 1.0
        # Per row: temperature (0: greedy), top_k, top_p, min_p (sampling.sample_rows).
        self.sampling = torch.zeros(max_slots, 4, dtype=torch.float32, device=device)
        self.sort_all = device.type != "cpu"
        # logit_bias as (id, bias) pairs, padded with (0, 0.0): a scatter-add of nothing.
        self.bias_ids = torch.zeros(max_slots, MAX_BIAS, dtype=torch.long, device=device)
        self.bias = torch.zeros(max_slots, MAX_BIAS, dtype=torch.float32, device=device)
        self.is_eos = torch.zeros(vocab, dtype=torch.bool, device=device)
        if eos:
            self.is_eos[eos] = True
        # The last step's reports, a row each: the chosen token's logprob, the
        # best MAX_TOP ids (as floats: exact below 2**24), their logprobs. One
        # tensor, so they come to the host in one copy.
        if vocab >= 1 << 24:
            raise ValueError(f"a vocabulary of {vocab} tokens: ids past 2**24 are not exact in float32")
        self.reports = torch.zeros(max_slots, 1 + 2 * MAX_TOP, dtype=torch.float32, device=device)
        self._choose = torch.compile(choose, dynamic=True) if compile else choose
        # Apart from ``choose``: a step with no row sampling leaves it out.
        # (Top-p's cumulative sum runs eager within it: sampling._within.)
        self._sample = torch.compile(sample_rows, dynamic=True) if compile else sample_rows
        # The draws' per-token hash term, made here once (sampling.weyl says why).
        self.weyl = weyl(vocab, device)

    # Made where a step runs, in inference mode: their tensors are changed in it too.
    @torch.inference_mode()
    def set_row(self, row: int, config: SamplingConfig, counted: list[int]) -> None:
        """Row ``row`` now runs a sequence of ``config`` whose generated
        tokens ``counted`` are already counted (the rest it feeds in its
        steps). A row without penalties keeps the last one's counts: at
        neutral parameters they change nothing."""
        pinned = self.device.type == "cuda"
        params = torch.tensor([config.presence_penalty, config.frequency_penalty, config.repetition_penalty])
        self.params[row].copy_(params, non_blocking=pinned)
        self.sampling[row].copy_(torch.tensor(sampling_params(config)), non_blocking=pinned)
        ids = torch.zeros(MAX_BIAS, dtype=torch.long)
        bias = torch.zeros(MAX_BIAS, dtype=torch.float32)
        if config.logit_bias:
            ids[: len(config.logit_bias)] = torch.tensor([t for t, _ in config.logit_bias])
            bias[: len(config.logit_bias)] = torch.tensor([b for _, b in config.logit_bias])
        self.bias_ids[row].copy_(ids, non_blocking=pinned)
        self.bias[row].copy_(bias, non_blocking=pinned)
        if not config.penalizes:
            return
        counts = torch.bincount(torch.tensor(counted, dtype=torch.long), minlength=self.vocab)[: self.vocab]
        self.counts[row].copy_(counts.to(torch.int32), non_blocking=pinned)
        mask = torch.zeros(self.vocab, dtype=torch.bool)
        if config.prompt_ids:
            mask[list(config.prompt_ids)] = True
        self.in_prompt[row].copy_(mask, non_blocking=pinned)

    @torch.inference_mode()
    def move_row(self, src: int, dst: int) -> None:
        for t in (self.counts, self.in_prompt, self.params, self.sampling, self.bias_ids, self.bias):
            t[dst].copy_(t[src])

    def step(
        self,
        bucket: int,
        logits: torch.Tensor,
        fed: torch.Tensor,
        asked: torch.Tensor,
        mask_eos: torch.Tensor,
        draws: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Rows ``0..bucket-1``'s choices (a row not asked keeps its ``fed``
        token): each asked row's fed token counted first (a row not asked
        feeds the same token again later), then its bias and penalties, EOS
        masked below min_tokens, the argmax, or with ``draws`` (each row's
        ``draw_key`` for this token) a sample where the row's temperature
        is not 0; and the reports, of the model's own logits (vLLM's raw
        logprobs)."""
        asked = asked[:bucket] > 0
        self.counts[:bucket].scatter_add_(1, fed[:, None], asked[:, None].to(torch.int32))
        sampled, reports, adjusted, logprobs = self._choose(
            logits,
            fed,
            asked,
            mask_eos[:bucket] > 0,
            self.is_eos,
            self.params[:bucket],
            self.bias_ids[:bucket],
            self.bias[:bucket],
            self.counts[:bucket],
            self.in_prompt[:bucket],
            draws is not None,
        )
        if draws is not None:
            assert adjusted is not None and logprobs is not None
            drawn = self._sample(adjusted, self.sampling[:bucket], draws[:bucket], self.sort_all, self.weyl)
            sampled = torch.where(asked & (self.sampling[:bucket, 0] > 0), drawn, sampled)
            reports[:, 0] = logprobs.gather(1, sampled[:, None])[:, 0]
        self.reports[:bucket] = reports
        return sampled


def choose(
    logits: torch.Tensor,
    fed: torch.Tensor,
    asked: torch.Tensor,
    mask_eos: torch.Tensor,
    is_eos: torch.Tensor,
    params: torch.Tensor,
    bias_ids: torch.Tensor,
    bias: torch.Tensor,
    counts: torch.Tensor,
    in_prompt: torch.Tensor,
    samples: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``RowSampling.step``'s arithmetic, as the host's ``adjusted``,
    ``select_token`` (greedy) and ``token_logprobs`` do it. Where rows may
    sample (``samples``), the adjusted logits and the logprobs too, to draw
    from and to report the drawn token's."""
    x = logits.float()
    # torch's own log-softmax, as the host's and transformers' reference:
    # another way of summing 150k terms in float32 differs from it by 1e-5.
    logprobs = torch.log_softmax(x, dim=-1)
    best = torch.topk(logprobs, MAX_TOP)
    out = x.scatter_add(1, bias_ids, bias)
    presence, frequency, repetition = params.unbind(1)
    seen = in_prompt | (counts > 0)
    rep = repetition[:, None]
    out = torch.where(seen, torch.where(out < 0, out * rep, out / rep), out)
    out = out - frequency[:, None] * counts - presence[:, None] * (counts > 0).float()
    out = torch.where(mask_eos[:, None] & is_eos[None, :], float("-inf"), out)
    sampled = torch.where(asked, best_index(out), fed)
    chosen = logprobs.gather(1, sampled[:, None])
    reports = torch.cat([chosen, best.indices.float(), best.values], dim=1)
    if samples:
        return sampled, reports, out, logprobs
    return sampled, reports, None, None
