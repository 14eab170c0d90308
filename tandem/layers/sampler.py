"""Token sampler, following vLLM v1's ``Sampler``.

One forward pass turns a batch of next-token logits into sampled token ids (and,
optionally, logprobs). Everything is batched tensor work so it runs the same on CPU and
CUDA without host syncs; every per-row setting arrives as a device tensor (the model
runner stages them all in its one host-to-device copy per step).

Seeded requests get noise that is a pure function of ``(seed, output index, token id)``,
computed on the device by a counter-based hash (splitmix64): no ``torch.Generator`` per
request, and a request's draws do not depend on the batch it is in, on preemption or on
async scheduling.

Order of operations (as in vLLM v1):
    raw logprobs -> min_tokens mask -> penalties -> greedy argmax
    -> temperature -> min_p -> top-k -> top-p -> exponential-race sampling
"""
from __future__ import annotations

from dataclasses import dataclass

from typing import Optional

import torch

# Temperatures below this are treated as greedy: dividing by them would overflow the
# logits to inf/nan, and the result is argmax anyway. Matches SamplingParams' threshold.
_SAMPLING_EPS = 1e-5


@dataclass
class SamplingMetadata:
    """Per-step, per-batch sampling settings, already laid out as device tensors."""

    temperature: torch.Tensor  # [B] float32; 0.0 means greedy for that row
    all_greedy: bool  # every row greedy -> skip random path entirely
    all_random: bool  # no row greedy
    top_k: torch.Tensor | None  # [B] int64, 0 = disabled for that row; None if disabled for all
    top_p: torch.Tensor | None  # [B] float32, 1.0 = disabled; None if disabled for all
    min_p: torch.Tensor | None  # [B] float32, 0.0 = disabled; None if disabled for all
    repetition_penalty: torch.Tensor | None  # [B] float32 (1.0 = none); None if no row uses any penalty
    frequency_penalty: torch.Tensor | None  # [B] float32
    presence_penalty: torch.Tensor | None  # [B] float32
    prompt_token_ids: torch.Tensor | None  # [B, P] int64, padded with vocab_size
    output_token_ids: torch.Tensor | None  # [B, O] int64, padded with vocab_size
    max_num_logprobs: int | None  # None: no logprobs wanted; else top-n to return (n may be 0)
    # Seeded rows: their indices, seeds and the output index of the token being sampled.
    seeded_rows: torch.Tensor | None = None  # [S] int64
    seeds: torch.Tensor | None = None  # [S] int64
    output_index: torch.Tensor | None = None  # [S] int64
    # min_tokens: (row, token id) pairs to forbid, for rows that have not reached min_tokens.
    min_tokens_rows: torch.Tensor | None = None  # [M] int64
    min_tokens_cols: torch.Tensor | None = None  # [M] int64
    # logit_bias: flat indices (row * vocab + token) and the values added there.
    logit_bias_index: torch.Tensor | None = None  # [L] int64
    logit_bias_values: torch.Tensor | None = None  # [L] float32


@dataclass
class LogprobsTensors:
    """Logprobs of a target token plus the top-n alternatives, per row."""

    token_ids: torch.Tensor  # [B, n+1] int64: column 0 is the target token, then top-n
    logprobs: torch.Tensor  # [B, n+1] float32, matching logprobs
    ranks: torch.Tensor  # [B] int64: rank (1 = most likely) of the column-0 token


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    logprobs: LogprobsTensors | None


