"""Unit tests for tandem.layers.sampler.

Statistical tests draw N = 20_000 samples in one call (a batch of N identical rows) from a
fixed torch seed, so they are deterministic. Tolerance: the per-token frequency std is at
most sqrt(0.25 / N) ~= 0.0035, and we allow TOL = 0.015 (> 4 sigma) max abs deviation;
a chi-square test at p > 1e-4 is applied as well.
"""
from __future__ import annotations

import math

import pytest
import torch
from scipy import stats

from tandem.layers.sampler import (
    LogprobsTensors,
    Sampler,
    SamplingMetadata,
    gather_logprobs,
)

N = 20_000
TOL = 0.015
CHI2_P_MIN = 1e-4


def make_metadata(
    batch: int,
    temperature: float | list[float] = 1.0,
    *,
    top_k: int | list[int] | None = None,
    top_p: float | list[float] | None = None,
    min_p: float | list[float] | None = None,
    repetition_penalty: list[float] | None = None,
    frequency_penalty: list[float] | None = None,
    presence_penalty: list[float] | None = None,
    prompt_token_ids: torch.Tensor | None = None,
    output_token_ids: torch.Tensor | None = None,
    seeds: dict[int, tuple[int, int]] | None = None,
    min_tokens_mask: list[tuple[int, list[int]]] | None = None,
    max_num_logprobs: int | None = None,
) -> SamplingMetadata:
    """``seeds``: row -> (seed, output index); ``min_tokens_mask``: (row, ids to forbid)."""
    def vec(v, dtype):
        if v is None:
            return None
        if not isinstance(v, list):
            v = [v] * batch
        return torch.tensor(v, dtype=dtype)

    temp = vec(temperature, torch.float32)
    greedy = temp == 0
    seed_rows = sorted(seeds or {})
    pairs = [(row, t) for row, ids in (min_tokens_mask or []) for t in ids]
    return SamplingMetadata(
        temperature=temp,
        all_greedy=bool(greedy.all()),
        all_random=not bool(greedy.any()),
        top_k=vec(top_k, torch.int64),
        top_p=vec(top_p, torch.float32),
        min_p=vec(min_p, torch.float32),
        repetition_penalty=vec(repetition_penalty, torch.float32),
        frequency_penalty=vec(frequency_penalty, torch.float32),
        presence_penalty=vec(presence_penalty, torch.float32),
        prompt_token_ids=prompt_token_ids,
        output_token_ids=output_token_ids,
        max_num_logprobs=max_num_logprobs,
        seeded_rows=torch.tensor(seed_rows, dtype=torch.int64) if seed_rows else None,
        seeds=torch.tensor([seeds[r][0] for r in seed_rows], dtype=torch.int64) if seed_rows else None,
        output_index=torch.tensor([seeds[r][1] for r in seed_rows], dtype=torch.int64) if seed_rows else None,
        min_tokens_rows=torch.tensor([r for r, _ in pairs], dtype=torch.int64) if pairs else None,
        min_tokens_cols=torch.tensor([t for _, t in pairs], dtype=torch.int64) if pairs else None,
    )


def sample_freqs(logits_row: torch.Tensor, **kwargs) -> torch.Tensor:
    """Empirical token frequencies from N draws of one distribution."""
    vocab = logits_row.numel()
    logits = logits_row.unsqueeze(0).expand(N, vocab).contiguous()
    out = Sampler()(logits, make_metadata(N, **kwargs))
    assert out.sampled_token_ids.shape == (N,)
    assert out.sampled_token_ids.dtype == torch.int64
    return torch.bincount(out.sampled_token_ids, minlength=vocab).double() / N


def assert_matches(freqs: torch.Tensor, expected: torch.Tensor) -> None:
    expected = expected.double()
    # Tokens with zero expected mass must never appear.
    assert torch.all(freqs[expected == 0] == 0), (freqs, expected)
    diff = (freqs - expected).abs().max().item()
    assert diff < TOL, f"max abs diff {diff} >= {TOL}: {freqs} vs {expected}"
    support = expected > 0
    if support.sum() > 1:
        observed = (freqs[support] * N).numpy()
        exp_counts = (expected[support] / expected[support].sum() * N).numpy()
        _, pvalue = stats.chisquare(observed, exp_counts)
        assert pvalue > CHI2_P_MIN, f"chi-square p={pvalue}: {freqs} vs {expected}"


