"""``sample_rows``: the draw the batched step and the host's single choice
share. A row's token depends on its own logits, parameters and draw only,
the shortcut a CPU takes (the best 1024 first) gives what a full sort
gives, and the draws follow the kept tokens' probabilities."""

from __future__ import annotations

import math

import pytest
import torch

from stages.sampling import SamplingConfig
from stages.torch_engine.sampling import best_index, draw_key, greedy_choice, gumbel, sample_rows, uniform, weyl


def _params(*rows: tuple[float, float, float, float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def _logits(rows: int, vocab: int, scale: float, seed: int) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


ROWS = [
    (1.0, 0.0, 1.0, 0.0),  # plain temperature
    (0.7, 40.0, 1.0, 0.0),  # top-k
    (1.3, 0.0, 0.8, 0.0),  # top-p
    (1.0, 0.0, 1.0, 0.2),  # min-p
    (1.1, 3000.0, 0.95, 0.01),  # all of them, a top-k past the 1024 a CPU sorts first
]


@pytest.mark.parametrize("scale", [0.5, 8.0], ids=["flat", "peaked"])
@pytest.mark.parametrize("sort_all", [False, True], ids=["best-first", "sorted"])
def test_a_row_draws_the_same_token_in_any_batch(scale: float, sort_all: bool) -> None:
    logits = _logits(len(ROWS), 5000, scale, seed=1)
    params = _params(*ROWS)
    for index in range(6):
        bits = torch.tensor([draw_key(seed, index) for seed in range(len(ROWS))])
        together = sample_rows(logits, params, bits, sort_all).tolist()
        alone = [sample_rows(logits[i : i + 1], params[i : i + 1], bits[i : i + 1], sort_all).item() for i in range(5)]
        assert together == alone
        # The other way of finding top-p's and top-k's tokens gives the same.
        assert together == sample_rows(logits, params, bits, not sort_all).tolist()


def test_top_k_top_p_and_min_p_keep_what_they_say() -> None:
    vocab = 64
    logits = _logits(1, vocab, 3.0, seed=2)
    ranked = logits[0].argsort(descending=True).tolist()
    probs = torch.softmax(logits[0].double(), 0)

    def drawn(params: tuple[float, float, float, float]) -> set[int]:
        p = _params(params)
        return {int(sample_rows(logits, p, torch.tensor([draw_key(9, i)]), False)) for i in range(400)}

    assert drawn((1.0, 3.0, 1.0, 0.0)) == set(ranked[:3])
    # top-p: the smallest best-first prefix whose mass reaches 0.5.
    mass = probs[ranked].cumsum(0)
    keep = int((mass - probs[ranked] < 0.5).sum())
    assert drawn((1.0, 0.0, 0.5, 0.0)) == set(ranked[:keep])
    assert drawn((1.0, 0.0, 1.0, 0.3)) == {i for i in range(vocab) if probs[i] >= 0.3 * probs.max()}
    # top-k 1 is the argmax.
    assert drawn((0.5, 1.0, 1.0, 0.0)) == {ranked[0]}


def test_draws_follow_the_probabilities() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()[None]
    draws = 4000
    counts = torch.zeros(4)
    for index in range(draws):
        counts[int(sample_rows(logits, _params((1.0, 0.0, 1.0, 0.0)), torch.tensor([draw_key(3, index)]), False))] += 1
    # Within 4 standard deviations of a binomial, each token.
    sd = (draws * probs * (1 - probs)).sqrt()
    assert ((counts - draws * probs).abs() < 4 * sd).all(), counts


def test_the_noise_is_fixed_by_seed_and_index_and_gumbel() -> None:
    assert draw_key(11, 4) == draw_key(11, 4)
    assert len({draw_key(11, i) for i in range(100)} | {draw_key(12, 0)}) == 101
    keys = torch.tensor([draw_key(11, 4), draw_key(11, 5)])
    noise = gumbel(keys, 200_000)
    assert torch.equal(noise, gumbel(keys, 200_000))
    assert torch.equal(noise[1:], gumbel(keys[1:], 200_000))
    # Standard Gumbel: mean Euler's constant, standard deviation pi / sqrt(6).
    assert math.isclose(float(noise.mean()), 0.5772, abs_tol=0.01)
    assert math.isclose(float(noise.std()), math.pi / math.sqrt(6), abs_tol=0.01)
    # Independent of each other: no correlation between rows or neighbours.
    assert abs(float(torch.corrcoef(noise)[0, 1])) < 0.01
    assert abs(float(torch.corrcoef(torch.stack([noise[0, :-1], noise[0, 1:]]))[0, 1])) < 0.01


def test_compiled_draws_equal_eager() -> None:
    """What a GPU's step runs (compiled), on the CPU's compiler."""
    logits = _logits(len(ROWS), 3000, 2.0, seed=4)
    keys = torch.tensor([draw_key(8, i) for i in range(len(ROWS))])
    compiled = torch.compile(sample_rows, dynamic=True)
    for sort_all in (True, False):
        assert torch.equal(
            compiled(logits, _params(*ROWS), keys, sort_all), sample_rows(logits, _params(*ROWS), keys, sort_all)
        )


def test_the_noise_is_finite_at_the_ends() -> None:
    """The lowest and highest 32-bit values give numbers strictly within (0,
    1), so no noise is infinite: a masked token's -inf score plus infinite
    noise would be NaN, which argmax takes for the best."""
    ends = uniform(torch.tensor([0, 1, 2**32 - 2, 2**32 - 1]))
    assert ((ends > 0) & (ends < 1)).all(), ends
    assert torch.isfinite(-torch.log(-torch.log(ends))).all()
    # Masked tokens are never drawn, whatever the noise.
    logits = torch.full((1, 50_000), float("-inf"))
    logits[0, 7] = 0.0
    logits[0, 49_000] = 0.0
    drawn = {
        int(sample_rows(logits, _params((1.0, 0.0, 1.0, 0.0)), torch.tensor([draw_key(1, i)]), False))
        for i in range(200)
    }
    assert drawn == {7, 49_000}


def test_the_compiled_step_draws_what_the_host_draws() -> None:
    """The step compiles ``sample_rows`` with the ids' hash term made ahead
    (on a GPU, inductor cannot fold it into an int32 index: Triton refused
    the constant); the compiled draw is the eager one, token for token."""
    compiled = torch.compile(sample_rows, dynamic=True)
    logits = _logits(len(ROWS), 5000, 2.0, seed=5)
    params = _params(*ROWS)
    ids = weyl(5000)
    for index in range(3):
        keys = torch.tensor([draw_key(seed, index) for seed in range(len(ROWS))])
        assert torch.equal(compiled(logits, params, keys, True, ids), sample_rows(logits, params, keys, True))
    assert torch.equal(gumbel(keys, 5000, ids), gumbel(keys, 5000))


def test_best_index_is_the_first_of_tied_maxima_in_every_row() -> None:
    # Rows of few distinct values tie often; the greedy token must be
    # generate()'s (torch.argmax: the first of the tied), -inf and NaN rows too.
    scores = torch.randint(0, 3, (33, 4099), generator=torch.Generator().manual_seed(4)).float()
    scores[1] = 2.0
    scores[2] = float("-inf")
    scores[3, 7], scores[3, 4000] = float("nan"), float("nan")
    scores[4, 4098] = 9.0
    chosen = best_index(scores)
    assert torch.equal(chosen, scores.argmax(-1))
    assert chosen[1] == 0 and chosen[4] == 4098
    assert torch.equal(best_index(scores.t(), 0), chosen)


@pytest.mark.parametrize("vocab", [151936, 151939, 4096], ids=["whole-blocks", "with-a-tail", "one-vocab-of-blocks"])
def test_best_index_over_a_vocabulary_is_max_s_index_wherever_the_maximum_lies(vocab: int) -> None:
    # On CPU a vocabulary's argmax is found by blocks: each case below puts
    # the row's maximum somewhere the blocks could miss or misorder it.
    scores = _logits(12, vocab, 1.0, seed=5)
    scores[0, 0] = 50.0  # the very first score
    scores[1, vocab - 1] = 50.0  # the last, in the tail where there is one
    scores[2, 300], scores[2, vocab - 300] = 50.0, 50.0  # tied in two blocks: the first
    scores[3, 129], scores[3, 130] = 50.0, 50.0  # tied in one block: the first
    scores[4, 127], scores[4, 128] = 50.0, 50.0  # tied across a block's edge
    scores[5] = -3.0  # every score tied
    scores[6, 17] = float("inf")
    scores[7, 4000] = float("nan")  # a NaN wins, as max says
    scores[8, vocab - 2], scores[8, 64] = 50.0, 50.0  # tied, one in the tail
    expected = scores.max(-1).indices
    assert torch.equal(best_index(scores), expected)
    # As a step computes them on CPU: a [vocab, rows] product, seen as rows.
    vocab_major = scores.t().contiguous().t()
    assert torch.equal(best_index(vocab_major), expected)
    assert int(expected[0]) == 0 and int(expected[2]) == 300 and int(expected[4]) == 127 and int(expected[7]) == 4000
    for row in range(12):
        assert int(best_index(scores[row], 0)) == int(expected[row])


def test_the_greedy_choice_below_min_tokens_is_the_best_token_that_is_no_stop() -> None:
    """Below ``min_tokens`` the EOS ids and the stop ids are masked (as
    transformers' MinNewTokensLogitsProcessor, as vLLM): on CPU the row is
    copied only where its first choice is a stop. Each case against the
    masked row's own first maximum."""
    vocab, eos = 151936, torch.tensor([151643, 151645])
    config = SamplingConfig(max_tokens=8, min_tokens=4, stop_token_ids=[7])
    rows = _logits(9, vocab, 1.0, seed=6)
    rows[0, 151645] = 50.0  # an EOS is the best: the next best is chosen
    rows[1, 151643], rows[1, 9] = 50.0, 50.0  # tied with an EOS before it: the later one
    rows[2, 9], rows[2, 151643] = 50.0, 50.0  # tied, the EOS after it: the first
    rows[3, 7] = 50.0  # a request's stop id is masked too
    rows[4, 151645] = float("nan")  # a NaN at a stop is masked away
    rows[5, 11] = float("nan")  # a NaN elsewhere wins, as max says
    rows[6, 151643], rows[6, 151645], rows[6, 7] = 50.0, 49.0, 48.0  # every stop above the rest
    rows[7] = -2.0  # all tied: the first
    for i, row in enumerate(rows):
        masked = row.index_fill(0, torch.tensor([151643, 151645, 7]), float("-inf"))
        expected = int(masked.max(0).indices)
        assert int(greedy_choice(row, config, 0, eos)) == expected, i
        # From min_tokens on nothing is masked.
        assert int(greedy_choice(row, config, 4, eos)) == int(row.max(0).indices), i
    assert int(greedy_choice(rows[1], config, 0, eos)) == 9
    assert int(greedy_choice(rows[5], config, 0, eos)) == 11