class Sampler(torch.nn.Module):
    """Batched sampler; stateless, so one instance can serve every step."""

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        if (metadata.all_greedy and metadata.max_num_logprobs is None and metadata.min_tokens_rows is None
                and metadata.repetition_penalty is None and metadata.logit_bias_index is None):
            # Plain greedy: argmax in the model dtype picks the same token as in fp32 (the
            # conversion is exact and monotonic) without writing a float32 copy of the logits.
            return SamplerOutput(sampled_token_ids=logits.argmax(dim=-1), logprobs=None)
        # float32 for numerically stable softmax / cumsum regardless of model dtype.
        # Everything below is out-of-place, so the caller's logits are never modified
        # (``.to`` returns the same tensor when it is already float32).
        caller_logits = logits
        logits = logits.to(torch.float32)

        # vLLM returns logprobs of the raw model distribution, not the processed one.
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1)

        if metadata.min_tokens_rows is not None:
            logits = apply_min_tokens_mask(logits, metadata.min_tokens_rows, metadata.min_tokens_cols)
        if metadata.logit_bias_index is not None:
            assert metadata.logit_bias_values is not None
            logits = logits.clone() if logits is caller_logits else logits
            logits.view(-1).index_add_(0, metadata.logit_bias_index, metadata.logit_bias_values)

        if metadata.repetition_penalty is not None:
            logits = apply_penalties(
                logits,
                metadata.prompt_token_ids,
                metadata.output_token_ids,
                metadata.repetition_penalty,
                metadata.frequency_penalty,
                metadata.presence_penalty,
            )

        sampled = self.sample(logits, metadata)

        logprobs = None
        if raw_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, sampled, metadata.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    @staticmethod
    def sample(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Greedy and/or random sampling of already-penalized float32 logits -> [B] int64."""
        greedy = None
        if not metadata.all_random:
            greedy = logits.argmax(dim=-1)
            if metadata.all_greedy:
                return greedy

        temperature = metadata.temperature.to(device=logits.device, dtype=torch.float32)
        is_greedy = temperature < _SAMPLING_EPS
        # Greedy rows still flow through the random path (their result is discarded);
        # use 1.0 for them so the division stays finite.
        safe_temp = torch.where(is_greedy, torch.ones_like(temperature), temperature)
        logits = logits / safe_temp.unsqueeze(1)

        if metadata.min_p is not None:
            logits = apply_min_p(logits, metadata.min_p)
        if metadata.top_k is not None or metadata.top_p is not None:
            logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)

        probs = torch.softmax(logits, dim=-1)
        random = random_sample(probs, metadata)

        if greedy is None:
            return random
        return torch.where(is_greedy, greedy, random)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                        indices: Optional[torch.Tensor | list[int]] = None) -> None:
    """Structured outputs: set ``-inf`` in place wherever ``bitmask`` (int32 ``[B, ceil(V/32)]``,
    bit ``t % 32`` of word ``t // 32`` for token ``t``, on the logits' device) has a 0 bit, in
    the rows ``indices`` (None: every row; a device tensor on CUDA, a list on the CPU).
    On CUDA tandem's Triton kernel (``tandem.kernels.bitmask``: a cheaper launch), on the
    CPU xgrammar's C++ one; each imported only when a constrained step runs."""
    if logits.is_cuda:
        from tandem.kernels.bitmask import apply_token_bitmask_triton

        assert indices is None or isinstance(indices, torch.Tensor)
        apply_token_bitmask_triton(logits, bitmask, indices)
        return
    import xgrammar

    xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1],
                                         indices=indices)  # type: ignore[arg-type]


def apply_min_tokens_mask(logits: torch.Tensor, rows: torch.Tensor, cols: Optional[torch.Tensor]) -> torch.Tensor:
    """Forbid stop/EOS tokens for rows that have not yet produced ``min_tokens``.

    A fill at flat indices: ``logits[rows, cols] = -inf`` (index_put) synchronizes on CUDA."""
    logits = logits.clone()
    logits.view(-1).index_fill_(0, rows * logits.shape[1] + cols, float("-inf"))
    return logits