LOGITS8 = torch.tensor([1.0, 2.0, 0.5, -1.0, 3.0, 0.0, 1.5, -0.5])


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(1234)


# ----------------------------------------------------------------------------- greedy


@pytest.mark.timeout(60)
def test_greedy_is_argmax() -> None:
    logits = torch.randn(16, 50)
    out = Sampler()(logits, make_metadata(16, 0.0))
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.logprobs is None


@pytest.mark.timeout(60)
def test_all_greedy_consumes_no_randomness() -> None:
    logits = torch.randn(4, 20)
    state = torch.get_rng_state()
    Sampler()(logits, make_metadata(4, 0.0, top_k=3, top_p=0.5))
    assert torch.equal(state, torch.get_rng_state())


@pytest.mark.timeout(60)
def test_mixed_greedy_random_keeps_greedy_rows_exact() -> None:
    batch, vocab = 64, 30
    logits = torch.randn(batch, vocab)
    temps = [0.0 if i % 2 == 0 else 1.5 for i in range(batch)]
    md = make_metadata(batch, temps, top_k=5)
    assert not md.all_greedy and not md.all_random
    for _ in range(20):
        out = Sampler()(logits, md).sampled_token_ids
        assert torch.equal(out[0::2], logits[0::2].argmax(-1))
    # The random rows really are random: across trials they are not all the argmax.
    outs = torch.stack([Sampler()(logits, md).sampled_token_ids for _ in range(20)])
    assert (outs[:, 1::2] != logits[1::2].argmax(-1)).any()


@pytest.mark.timeout(60)
def test_does_not_modify_input_logits() -> None:
    logits = torch.randn(3, 10)
    before = logits.clone()
    md = make_metadata(
        3, [0.7, 0.0, 1.0], top_k=3, top_p=0.8, min_p=0.1,
        repetition_penalty=[1.3] * 3, frequency_penalty=[0.5] * 3, presence_penalty=[0.2] * 3,
        prompt_token_ids=torch.tensor([[1, 2], [3, 10], [10, 10]]),
        output_token_ids=torch.tensor([[4], [5], [10]]),
        min_tokens_mask=[(0, [0, 1])],
    )
    Sampler()(logits, md)
    assert torch.equal(logits, before)


# ------------------------------------------------------------------ random sampling


@pytest.mark.timeout(60)
@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_temperature_frequencies(temperature: float) -> None:
    freqs = sample_freqs(LOGITS8, temperature=temperature)
    assert_matches(freqs, torch.softmax(LOGITS8 / temperature, -1))


@pytest.mark.timeout(60)
def test_top_k_frequencies() -> None:
    k = 3
    freqs = sample_freqs(LOGITS8, temperature=1.0, top_k=k)
    top = LOGITS8.topk(k).indices
    expected = torch.zeros(8)
    expected[top] = torch.softmax(LOGITS8[top], -1)
    assert_matches(freqs, expected)
    outside = torch.ones(8, dtype=torch.bool)
    outside[top] = False
    assert freqs[outside].sum() == 0


@pytest.mark.timeout(60)
def test_top_k_disabled_rows_and_k1() -> None:
    # Row-wise k: 0 (disabled) keeps the full distribution; 1 is greedy.
    batch = 2 * N
    logits = LOGITS8.unsqueeze(0).expand(batch, 8).contiguous()
    ks = [0] * N + [1] * N
    out = Sampler()(logits, make_metadata(batch, 1.0, top_k=ks)).sampled_token_ids
    f0 = torch.bincount(out[:N], minlength=8).double() / N
    assert_matches(f0, torch.softmax(LOGITS8, -1))
    assert torch.all(out[N:] == LOGITS8.argmax())


def top_p_reference(probs: torch.Tensor, p: float) -> torch.Tensor:
    """Smallest set of most-likely tokens with cumulative mass >= p, renormalized."""
    order = probs.argsort(descending=True).tolist()
    keep, mass = [], 0.0
    for t in order:
        keep.append(t)
        mass += probs[t].item()
        if mass >= p:
            break
    out = torch.zeros_like(probs)
    out[keep] = probs[keep]
    return out / out.sum()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("p", [0.5, 0.8, 0.95])
def test_top_p_frequencies(p: float) -> None:
    freqs = sample_freqs(LOGITS8, temperature=1.0, top_p=p)
    expected = top_p_reference(torch.softmax(LOGITS8, -1), p)
    assert 1 <= int((expected > 0).sum()) < 8
    assert_matches(freqs, expected)


