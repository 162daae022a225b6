"""Tokens → ``TokenChunk``s: ``seq``, text deltas, stop strings, finish, usage."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from schemas.chunk import FinishReason, PromptLogprobs, TokenChunk, TokenLogprob, TopLogprob, Usage
from schemas.processed import ProcessedRequest
from schemas.request import SamplingParams
from stages.detokenizer import IncrementalDetokenizer, StopStringMatcher
from stages.sampling import Logprobs


class ChunkEmitter:
    """One request's chunks, from the token after ``emitted`` on.

    Primed with what an earlier attempt or hop emitted: the detokenizer and
    the stop strings then hold back exactly what they held back then (a
    character cut in half, the start of a stop string), so the text of a
    resumed stream joins the earlier text seamlessly and a stop string
    across the join is still found.
    """

    def __init__(
        self,
        engine: Any,
        req: ProcessedRequest,
        prompt_len: int,
        emitted: list[int],
        cached_tokens: Callable[[], int] = lambda: 0,
    ) -> None:
        # The whole text a client has of the answer, kept where a later stage
        # takes it as its prompt (an image to draw); not on other requests' token path.
        self._keeps_text = req.stage_after_text is not None
        self.text = ""
        self._is_eos = eos_check(engine.eos_token_ids, req.request.sampling)
        self._stop_ids = frozenset(req.request.sampling.stop_token_ids)
        self._max_tokens = req.max_tokens
        self._rid = req.request.request_id
        self._prompt_len = prompt_len
        # Read as each usage goes out: an engine may learn its prefix cache's hits only with its first token.
        self._cached_tokens = cached_tokens
        self._tokenizer = engine.tokenizer
        self._detok = IncrementalDetokenizer(engine.tokenizer)
        self._stops = StopStringMatcher(req.request.sampling.stop)
        for token in emitted:
            text = self._stops.feed(self._detok.push(token))[0]
            if self._keeps_text:
                self.text += text
        self.index = len(emitted)
        self._prompt_ids = req.prompt_token_ids

    def is_eos(self, token: int) -> bool:
        """Whether ``token`` ends the sequence: the model's EOS (unless
        ignore_eos) or one of the request's stop_token_ids."""
        return self._is_eos(token)

    def push(
        self, token: int, logprobs: Logprobs | None = None, prompt_logprobs: list[Logprobs] | None = None
    ) -> TokenChunk:
        """The chunk of the next token (with its ``logprobs``, where asked
        for, and on the first chunk the prompt's, where given)."""
        seq = self.index
        self.index += 1
        finish: FinishReason | None = None
        if self.is_eos(token):
            finish = FinishReason.STOP
        elif self.index >= self._max_tokens:
            finish = FinishReason.LENGTH
        # A stop token id is left out of the text, as vLLM leaves it (EOS decodes to nothing anyway).
        text, hit_stop = self._stops.feed("" if token in self._stop_ids else self._detok.push(token))
        if hit_stop:
            finish = FinishReason.STOP
        elif finish is not None:
            more, hit_stop = self._stops.feed(self._detok.flush())
            text += more if hit_stop else more + self._stops.flush()
        chunk = self._chunk(seq, [token], text, finish)
        if logprobs is not None:
            chunk.logprobs = [self._logprob(token, logprobs)]
        if seq == 0 and prompt_logprobs is not None:
            ids = self._prompt_ids
            tokens_after = zip(ids[1:], prompt_logprobs, strict=True)
            chunk.prompt_logprobs = PromptLogprobs(
                self._text(ids[0]), [self._logprob(token, lp) for token, lp in tokens_after]
            )
        return chunk

    def _logprob(self, token: int, logprobs: Logprobs) -> TokenLogprob:
        # Each token as text alone, special tokens shown: OpenAI's ``token`` fields.
        top = [TopLogprob(t, self._text(t), lp) for t, lp in logprobs.top]
        return TokenLogprob(token, self._text(token), logprobs.logprob, top)

    def _text(self, token: int) -> str:
        return str(self._tokenizer.decode([token]))

    def finish_now(self) -> TokenChunk:
        """The final chunk of a request whose every token was already emitted."""
        return self._chunk(self.index, [], self._stops.feed(self._detok.flush())[0], FinishReason.LENGTH)

    def _chunk(self, seq: int, tokens: list[int], text: str, finish: FinishReason | None) -> TokenChunk:
        if self._keeps_text:
            self.text += text
        # The first chunk carries the prompt's size too: a relay can then
        # report usage with every chunk (continuous_usage_stats).
        counted = finish is not None or seq == 0
        usage = Usage(self._prompt_len, seq + len(tokens), self._cached_tokens()) if counted else None
        return TokenChunk(request_id=self._rid, seq=seq, token_ids=tokens, text=text, finish_reason=finish, usage=usage)


def eos_check(eos_token_ids: Collection[int], sampling: SamplingParams) -> Callable[[int], bool]:
    """Whether a token ends a request's sequence: the model's EOS (unless
    ``ignore_eos``) or one of its ``stop_token_ids``."""
    eos = frozenset(() if sampling.ignore_eos else eos_token_ids)
    stops = frozenset(sampling.stop_token_ids)
    return lambda token: token in eos or token in stops
