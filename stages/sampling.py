"""The sampling a request asks for, as both engines take it: greedy, or
temperature / top-k / top-p, a seed, min_tokens, ignore_eos, max_tokens.
Plain data, checked on construction. How the built-in engine draws a token
by it: stages/torch_engine/sampling.py."""

from __future__ import annotations

from dataclasses import dataclass

from schemas.errors import InvalidRequest
from schemas.request import StructuredOutput


@dataclass(frozen=True)
class Logprobs:
    """A chosen token's log probability, and the most likely tokens' (id,
    logprob) at its step, best first."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # <= 0: no top-k
    seed: int = 0
    min_tokens: int = 0  # EOS is masked until this many tokens were generated
    ignore_eos: bool = False  # EOS may be sampled but does not stop the sequence
    max_tokens: int = 16
    # Each chosen token's logprob and this many most likely tokens' (None: none).
    logprobs: int | None = None
    # OpenAI's penalties on the tokens generated so far, and its logit_bias (token id, bias).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    # vLLM's repetition penalty, over the prompt's ids (``prompt_ids``,
    # distinct) and the tokens generated so far.
    repetition_penalty: float = 1.0
    prompt_ids: tuple[int, ...] = ()
    min_p: float = 0.0
    # They end the sequence as EOS does, and are masked as EOS is below min_tokens.
    stop_token_ids: tuple[int, ...] = ()
    # What the answer must match (the built-in engine masks each step by its grammar).
    structured: StructuredOutput | None = None
    # The prompt's logprobs too, with this many most likely tokens at each place (None: not asked).
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise InvalidRequest(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}")
        if self.min_tokens < 0:
            raise InvalidRequest(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not self.repetition_penalty > 0.0:
            raise InvalidRequest(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequest(f"min_p must be within [0, 1], got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def on_device(self) -> bool:
        """Whether a step may choose the token on the device, never showing
        the host its logits: greedy, no logprobs to compute from them, and
        nothing that changes them first."""
        return self.greedy and self.batchable and self.logprobs is None and not self.adjusts

    @property
    def batchable(self) -> bool:
        """Whether a batched decode step may choose the token on the device,
        sampling, penalties, bias and logprobs included (see
        stages/torch_engine/row_sampling.py): no grammar, and no stop ids to
        mask below min_tokens (the step masks the model's EOS only)."""
        masks_more = bool(self.stop_token_ids) and self.min_tokens > 0
        return self.structured is None and not masks_more

    @property
    def adjusts(self) -> bool:
        """Whether the logits change before the choice: penalties or a bias."""
        return self.penalizes or bool(self.logit_bias)

    @property
    def penalizes(self) -> bool:
        """Whether a penalty reads the tokens so far (presence, frequency, repetition)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)