@pytest.mark.timeout(60)
def test_top_p_tiny_keeps_one_token() -> None:
    freqs = sample_freqs(LOGITS8, temperature=1.0, top_p=1e-6)
    assert freqs[LOGITS8.argmax()] == 1.0


@pytest.mark.timeout(60)
def test_top_k_then_top_p_on_renormalized_topk() -> None:
    # top-k=4 renormalized, then top-p=0.7 over that (vLLM order).
    k, p = 4, 0.7
    freqs = sample_freqs(LOGITS8, temperature=1.0, top_k=k, top_p=p)
    top = LOGITS8.topk(k).indices
    renorm = torch.zeros(8)
    renorm[top] = torch.softmax(LOGITS8[top], -1)
    expected = top_p_reference(renorm, p)
    assert_matches(freqs, expected)


@pytest.mark.timeout(60)
def test_min_p() -> None:
    min_p = 0.2
    freqs = sample_freqs(LOGITS8, temperature=1.0, min_p=min_p)
    probs = torch.softmax(LOGITS8, -1)
    kept = probs >= min_p * probs.max()
    assert 1 < int(kept.sum()) < 8
    assert freqs[~kept].sum() == 0
    expected = torch.where(kept, probs, torch.zeros_like(probs))
    assert_matches(freqs, expected / expected.sum())


@pytest.mark.timeout(60)
def test_min_p_applied_after_temperature() -> None:
    temperature, min_p = 2.0, 0.3
    freqs = sample_freqs(LOGITS8, temperature=temperature, min_p=min_p)
    probs = torch.softmax(LOGITS8 / temperature, -1)
    kept = probs >= min_p * probs.max()
    expected = torch.where(kept, probs, torch.zeros_like(probs))
    assert_matches(freqs, expected / expected.sum())


# -------------------------------------------------------------------------- seeding


def _seeded_draws(seed: int, logits_row: torch.Tensor, row: int, batch: int,
                  steps: int = 30) -> list[int]:
    """Sample `steps` tokens for a row seeded with `seed`, placed at `row` of a batch
    whose other rows are unseeded random rows."""
    logits = torch.randn(batch, logits_row.numel())
    logits[row] = logits_row
    return [int(Sampler()(logits, make_metadata(batch, 1.0, top_k=0, seeds={row: (seed, i)})).sampled_token_ids[row])
            for i in range(steps)]


@pytest.mark.timeout(60)
def test_seeded_reproducible_across_batch_composition() -> None:
    vocab = 1000
    row_logits = torch.zeros(vocab)  # uniform: coincidences are unlikely (1/1000)
    torch.manual_seed(1)
    alone = _seeded_draws(42, row_logits, row=0, batch=1)
    torch.manual_seed(2)  # the default RNG state must not matter
    in_batch = _seeded_draws(42, row_logits, row=3, batch=8)
    torch.manual_seed(3)
    in_batch2 = _seeded_draws(42, row_logits, row=0, batch=5)
    assert alone == in_batch == in_batch2
    other = _seeded_draws(43, row_logits, row=0, batch=1)
    assert sum(a != b for a, b in zip(alone, other)) >= 25


@pytest.mark.timeout(60)
def test_seeded_rows_independent_of_their_place_in_the_batch() -> None:
    vocab = 1000
    logits = torch.zeros(4, vocab)
    out = Sampler()(logits, make_metadata(4, 1.0, seeds={1: (7, 0), 2: (8, 0)})).sampled_token_ids
    # Every row seeded: no default-RNG draw is needed.
    state = torch.get_rng_state()
    out2 = Sampler()(logits[:2], make_metadata(2, 1.0, seeds={0: (8, 0), 1: (7, 0)})).sampled_token_ids
    assert torch.equal(state, torch.get_rng_state())
    assert int(out[1]) == int(out2[1]) and int(out[2]) == int(out2[0])


@pytest.mark.timeout(60)
def test_seeded_row_distribution() -> None:
    # A seeded row still samples from the right distribution (over many seeds).
    draws = []
    logits = LOGITS8.unsqueeze(0)
    md_base = dict(temperature=1.0)
    for seed in range(4000):
        md = make_metadata(1, seeds={0: (seed, 3)}, **md_base)
        draws.append(int(Sampler()(logits, md).sampled_token_ids[0]))
    freqs = torch.bincount(torch.tensor(draws), minlength=8).double() / len(draws)
    diff = (freqs - torch.softmax(LOGITS8, -1).double()).abs().max().item()
    assert diff < 0.035  # n=4000: std <= 0.008, > 4 sigma