def _token_counts(token_ids: torch.Tensor | None, batch: int, vocab: int,
                  device: torch.device) -> torch.Tensor:
    """[B, V] int64 occurrence counts; padding id ``vocab`` lands in a dropped column."""
    counts = torch.zeros(batch, vocab + 1, dtype=torch.long, device=device)
    if token_ids is not None and token_ids.numel() > 0:
        ids = token_ids.to(device=device, dtype=torch.long)
        counts.scatter_add_(1, ids, torch.ones_like(ids))
    return counts[:, :vocab]


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: torch.Tensor | None,
    output_token_ids: torch.Tensor | None,
    repetition_penalty: torch.Tensor,
    frequency_penalty: torch.Tensor | None,
    presence_penalty: torch.Tensor | None,
) -> torch.Tensor:
    """Repetition (prompt+output), then frequency and presence (output only) penalties.

    Same formulas as vLLM / HF: repetition divides positive logits and multiplies
    negative ones so a penalty > 1 always makes a seen token less likely.
    """
    batch, vocab = logits.shape
    device = logits.device
    prompt_counts = _token_counts(prompt_token_ids, batch, vocab, device)
    output_counts = _token_counts(output_token_ids, batch, vocab, device)
    output_mask = output_counts > 0

    rep = repetition_penalty.to(device=device, dtype=logits.dtype).unsqueeze(1)
    seen = (prompt_counts > 0) | output_mask
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)

    if frequency_penalty is not None:
        freq = frequency_penalty.to(device=device, dtype=logits.dtype).unsqueeze(1)
        logits = logits - freq * output_counts.to(logits.dtype)
    if presence_penalty is not None:
        pres = presence_penalty.to(device=device, dtype=logits.dtype).unsqueeze(1)
        logits = logits - pres * output_mask.to(logits.dtype)
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p * max_prob`` (the top token survives)."""
    probs = torch.softmax(logits, dim=-1)
    max_prob = probs.amax(dim=-1, keepdim=True)
    threshold = max_prob * min_p.to(device=logits.device, dtype=probs.dtype).unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None
) -> torch.Tensor:
    """Sort-based top-k then top-p, as in vLLM.

    Top-p runs on the distribution renormalized after top-k. At least one token is always
    kept. Ties with the k-th largest logit are kept (threshold comparison, like vLLM).
    """
    vocab = logits.shape[-1]
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)

    if k is not None:
        k = k.to(device=logits.device, dtype=torch.long)
        # 0 means disabled -> keep the whole vocab; clamp to [1, V] for safety.
        k = torch.where(k <= 0, torch.full_like(k, vocab), k).clamp(1, vocab)
        # Ascending sort: the k-th largest value sits at index V - k.
        kth = logits_sort.gather(1, (vocab - k).unsqueeze(1))
        logits_sort = logits_sort.masked_fill(logits_sort < kth, float("-inf"))

    if p is not None:
        p = p.to(device=logits.device, dtype=torch.float32)
        probs_sort = logits_sort.softmax(dim=-1)
        probs_sum = probs_sort.cumsum(dim=-1)
        # Drop the low tail whose total mass is <= 1 - p: what remains is the smallest
        # high-probability set with mass >= p.
        top_p_mask = probs_sum <= 1 - p.unsqueeze(1)
        top_p_mask[:, -1] = False  # always keep the most likely token
        logits_sort = logits_sort.masked_fill(top_p_mask, float("-inf"))

    # Undo the sort.
    return logits_sort.scatter(dim=-1, index=logits_idx, src=logits_sort)


def random_sample(probs: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Exponential race: argmax(probs / q), q ~ Exp(1) iid, which samples from ``probs``.

    Unlike torch.multinomial it needs no device sync. Unseeded rows draw from the default
    generator in one batched call; seeded rows get ``seeded_exponential`` noise instead.

    A draw can be exactly 0 in float32 (a uniform that rounds to 1; about one element in
    2**24), and a token with probability 0 — masked by top-k/top-p, min-p or a grammar —
    would then score 0/0 = NaN, which ``argmax`` takes for the maximum. So the noise is
    clamped to the smallest positive float: the race is otherwise unchanged.
    """
    q = torch.empty_like(probs)
    seeded = metadata.seeded_rows
    num_seeded = 0 if seeded is None else seeded.shape[0]
    if num_seeded < probs.shape[0]:
        q.exponential_()
    if seeded is not None and num_seeded:
        assert metadata.seeds is not None and metadata.output_index is not None
        q[seeded] = seeded_exponential(metadata.seeds, metadata.output_index, probs.shape[1]).to(q.dtype)
    q.clamp_min_(torch.finfo(q.dtype).tiny)
    return probs.div(q).argmax(dim=-1).view(-1)


# splitmix64 constants as signed int64 (torch has no uint64 arithmetic).
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer; int64 multiplication wraps modulo 2**64 like uint64."""
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def seeded_exponential(seeds: torch.Tensor, output_index: torch.Tensor, vocab: int) -> torch.Tensor:
    """[S, vocab] float32 Exp(1) noise, a pure function of (seed, output index, token id).

    A 24-bit uniform per element (resolution 6e-8, so the largest draw is about 16.6)
    is plenty for sampling; the hash is splitmix64 over a counter, as in counter-based RNGs.
    """
    key = _mix64(_mix64(seeds.to(torch.int64) + _GOLDEN) ^ (output_index.to(torch.int64) * _MIX1 + 1))
    cols = torch.arange(1, vocab + 1, dtype=torch.int64, device=key.device)
    z = _mix64(key[:, None] + cols[None, :] * _GOLDEN)
    u = (_shr(z, 40).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    return -torch.log(u)


def gather_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int
) -> LogprobsTensors:
    """logprobs: [N, V] log-softmaxed; token_ids: [N] target tokens.

    Used for both sampled-token logprobs and prompt logprobs. Column 0 is the target
    token; columns 1..n the top-n tokens (descending). rank = 1 + number of tokens with a
    strictly larger logprob.
    """
    token_ids = token_ids.to(device=logprobs.device, dtype=torch.long).unsqueeze(-1)
    topk_logprobs, topk_indices = torch.topk(logprobs, num_logprobs, dim=-1)
    token_logprobs = logprobs.gather(-1, token_ids)
    ranks = (logprobs > token_logprobs).sum(dim=-1) + 1
    indices = torch.cat((token_ids, topk_indices.to(torch.long)), dim=1)
    values = torch.cat((token_logprobs, topk_logprobs), dim=1).to(torch.float32)
    return LogprobsTensors(token_ids=indices, logprobs=values, ranks=ranks.to(torch.long))