def _splitmix64_reference(seed: int, output_index: int, col: int) -> float:
    """The seeded noise in plain Python integers (uint64 arithmetic), as the docstring says."""
    m = (1 << 64) - 1

    def mix(z: int) -> int:
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
        return z ^ (z >> 31)

    key = mix(mix((seed + 0x9E3779B97F4A7C15) & m) ^ ((output_index * 0xBF58476D1CE4E5B9 + 1) & m))
    z = mix((key + (col + 1) * 0x9E3779B97F4A7C15) & m)
    return -math.log(((z >> 40) + 0.5) / (1 << 24))


@pytest.mark.timeout(60)
def test_seeded_noise_is_the_documented_counter_hash() -> None:
    """torch's int64 arithmetic must wrap like uint64, on any device: compare with plain ints
    (negative and large seeds included), then check the noise is Exp(1)."""
    from tandem.layers.sampler import seeded_exponential

    seeds = torch.tensor([0, 1, -5, (1 << 63) - 1, -(1 << 63), 123456789], dtype=torch.int64)
    idx = torch.tensor([0, 7, 3, 1 << 40, 2, 99], dtype=torch.int64)
    got = seeded_exponential(seeds, idx, 16)
    want = torch.tensor([[_splitmix64_reference(int(s), int(i), c) for c in range(16)]
                         for s, i in zip(seeds.tolist(), idx.tolist())])
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=1e-6)
    big = seeded_exponential(torch.arange(64), torch.zeros(64, dtype=torch.int64), 4096)
    assert abs(big.mean().item() - 1.0) < 0.01 and abs(big.var().item() - 1.0) < 0.03
    _, p = stats.kstest(big.flatten()[:20000].numpy(), "expon")
    assert p > CHI2_P_MIN


@pytest.mark.timeout(60)
def test_zero_noise_never_picks_a_masked_token() -> None:
    """A seeded draw that is exactly 0 on a masked (-inf) token used to score 0/0 = NaN and
    win the race: seen as a grammar-masked token sampled under structured outputs."""
    from tandem.layers.sampler import seeded_exponential

    vocab, seed = 49152, 11
    noise = seeded_exponential(torch.full((512,), seed), torch.arange(512), vocab)
    hits = (noise == 0).nonzero()
    assert len(hits), "no zero draw in the scanned range: widen it"
    out_index, col = (int(x) for x in hits[0])
    logits = torch.zeros(1, vocab)
    logits[0, col] = float("-inf")
    md = make_metadata(1, 1.0, seeds={0: (seed, out_index)})
    assert int(Sampler()(logits, md).sampled_token_ids[0]) != col


# ------------------------------------------------------------------------ penalties


def penalties_reference(
    logits: torch.Tensor, prompt: list[list[int]], output: list[list[int]], vocab: int,
    rep: list[float], freq: list[float], pres: list[float],
) -> torch.Tensor:
    out = logits.clone().tolist()
    for b in range(len(out)):
        p_tokens = [t for t in prompt[b] if t != vocab]
        o_tokens = [t for t in output[b] if t != vocab]
        for t in range(vocab):
            x = out[b][t]
            if t in p_tokens or t in o_tokens:
                x = x / rep[b] if x > 0 else x * rep[b]
            c = o_tokens.count(t)
            x -= freq[b] * c
            x -= pres[b] * (1.0 if c > 0 else 0.0)
            out[b][t] = x
    return torch.tensor(out)


def _random_padded(batch: int, length: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    ids = torch.randint(0, vocab, (batch, length), generator=gen)
    lens = torch.randint(0, length + 1, (batch,), generator=gen)
    pad = torch.arange(length).unsqueeze(0) >= lens.unsqueeze(1)
    return ids.masked_fill(pad, vocab)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", range(5))
def test_penalties_match_reference(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    batch, vocab = 6, 17
    logits = torch.randn(batch, vocab, generator=gen) * 3
    prompt = _random_padded(batch, 9, vocab, gen)
    output = _random_padded(batch, 12, vocab, gen)
    rep = (torch.rand(batch, generator=gen) * 1.5 + 0.5).tolist()
    rep[0] = 1.0  # a row with no repetition penalty
    freq = (torch.rand(batch, generator=gen) * 4 - 2).tolist()
    pres = (torch.rand(batch, generator=gen) * 4 - 2).tolist()
    freq[1] = pres[1] = 0.0  # a row with no penalty at all

    expected = penalties_reference(logits, prompt.tolist(), output.tolist(), vocab,
                                   rep, freq, pres)
    md = make_metadata(
        batch, 0.0, repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres,
        prompt_token_ids=prompt, output_token_ids=output, max_num_logprobs=None,
    )
    from tandem.layers.sampler import apply_penalties

    got = apply_penalties(logits, prompt, output, md.repetition_penalty,
                          md.frequency_penalty, md.presence_penalty)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # The sampler's greedy pick uses the penalized logits.
    out = Sampler()(logits, md).sampled_token_ids
    assert torch.equal(out, got.argmax(-1))


@pytest.mark.timeout(60)
def test_penalties_with_empty_output() -> None:
    batch, vocab = 2, 6
    logits = torch.tensor([[1.0, -1.0, 2.0, 0.5, -0.5, 0.0]] * batch)
    prompt = torch.tensor([[0, 1], [vocab, vocab]])
    output = torch.empty(batch, 0, dtype=torch.long)
    from tandem.layers.sampler import apply_penalties

    got = apply_penalties(logits, prompt, output, torch.tensor([2.0, 2.0]),
                          torch.tensor([1.0, 1.0]), torch.tensor([1.0, 1.0]))
    expected = penalties_reference(logits, prompt.tolist(), [[], []], vocab,
                                   [2.0, 2.0], [1.0, 1.0], [1.0, 1.0])
    torch.testing.assert_close(got, expected)
    assert got[0, 0] == 0.5 and got[0, 1] == -2.0
    assert torch.equal(got[1], logits[1])


# ----------------------------------------------------------------------- min_tokens


@pytest.mark.timeout(60)
def test_min_tokens_mask_forbids_tokens() -> None:
    vocab = 8
    batch = 3
    logits = torch.zeros(batch, vocab)
    logits[:, 2] = 10.0  # "EOS" is by far the most likely
    logits[:, 5] = 9.0
    mask = [(0, [2]), (2, [2, 5])]
    # Greedy: row 1 unmasked picks EOS; masked rows pick the next best.
    out = Sampler()(logits, make_metadata(batch, 0.0, min_tokens_mask=mask)).sampled_token_ids
    assert out.tolist()[0] == 5 and out.tolist()[1] == 2 and out.tolist()[2] not in (2, 5)
    # Random: never sample the forbidden tokens.
    big = logits.repeat(2000, 1)
    big_mask = [(r * batch + row, ids) for r in range(2000) for row, ids in mask]
    out = Sampler()(big, make_metadata(big.shape[0], 1.0, min_tokens_mask=big_mask))
    s = out.sampled_token_ids.view(2000, batch)
    assert not (s[:, 0] == 2).any()
    assert not ((s[:, 2] == 2) | (s[:, 2] == 5)).any()
    assert (s[:, 1] == 2).float().mean() > 0.5


# ------------------------------------------------------------------------- logprobs


def _check_logprobs(lp: LogprobsTensors, raw: torch.Tensor, sampled: torch.Tensor,
                    n: int) -> None:
    ref = torch.log_softmax(raw.float(), -1)
    batch = raw.shape[0]
    assert lp.token_ids.shape == (batch, n + 1) and lp.token_ids.dtype == torch.int64
    assert lp.logprobs.shape == (batch, n + 1) and lp.logprobs.dtype == torch.float32
    assert lp.ranks.shape == (batch,) and lp.ranks.dtype == torch.int64
    assert torch.equal(lp.token_ids[:, 0], sampled)
    for b in range(batch):
        row = ref[b].tolist()
        tok = int(sampled[b])
        assert math.isclose(lp.logprobs[b, 0].item(), row[tok], rel_tol=1e-6, abs_tol=1e-6)
        assert int(lp.ranks[b]) == 1 + sum(1 for x in row if x > row[tok])
        top = sorted(range(len(row)), key=lambda t: -row[t])[:n]
        assert lp.token_ids[b, 1:].tolist() == top
        for j, t in enumerate(top):
            assert math.isclose(lp.logprobs[b, 1 + j].item(), row[t], rel_tol=1e-6,
                                abs_tol=1e-6)
        vals = lp.logprobs[b, 1:]
        assert torch.all(vals[:-1] >= vals[1:])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [0, 1, 5])
def test_logprobs_are_raw_distribution(n: int) -> None:
    batch, vocab = 8, 40
    logits = torch.randn(batch, vocab) * 2
    prompt = torch.randint(0, vocab, (batch, 5))
    output = torch.randint(0, vocab, (batch, 7))
    md = make_metadata(
        batch, [0.0, 0.5, 1.3, 0.0, 2.0, 1.0, 0.8, 0.0], top_k=[0, 5, 10, 3, 0, 2, 20, 0],
        top_p=0.9, min_p=0.05, repetition_penalty=[1.5] * batch,
        frequency_penalty=[0.7] * batch, presence_penalty=[0.4] * batch,
        prompt_token_ids=prompt, output_token_ids=output,
        min_tokens_mask=[(0, [int(logits[0].argmax())])], max_num_logprobs=n,
    )
    out = Sampler()(logits, md)
    assert out.logprobs is not None
    _check_logprobs(out.logprobs, logits, out.sampled_token_ids, n)
    # Row 0 is greedy but its raw argmax is forbidden -> rank of the sampled token > 1.
    assert int(out.logprobs.ranks[0]) > 1


@pytest.mark.timeout(60)
def test_logprobs_all_greedy_rank_one_and_bf16_input() -> None:
    # Distinct values that are exact in bf16, so there are no ties.
    logits = torch.stack([torch.randperm(30) for _ in range(4)]).float().mul(0.25)
    logits = logits.to(torch.bfloat16)
    out = Sampler()(logits, make_metadata(4, 0.0, max_num_logprobs=3))
    _check_logprobs(out.logprobs, logits, out.sampled_token_ids, 3)
    assert torch.all(out.logprobs.ranks == 1)
    assert torch.equal(out.logprobs.token_ids[:, 0], out.logprobs.token_ids[:, 1])


@pytest.mark.timeout(60)
def test_gather_logprobs_prompt_style() -> None:
    # Prompt logprobs: N positions, target = the next prompt token.
    num_tokens, vocab = 12, 25
    logits = torch.randn(num_tokens, vocab)
    targets = torch.randint(0, vocab, (num_tokens,))
    lp = gather_logprobs(torch.log_softmax(logits, -1), targets, 4)
    _check_logprobs(lp, logits, targets, 4)
    lp0 = gather_logprobs(torch.log_softmax(logits, -1), targets.to(torch.int32), 0)
    _check_logprobs(lp0, logits, targets, 0)


@pytest.mark.timeout(60)
def test_gather_logprobs_ties_rank() -> None:
    logprobs = torch.log_softmax(torch.tensor([[1.0, 2.0, 2.0, 0.0]]), -1)
    lp = gather_logprobs(logprobs, torch.tensor([2]), 2)
    assert int(lp.ranks[0]) == 1  # ties do not count as "strictly greater"
    lp = gather_logprobs(logprobs, torch.tensor([3]), 2)
    assert int(lp.ranks[0]) == 4


# ---------------------------------------------------------------------- logit bias


@pytest.mark.timeout(60)
def test_logit_bias_forces_and_bans_tokens() -> None:
    """+100 all but forces a token, -100 bans one, greedy or sampled; other rows untouched,
    and the caller's logits are not modified."""
    vocab, batch = 8, 3
    logits = LOGITS8.repeat(batch, 1).clone()
    before = logits.clone()

    def md(temperature: float, n: int = batch) -> SamplingMetadata:
        m = make_metadata(n, temperature)
        rows = torch.tensor([0, 1, 1])
        cols = torch.tensor([3, 4, 6])  # row 0: favour token 3; row 1: ban the argmax 4, favour 6
        m.logit_bias_index = rows * vocab + cols
        m.logit_bias_values = torch.tensor([100.0, -100.0, 5.0])
        return m

    greedy = Sampler()(logits, md(0.0)).sampled_token_ids.tolist()
    assert greedy == [3, 6, 4]  # row 2 has no bias: the plain argmax
    assert torch.equal(logits, before)
    big = logits.repeat(700, 1)
    m = md(1.0, big.shape[0])
    m.logit_bias_index = torch.cat([m.logit_bias_index + r * batch * vocab for r in range(700)])
    m.logit_bias_values = m.logit_bias_values.repeat(700)
    drawn = Sampler()(big, m).sampled_token_ids.view(700, batch)
    assert (drawn[:, 0] == 3).all()
    assert not (drawn[:, 1] == 4).any()
