"""Turns a ``SchedulerOutput`` into one forward pass + sampling, without waiting for it.

One step, in order (all on the compute stream; the host never waits for the device):

1. ``_update_states``: apply the scheduler's delta to the persistent ``InputBatch`` (drop
   finished/preempted requests, add new ones, append new block ids) and collect each
   scheduled request's row, first position, token count and whether it samples.
2. ``_stage``: build every input with numpy — token-table gather indices, positions, slot
   mapping, sequence lengths, new tokens/blocks to write, logits rows, sampling parameters
   — into one pinned buffer, and ``upload()`` it in one non-blocking copy.
3. Write new prompt tokens and block ids into their device tables; run the model: a
   captured CUDA graph for a pure-decode batch (padded to its bucket), another for a mixed
   batch (prefill chunks beside decodes, padded to a token bucket, up to
   ``TANDEM_MIXED_GRAPH_MAX_TOKENS``; off by default: served, it showed no gain), eagerly otherwise.
   The graph's inputs are read on the device from the token table, after the previous
   step's sampler wrote it (stream order) and before the replay, whatever the batch order.
4. Sample, scatter the sampled ids into the token table (where step N+1 gathers them), and
   return an ``AsyncModelOutput`` whose host copy runs on a side stream.

A step with constrained requests (structured outputs) masks the logits with the token
bitmask before the sampler (Triton on CUDA, xgrammar's C++ on the CPU) and never takes the
decode graph's own greedy choice (it ignored the grammar). Split, it stops after the LM
head and step 4 runs in ``sample_tokens``, once the engine core has sent the bitmask. Gated
(``SchedulerOutput.grammar``), step 4 follows at once, behind a wait for the bitmask that
the engine core is filling meanwhile: on CUDA a wait queued on the stream, so the host
goes on (``tandem.kernels.host_flag``). With ``TANDEM_GATED_GRAPHS=1`` a gated greedy decode
step is one replay of a graph that holds that wait and the mask too
(``_gated_graph_body``): the step costs the engine thread what an unconstrained one does.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Optional, Sequence, cast

import numpy as np
import torch

from tandem import step_trace
from tandem.config.speculative import SpeculativeConfig
from tandem.distributed import get_tp_rank, get_tp_world_size, tp_broadcast
from tandem.kernels.splits import (MIN_SPLIT_TOKENS, SMALL_BATCH_SPLIT_TOKENS, choose_num_kv_splits,
                                   decode_split_counts)
from tandem.layers.attention import AttentionMetadata, set_forward_context
from tandem.layers.sampler import LogprobsTensors, Sampler, SamplingMetadata, apply_token_bitmask, gather_logprobs
from tandem.models.registry import CausalLM
from tandem.types.grammar import GrammarOutput
from tandem.types.scheduler_output import SchedulerOutput
from tandem.worker.async_output import AsyncModelOutput, HostBufferRing
from tandem.worker.input_batch import CachedRequestState, InputBatch
from tandem.worker.speculative import DraftProposer, SampleLayout, SpecDecoder, VerifyInputs, sample_layout
from tandem.worker.staging import BitmaskStager, Segment, StagingBuffer

logger = logging.getLogger(__name__)

_INT64 = np.dtype(np.int64)
_INT32 = np.dtype(np.int32)
# int64 entries of a staged gate (``tandem.kernels.host_flag.GATE_WORDS``; that module needs
# triton, which the engine core does not import).
_GATE_WORDS = 3
_F32 = np.dtype(np.float32)


# Token buckets of the mixed-batch graphs. Served, a request or two arrive per step while 256
# decode, so many steps are mixed (``tandem:engine_prefill_steps`` counts them), and each ran
# eagerly: ~250 launches from Python on the engine thread, the bound of a served step
# (py-spy, H100 hosts).
MIXED_GRAPH_TOKENS = (16, 32, 64, 128, 256, 320, 384, 448, 512, 640, 768, 896, 1024, 1536, 2048)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Batch-size buckets a decode graph is captured for (a batch pads up to the next)."""
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16)) + list(range(288, 1025, 32))
    return [s for s in sizes if s < max_num_seqs] + [max_num_seqs]


@dataclass
class StepPlan:
    """What ``_update_states`` gathered about the scheduled requests, in batch order."""

    states: list[CachedRequestState]
    rows: np.ndarray  # int32 [B]
    starts: np.ndarray  # int32 [B] first position computed now
    counts: np.ndarray  # int32 [B] tokens computed now
    samples: np.ndarray  # bool [B]
    drafts: Optional[np.ndarray] = None  # int32 [B] drafts verified (speculative decoding only)
    correct: Optional[np.ndarray] = None  # bool [B] positions optimistic (tandem.worker.speculative)

    @property
    def num_seqs(self) -> int:
        return len(self.states)


@dataclass
class BatchSegments:
    """The staged inputs the forward pass reads (fixed offsets for a given padded size)."""

    gather: Segment  # int64 [T] flat token-table index of each input token
    positions: Segment  # int64 [T]
    slots: Segment  # int64 [T] cache slot of each token (-1: padding)
    rows: Segment  # int32 [B] token-table row of each sequence (for its block table)
    seq_lens: Segment  # int32 [B]
    query_start_loc: Segment  # int32 [B + 1]
    dest: Segment  # int64 [B] flat token-table index of the token each sequence samples
    # A gated decode graph's (``_gated_graph_body``; reserved only with the switch on, written
    # only for such a step):
    gate: Optional[Segment] = None  # int64 [GATE_WORDS] flag address, flag target, bitmask address
    mask_rows: Optional[Segment] = None  # int64 [B] bitmask row of each sequence, -1: unconstrained


@dataclass
class LaunchedForward:
    """A forward pass whose tokens are still to be sampled: what ``sample_tokens`` needs."""

    step_id: int
    req_ids: list[str]  # the sampling requests, in batch order
    logits: torch.Tensor  # [len(req_ids), vocab] of those rows (every rank computed them)
    sampling: Callable[[], SamplingMetadata]
    dest: torch.Tensor  # flat token-table index each sampled id is written to
    prompt_logprobs: dict[str, LogprobsTensors]
    spec: Optional[VerifyInputs] = None  # speculative decoding: verify and propose after sampling
    masked_graph: Optional[tuple[torch.cuda.CUDAGraph, torch.Tensor, int]] = None  # (graph, ids, size): see _sample
    spec_rows: Optional[np.ndarray] = None  # rows (1 + k) of each sampling request, when it verified drafts
    row_counts: Optional[np.ndarray] = None  # the same whenever speculation is on (bitmask layout)


@dataclass
class PreparedStep:
    """A step's host inputs, packed into the staging buffer but not yet uploaded
    (``ModelRunner.prepare``); the fields past ``plan`` are unset when nothing is scheduled."""

    plan: StepPlan
    graph_size: Optional[int] = None  # the decode graph's bucket, if one runs the step
    verify_size: Optional[int] = None  # the verify graph's bucket (speculative decoding)
    mixed_size: Optional[int] = None  # the mixed graph's token bucket
    segs: Any = None  # BatchSegments
    qsl: Any = None  # np.ndarray int32 [B + 1] query start locations
    seq_lens: Any = None  # np.ndarray int32 [B]
    writes: Optional[tuple[Segment, Segment, Segment, Segment]] = None  # new tokens / blocks
    sample_idx: Any = None  # np.ndarray: batch indices of the sampling sequences
    layout: Optional[SampleLayout] = None  # speculative decoding's sampled rows
    row_idx: Any = None  # np.ndarray: each sampled row's batch index
    row_lens: Any = None  # np.ndarray: each sampled row's sequence length
    logits_rows: Optional[Segment] = None
    sample_dest: Optional[Segment] = None
    sampling: Optional[Callable[..., SamplingMetadata]] = None
    plain_greedy: bool = False
    spec_staged: Any = None


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        vocab_size: int,
        block_size: int,
        max_model_len: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        device: torch.device,
        dtype: torch.dtype,
        attention_backend: str = "sdpa",
        cuda_graphs: bool = False,
        speculative: Optional[SpeculativeConfig] = None,
        draft_model: Optional[CausalLM] = None,
        mixed_graph_max_tokens: int = 0,
        gated_graphs: bool = False,
    ) -> None:
        self.model = model
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.device = device
        self.dtype = dtype
        self.backend = attention_backend
        # Twice the running set: a finished request keeps its row until the worker hears of
        # it, while its replacement may already have arrived.
        self.batch = InputBatch(2 * max_num_seqs + 4, max_model_len, block_size, device)
        tokens = max(max_num_batched_tokens, max_num_seqs)
        self.staging = StagingBuffer(16 * tokens + 64 * max_num_seqs + (1 << 16), device)
        self.sampler = Sampler()
        self.kv_caches: list[torch.Tensor] = []
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        draft = (DraftProposer(draft_model, speculative.num_speculative_tokens, block_size, max_model_len,
                               self.batch.width, attention_backend)
                 if draft_model is not None and speculative is not None else None)
        self.spec = (SpecDecoder(speculative, self.batch.max_rows, self.batch.width, device, draft)
                     if speculative is not None else None)
        ring = max_num_seqs * (1 + (speculative.num_speculative_tokens if speculative is not None else 0))
        self.host_ring = HostBufferRing(ring, pinned=device.type == "cuda")
        # With tensor parallelism only rank 0 samples; the others receive its ids by broadcast
        # so every rank's token table (hence every rank's next input) stays identical.
        self.tp_rank = get_tp_rank()
        self.use_graphs = cuda_graphs and device.type == "cuda" and attention_backend == "triton"
        # Compile gated sampling's wait with the other kernels (set through the worker when
        # the engine gates constrained steps; nothing else launches that kernel).
        self.warm_gated_sampling = False
        # Decode graphs by (batch-size bucket, split-KV count): the split count follows the
        # batch's longest context, and a graph bakes it in.
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph,
                                                 tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        self.graph_sizes: list[int] = graph_batch_sizes(max_num_seqs) if self.use_graphs else []
        # Verify graphs (speculative decoding), keyed like ``graphs``: (bucket, split-KV count).
        self.verify_graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]] = {}
        self.spec_graph_limit = 64  # largest batch a verify graph is captured for
        # Mixed-batch graphs by token bucket: every sequence slot of the largest decode bucket,
        # any split of the bucket's tokens among them (``_mixed_graph_size``).
        self.mixed_graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor]]] = {}
        self.mixed_graph_sizes: list[int] = (
            [t for t in MIXED_GRAPH_TOKENS if t <= min(mixed_graph_max_tokens, max_num_batched_tokens)
             and -(-t // max_num_seqs) <= max_model_len]  # (the capture batch's contexts fit the scratch row)
            if self.use_graphs and speculative is None else [])
        # Masked greedy sampling graphs, keyed like ``graphs``: a constrained decode step's
        # sampling (scatter the bitmask rows, mask, argmax, token-table write) in one replay
        # after its decode graph's; ``sample_tokens`` then costs two copies and a launch.
        self.masked_graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.masked_eager_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # by bucket
        # Gated decode graphs (``gated_graphs``, with gated sampling), keyed like ``graphs``: a
        # gated greedy decode step whole in one replay, the wait for its bitmask included
        # (``_gated_graph_body``), where the masked graphs cost a flag-wait launch, two copies
        # and a second replay on the engine thread.
        self.use_gated_graphs = gated_graphs
        self.gated_graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph,
                                                       tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        self._gate_open: Optional[torch.Tensor] = None  # a raised flag: see _open_gate
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
        self.num_kv_heads = 1
        # Shortest key chunk of a split-KV decode: contexts under twice this take one split.
        self.min_split_tokens = MIN_SPLIT_TOKENS
        self.small_batch_split_tokens = SMALL_BATCH_SPLIT_TOKENS
        self.stats_steps = 0  # steps launched
        self.stats_graph_steps = 0
        self.stats_masked_graph_steps = 0  # constrained steps sampled by a masked sampling graph
        self.stats_gated_graph_steps = 0  # gated steps run whole by a gated decode graph
        self.stats_mixed_graph_steps = 0  # steps with prefill tokens run by a mixed-batch graph
        self.stats_prepared_steps = 0  # steps launched from inputs ``prepare`` built ahead
        self._pending: Optional[LaunchedForward] = None  # a constrained step's forward, until sampled
        self._static_copy: Optional[torch.cuda.Event] = None  # see _static_read
        # (step id, inputs built ahead by ``prepare``, or the error building them raised)
        self._prepared: Optional[tuple[int, "PreparedStep | Exception"]] = None
        self.bitmasks = BitmaskStager(ring, device)  # a row per sampled row (1 + k per request)

    def init_draft_kv_cache(self, num_blocks: int, num_layers: int, num_kv_heads: int, head_dim: int) -> None:
        """The draft model's cache (speculative decoding), in the same blocks as the target's."""
        assert self.spec is not None and self.spec.draft is not None
        self.spec.draft.init_kv_cache(num_blocks, num_layers, num_kv_heads, head_dim, self.dtype, self.device)

    def init_kv_cache(self, num_blocks: int, num_layers: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_kv_heads = num_kv_heads
        self.kv_caches = [
            torch.zeros(2, num_blocks, self.block_size, num_kv_heads, head_dim, dtype=self.dtype, device=self.device)
            for _ in range(num_layers)
        ]
        if self.device.type == "cuda" and self.backend == "triton":
            self.warmup_kernels()
        if self.use_graphs:
            self.capture_graphs()

    # -- 1. the scheduler's delta ------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> StepPlan:
        batch = self.batch
        for rid in so.finished_req_ids:
            batch.remove(rid)
        for rid in so.preempted_req_ids:
            batch.remove(rid)
        scheduled = so.requests
        n = len(scheduled)
        states: list[CachedRequestState] = []
        known = batch.requests
        spec = self.spec
        for r in scheduled:  # the per-request part: look up (or add) its state, queue new blocks
            if r.new is not None:
                st = batch.add(r.req_id, r.new, r.new_block_ids)
                if spec is not None:
                    spec.reset_row(st.row)
            else:
                st = known.get(r.req_id)  # type: ignore[assignment]
                if st is None:
                    raise RuntimeError(f"worker has no state for request {r.req_id!r} (step {so.step_id})")
                if r.new_block_ids:
                    batch.append_blocks(st, r.new_block_ids)
            states.append(st)
        batch.flush_blocks()
        plan = StepPlan(
            states,
            np.fromiter([st.row for st in states], dtype=np.int32, count=n),
            np.fromiter([r.num_computed_tokens for r in scheduled], dtype=np.int32, count=n),
            np.fromiter([r.num_scheduled_tokens for r in scheduled], dtype=np.int32, count=n),
            np.fromiter([r.samples for r in scheduled], dtype=bool, count=n),
        )
        if spec is not None:
            plan.drafts = np.fromiter((r.num_draft_tokens for r in scheduled), dtype=np.int32, count=n)
            plan.correct = np.fromiter((r.correct_drafts for r in scheduled), dtype=bool, count=n)
        return plan

    # -- 2. staging ----------------------------------------------------------------------
    def _reserve_batch(self, num_tokens: int, num_seqs: int) -> tuple[BatchSegments, list[np.ndarray]]:
        sb = self.staging
        parts = [sb.reserve(num_tokens, _INT64), sb.reserve(num_tokens, _INT64), sb.reserve(num_tokens, _INT64),
                 sb.reserve(num_seqs, _INT32), sb.reserve(num_seqs, _INT32), sb.reserve(num_seqs + 1, _INT32),
                 sb.reserve(num_seqs, _INT64)]
        segs = BatchSegments(*(p[0] for p in parts))
        if self.use_gated_graphs:  # (at the same offsets in the capture and in every step of its size)
            segs.gate, segs.mask_rows = sb.reserve(_GATE_WORDS, _INT64)[0], sb.reserve(num_seqs, _INT64)[0]
        return segs, [p[1] for p in parts]

    def _stage_batch(self, plan: StepPlan, pad_seqs: int, pad_tokens: Optional[int] = None
                     ) -> tuple[BatchSegments, np.ndarray, np.ndarray]:
        """Inputs of the forward pass. ``pad_seqs`` > B pads a batch for a graph (a decode or
        verify graph: ``T // B`` tokens per padding sequence; a mixed graph: ``pad_tokens``
        in all): padding sequences have no query token and length 0, padding tokens slot
        -1, and they read and write the token table's scratch row. A sequence that does not
        sample this step also sends its (graph-computed) argmax to the scratch row."""
        B = plan.num_seqs
        qsl = np.zeros(B + 1, dtype=np.int32)
        np.cumsum(plan.counts, out=qsl[1:])
        T = int(qsl[-1])
        seq_lens = plan.starts + plan.counts
        if pad_tokens is None:
            pad_tokens = T if pad_seqs == B else pad_seqs * (T // B)  # (a graph's batch: T // B tokens each)
        segs, (gather, positions, slots, rows, sl, qs, dest) = self._reserve_batch(pad_tokens, pad_seqs)
        scratch = self.batch.scratch_row * self.batch.width
        if T == B:  # every sequence has one token: no repeat needed
            pos = plan.starts.astype(np.int64)
            tok_rows = plan.rows
        else:
            tok_rows = np.repeat(plan.rows, plan.counts)
            pos = np.arange(T, dtype=np.int64) - np.repeat(qsl[:-1] - plan.starts, plan.counts)
        bs = self.block_size
        positions[:T] = pos
        gather[:T] = tok_rows.astype(np.int64) * self.batch.width + pos
        slots[:T] = self.batch.block_table[tok_rows, pos // bs].astype(np.int64) * bs + pos % bs
        rows[:B] = plan.rows
        sl[:B] = seq_lens
        qs[:B + 1] = qsl
        dest[:B] = np.where(plan.samples, plan.rows.astype(np.int64) * self.batch.width + seq_lens, scratch)
        if pad_tokens > T:
            positions[T:] = 0
            gather[T:] = scratch
            slots[T:] = -1
        if pad_seqs > B:
            rows[B:] = self.batch.scratch_row
            sl[B:] = 0
            qs[B + 1:] = T
            dest[B:] = scratch
        return segs, qsl, seq_lens

    def _stage_table_writes(self) -> Optional[tuple[Segment, Segment, Segment, Segment]]:
        """New requests' tokens and new block ids, as flat (index, value) pairs."""
        batch = self.batch
        batch.flush_blocks()
        if not batch.pending_tokens and not batch.block_writes:
            return None
        sb = self.staging
        tok_idx = [np.arange(len(t), dtype=np.int64) + row * batch.width for row, t in batch.pending_tokens]
        tok_val = [np.asarray(t, dtype=np.int64) for _, t in batch.pending_tokens]
        blk_idx = [idx for idx, _ in batch.block_writes]
        blk_val = [vals for _, vals in batch.block_writes]
        batch.pending_tokens.clear()
        batch.block_writes.clear()

        def cat(xs: list[np.ndarray], dt: np.dtype) -> np.ndarray:
            return np.concatenate(xs) if xs else np.zeros(0, dtype=dt)

        return (sb.put(cat(tok_idx, _INT64)), sb.put(cat(tok_val, _INT64)),
                sb.put(cat(blk_idx, _INT64)), sb.put(cat(blk_val, _INT32)))

    # -- 3. the forward pass ---------------------------------------------------------------
    def _apply_table_writes(self, segs: Optional[tuple[Segment, Segment, Segment, Segment]]) -> None:
        if segs is None:
            return
        sb = self.staging
        tok_idx, tok_val, blk_idx, blk_val = segs
        if tok_idx.count:
            self.batch.token_table.view(-1).index_copy_(0, sb.view(tok_idx), sb.view(tok_val))
        if blk_idx.count:
            self.batch.block_table_device.view(-1).index_copy_(0, sb.view(blk_idx), sb.view(blk_val))

    def _forward(self, segs: BatchSegments, max_query_len: int, max_seq_len: int,
                 qsl_host: Optional[np.ndarray], seq_lens_host: Optional[np.ndarray],
                 num_kv_splits: int = 1, draft: Optional[DraftProposer] = None) -> torch.Tensor:
        """Gather the inputs from the token table and run the model (graph-capturable).
        ``num_kv_splits`` is the decode batch's split-KV count (``_step_splits``); ``draft``:
        run the draft model over the same tokens instead, into its own cache."""
        sb = self.staging
        input_ids = self.batch.token_table.view(-1)[sb.view(segs.gather)]
        md = AttentionMetadata(
            slot_mapping=sb.view(segs.slots),
            query_start_loc=sb.view(segs.query_start_loc),
            seq_lens=sb.view(segs.seq_lens),
            block_tables=self.batch.block_table_device[sb.view(segs.rows)],
            block_size=self.block_size,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            backend=self.backend,
            num_kv_splits=num_kv_splits if max_query_len == 1 else 1,
            query_start_loc_host=qsl_host,
            seq_lens_host=seq_lens_host,
        )
        if draft is not None:
            with set_forward_context(md, draft.kv_caches):
                return draft.model(input_ids, sb.view(segs.positions))
        with set_forward_context(md, self.kv_caches):
            return self.model(input_ids, sb.view(segs.positions))

    def _decode_splits(self, num_seqs: int, max_seq_len: int) -> int:
        """Split-KV count of a decode batch of ``num_seqs`` sequences whose longest context
        (after this step) is ``max_seq_len``. It depends only on the padded batch size (the
        graph bucket) and that context, so a batch gives the same numbers whether a graph
        runs it or not; short contexts get one split (no merge kernel)."""
        if self.backend != "triton":
            return 1
        return choose_num_kv_splits(self._bucket(num_seqs), self.num_kv_heads, 1, min(max_seq_len, self.max_model_len),
                                    self.num_sms, min_split_tokens=self.min_split_tokens,
                                    small_batch_split_tokens=self.small_batch_split_tokens)

    def _step_splits(self, num_seqs: int, max_query_len: int, max_seq_len: int) -> int:
        """Split-KV count of a step: a decode batch (one query token per sequence) splits by
        its context (``_decode_splits``); longer queries (prefill chunks, verify steps) take
        one. The key, with the bucket, of the graph that runs the step."""
        return self._decode_splits(num_seqs, max_seq_len) if max_query_len == 1 else 1

    def _split_variants(self, num_seqs: int) -> list[int]:
        """The split counts ``_decode_splits`` can pick for a batch of this size (its graphs)."""
        if self.backend != "triton":
            return [1]
        return decode_split_counts(self._bucket(num_seqs), self.num_kv_heads, self.max_model_len, self.num_sms,
                                   min_split_tokens=self.min_split_tokens,
                                   small_batch_split_tokens=self.small_batch_split_tokens)

    def _bucket(self, num_seqs: int) -> int:
        return next((s for s in self.graph_sizes if s >= num_seqs), num_seqs)

    def profile_sampler(self, logits: torch.Tensor) -> None:
        """Run the sampler's costliest path once (for the memory profile that sizes the KV cache)."""
        n, dev = logits.shape[0], logits.device
        self.sampler(logits, SamplingMetadata(
            temperature=torch.ones(n, device=dev), all_greedy=False, all_random=True,
            top_k=torch.full((n,), 50, device=dev), top_p=torch.full((n,), 0.9, device=dev), min_p=None,
            repetition_penalty=None, frequency_penalty=None, presence_penalty=None, prompt_token_ids=None,
            output_token_ids=None, max_num_logprobs=None))

    @torch.inference_mode()
    def warmup_kernels(self) -> None:
        """Compile the Triton kernel variants real steps use (one long prefill, a batch of
        prefills, a mixed batch, a large decode batch) before the first request, so its
        latency does not include just-in-time compilation. The batches live in the token
        table's scratch row; their cache writes go to block 0, which no request owns yet."""
        tokens = min(self.max_num_batched_tokens, self.max_model_len - 1)
        scratch = self.batch.scratch_row
        n = self.max_num_seqs
        shapes = [[tokens], [max(1, tokens // 8)] * 8, [1] * (n - 1) + [max(1, tokens - n)], [1] * n]
        runs: list[tuple[list[int], Optional[int]]] = [(c, None) for c in shapes]
        # Decode steps pick their split-KV count from the context: compile each count now, on
        # one sequence (the extra splits of a context of 1 are empty, which is still correct).
        runs += [([1], s) for s in self._split_variants(1)]
        for counts, forced_splits in runs:
            counts_np = np.asarray(counts, dtype=np.int32)
            plan = StepPlan([None] * len(counts), np.full(len(counts), scratch, dtype=np.int32),  # type: ignore[list-item]
                            np.zeros(len(counts), dtype=np.int32), counts_np, np.zeros(len(counts), dtype=bool))
            self.staging.begin(0)
            segs, qsl, seq_lens = self._stage_batch(plan, plan.num_seqs)
            self.staging.upload()
            max_q, max_len = int(counts_np.max()), int(seq_lens.max())
            if forced_splits is not None:
                splits = forced_splits
            else:
                splits = self._step_splits(len(counts), max_q, max_len)
            hidden = self._forward(segs, max_q, max_len, qsl, seq_lens, splits)
            self.model.compute_logits(hidden[-1:]).argmax(dim=-1)
        if self.device.type == "cuda":
            if self.warm_gated_sampling:  # its wait (structured outputs), on a flag already raised
                from tandem.kernels.host_flag import wait_for_host_flag

                wait_for_host_flag(torch.ones(1, dtype=torch.int32, pin_memory=True), 1)
            torch.cuda.synchronize(self.device)

    def _graph_body(self, segs: BatchSegments, num_kv_splits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A whole decode step up to sampling: forward, logits, and the greedy choice, which
        is written into the token table (sampling rows only; others hit the scratch row).
        A step that samples otherwise overwrites those ids after the replay."""
        hidden = self._forward(segs, 1, self.max_model_len, None, None, num_kv_splits)
        logits = self.model.compute_logits(hidden)
        greedy = logits.argmax(dim=-1)
        self.batch.token_table.view(-1).index_copy_(0, self.staging.view(segs.dest), greedy)
        return hidden, logits, greedy

    def _mixed_graph_size(self, plan: StepPlan) -> Optional[int]:
        """The token bucket of a batch that is not pure decode, if a mixed graph can run it:
        at most the largest decode bucket's sequences and the largest mixed bucket's tokens."""
        if not self.mixed_graphs or plan.num_seqs > self.graph_sizes[-1]:
            return None
        tokens = int(plan.counts.sum())
        return next((t for t in self.mixed_graph_sizes if t >= tokens), None)  # (captured all or none)

    def _graph_size(self, plan: StepPlan) -> Optional[int]:
        """The bucket of a pure-decode batch that a captured graph can run, else None."""
        if not self.graphs or plan.num_seqs > self.graph_sizes[-1] or int(plan.counts.max()) != 1:
            return None
        return self._bucket(plan.num_seqs)

    @torch.inference_mode()
    def capture_graphs(self) -> None:
        """One decode graph per (batch-size bucket, split-KV count the bucket may pick),
        largest bucket first, all sharing one memory pool. Small buckets get a graph per
        context range (1 split for short contexts, more for long ones); buckets that fill
        the GPU on their own get one.

        Each graph reads its inputs at the offsets ``_reserve_batch`` gives its size, from
        the staging device buffer, and the token and block tables; capture fills them with
        a harmless batch (sequences of length 1 in block 0, no cache writes).
        """
        pool = None
        for size in reversed(self.graph_sizes):
            for splits in reversed(self._split_variants(size)):
                graph, outputs = self._capture(size, 1, partial(self._graph_body, num_kv_splits=splits), pool)
                pool = graph.pool()
                self.graphs[(size, splits)] = (graph, cast("tuple[torch.Tensor, torch.Tensor, torch.Tensor]", outputs))
        torch.cuda.synchronize(self.device)
        logger.info("captured %d decode CUDA graphs (batch sizes %s; split-KV counts per size: %s)", len(self.graphs),
                    self.graph_sizes, {s: self._split_variants(s) for s in self.graph_sizes})
        if self.spec is not None:
            self._capture_verify_graphs(pool)
        if get_tp_world_size() == 1:  # (with tensor parallelism rank 0 samples and broadcasts)
            self._capture_masked_graphs(pool)
            if self.use_gated_graphs and self.warm_gated_sampling:
                self._capture_gated_graphs(pool)
        if self.mixed_graph_sizes:
            self._capture_mixed_graphs(pool)

    def _capture(self, size: int, q: "int | np.ndarray", body: Callable[[BatchSegments], tuple[torch.Tensor, ...]],
                 pool: Any) -> tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]:
        """Capture ``body`` on a harmless batch of ``size`` sequences of ``q`` tokens each
        (or ``q[i]`` tokens for sequence ``i``; ``_capture_batch``)."""
        segs = self._capture_batch(size, q)
        for _ in range(2):  # warm up: autotuning and lazy initialization outside capture
            body(segs)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            outputs = body(segs)
        return graph, outputs

    # -- CUDA graphs of masked greedy sampling (structured outputs; GPU-only, see tests/gpu) --
    def _masked_graph_body(self, segs: BatchSegments, logits: torch.Tensor,
                           dest: Optional[torch.Tensor] = None) -> tuple[torch.Tensor]:
        """Sample ``logits`` ([size, V]) greedily under the staged bitmask
        (``BitmaskStager.stage_for_graph``): scatter its rows by sampled row over all-ones
        rows, mask, argmax, and write the ids into the token table at ``dest`` (None: the
        decode graph's destinations, where it wrote its unmasked choice). The same
        operations as the eager path, so the same ids."""
        from tandem.kernels.bitmask import apply_token_bitmask_triton

        size = logits.shape[0]
        src, idx, by_row = self.bitmasks.graph_buffers()
        by_row[:size].fill_(-1)
        by_row.index_copy_(0, idx[:size], src[:size])
        apply_token_bitmask_triton(logits, by_row[:size])
        ids = logits.argmax(dim=-1)
        self.batch.token_table.view(-1).index_copy_(0, self.staging.view(segs.dest) if dest is None else dest, ids)
        return (ids,)

    def _capture_masked_graphs(self, pool: Any) -> None:
        """One masked sampling graph per decode graph (it reads that graph's logits), and
        one per bucket for eager steps (mixed prefill and decode: ``_launch`` copies their
        logits and destinations into ``_mask_logits`` / ``_mask_dest`` first). A capture
        that fails leaves constrained steps' sampling eager."""
        if not self.graphs:
            return
        self.bitmasks.allocate(self._bitmask_words())
        largest = self.graph_sizes[-1]
        logits_of = next(iter(self.graphs.values()))[1][1]
        self._mask_logits = torch.empty((largest, logits_of.shape[1]), dtype=logits_of.dtype, device=self.device)
        self._mask_dest = torch.full((largest,), self.batch.scratch_row * self.batch.width, dtype=torch.int64,
                                     device=self.device)
        try:
            for (size, splits), (_, (_, logits, _)) in self.graphs.items():
                graph, (ids,) = self._capture(size, 1, partial(self._masked_graph_body, logits=logits), pool)
                pool = graph.pool()
                self.masked_graphs[(size, splits)] = (graph, ids)
            for size in reversed(self.graph_sizes):
                body = partial(self._masked_graph_body, logits=self._mask_logits[:size], dest=self._mask_dest[:size])
                graph, (ids,) = self._capture(size, 1, body, pool)
                pool = graph.pool()
                self.masked_eager_graphs[size] = (graph, ids)
            torch.cuda.synchronize(self.device)
        except Exception as e:  # never fail start-up for an optimization
            logger.warning("constrained steps sample eagerly: capturing their CUDA graphs failed (%s)", e)
            self.masked_graphs.clear()
            self.masked_eager_graphs.clear()
            return
        logger.info("captured %d masked sampling CUDA graphs", len(self.masked_graphs) + len(self.masked_eager_graphs))

    # -- CUDA graphs of whole gated decode steps (GPU-only, see tests/gpu) ---------------------
    def _gated_graph_body(self, segs: BatchSegments, num_kv_splits: int
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A gated greedy decode step in one graph: the forward and logits, a wait on the
        device for the step's bitmask flag, the mask read where the host filled it, argmax,
        and the ids into the token table. What changes between replays (the flag's target,
        the bitmask's address, each row's bitmask row) is read from the staged ``segs.gate``
        and ``segs.mask_rows``, which ``_stage_gate`` writes before the step's upload. The
        same masking as the masked graphs (rows not listed stay whole), so the same ids."""
        from tandem.kernels.bitmask import apply_host_bitmask_triton
        from tandem.kernels.host_flag import GATE_WORDS, wait_for_staged_flag

        assert GATE_WORDS == _GATE_WORDS and segs.gate is not None and segs.mask_rows is not None
        hidden = self._forward(segs, 1, self.max_model_len, None, None, num_kv_splits)
        logits = self.model.compute_logits(hidden)
        sb = self.staging
        gate = sb.view(segs.gate)
        wait_for_staged_flag(gate)
        apply_host_bitmask_triton(logits, gate, sb.view(segs.mask_rows), self._bitmask_words())
        ids = logits.argmax(dim=-1)
        self.batch.token_table.view(-1).index_copy_(0, sb.view(segs.dest), ids)
        return hidden, logits, ids

    def _capture_gated_graphs(self, pool: Any) -> None:
        """One gated decode graph per decode graph (same bucket and split count). A capture
        that fails leaves gated steps on the masked graphs."""
        jobs = [((size, splits), size, 1, partial(self._gated_graph_body, num_kv_splits=splits))
                for size, splits in self.graphs]
        if self._capture_family("gated decode steps", jobs, pool, self.gated_graphs):
            logger.info("captured %d gated decode CUDA graphs", len(self.gated_graphs))

    def _bitmask_words(self) -> int:
        return -(-self.vocab_size // 32)

    def _open_gate(self) -> np.ndarray:
        """A staged gate that a gated graph passes at once: a pinned flag already raised
        (target 0); its bitmask address is the flag's (no row reads it: capture stages every
        ``mask_rows`` entry -1)."""
        if self._gate_open is None:
            self._gate_open = torch.ones(1, dtype=torch.int32, pin_memory=self.device.type == "cuda")
        addr = self._gate_open.data_ptr()
        return np.array([addr, 0, addr], dtype=np.int64)

    def _stage_gate(self, grammar: GrammarOutput, req_ids: list[str], segs: BatchSegments, size: int) -> bool:
        """Write a gated step's gate and bitmask rows where its gated graph reads them (the
        host side of the staging buffer, before the upload); False, writing nothing, where
        that graph cannot read this bitmask (another width, or on CUDA not in pinned host
        memory, which the device reads at its host address)."""
        bitmask, gate = grammar.bitmask, grammar.gate
        if bitmask.shape[1] != self._bitmask_words() or not bitmask.is_contiguous():
            return False
        if self.device.type == "cuda" and not gate.pinned:
            return False
        rows = self._bitmask_row_list(grammar, req_ids)
        assert segs.gate is not None and segs.mask_rows is not None  # (reserved: the switch is on)
        sb = self.staging
        sb.host_view(segs.gate)[:] = (gate.flag.data_ptr(), gate.seq, bitmask.data_ptr())
        mask_rows = sb.host_view(segs.mask_rows)
        mask_rows[:size] = -1
        k = len(grammar.req_ids)
        if rows is None:
            mask_rows[:k] = np.arange(k)
        else:
            mask_rows[rows] = np.arange(k)
        return True

    def _masked_eager(self, logits: torch.Tensor, dest: torch.Tensor
                      ) -> Optional[tuple[torch.cuda.CUDAGraph, torch.Tensor, int]]:
        """An eager step's masked sampling graph, its inputs copied to where it reads them
        (destinations past the step's rows: the scratch row), or None past the largest bucket."""
        n = logits.shape[0]
        if not self.masked_eager_graphs or n > self.graph_sizes[-1]:
            return None
        size = self._bucket(n)
        self._mask_logits[:n].copy_(logits)
        self._mask_dest[:n].copy_(dest)
        if size > n:
            self._mask_dest[n:size].fill_(self.batch.scratch_row * self.batch.width)
        graph, ids = self.masked_eager_graphs[size]
        return graph, ids, size

    def _capture_batch(self, size: int, q: "int | np.ndarray") -> BatchSegments:
        """A harmless batch (scratch row, block 0, no cache writes) staged and uploaded at the
        staging offsets of its shape, which a step of that shape reuses."""
        sb = self.staging
        scratch = self.batch.scratch_row
        counts = np.full(size, q, dtype=np.int64) if isinstance(q, int) else q
        sb.begin(0)
        segs, (gather, positions, slots, rows, sl, qs, dest) = self._reserve_batch(int(counts.sum()), size)
        gather[:] = scratch * self.batch.width
        positions[:] = 0
        slots[:] = -1
        rows[:] = scratch
        sl[:] = counts
        qs[0] = 0
        np.cumsum(counts, out=qs[1:])
        dest[:] = scratch * self.batch.width
        if segs.gate is not None and segs.mask_rows is not None:  # a gated graph passes at once, masks nothing
            sb.host_view(segs.gate)[:] = self._open_gate()
            sb.host_view(segs.mask_rows)[:] = -1
        sb.upload()
        return segs

    # -- CUDA graphs of mixed batches (GPU-only, see tests/gpu) -------------------------------
    def _mixed_graph_body(self, segs: BatchSegments, num_tokens: int) -> tuple[torch.Tensor]:
        """A batch of up to ``num_tokens`` query tokens in any split among the sequence slots
        up to the hidden states: attention takes the token count as the bound of every query
        length, which makes its grid depend on the shapes alone (``paged_attention``'s packed
        grid), and one split (a mixed step never splits its keys)."""
        return (self._forward(segs, num_tokens, self.max_model_len, None, None, 1),)

    def _capture_mixed_graphs(self, pool: Any) -> None:
        """One graph per token bucket, over the largest decode bucket's sequence slots. A
        capture that fails leaves mixed batches eager."""
        seqs = self.graph_sizes[-1]
        jobs = []
        for tokens in reversed(self.mixed_graph_sizes):
            counts = np.full(seqs, tokens // seqs, dtype=np.int64)  # short contexts: block 0 only
            counts[: tokens % seqs] += 1
            jobs.append((tokens, seqs, counts, partial(self._mixed_graph_body, num_tokens=tokens)))
        if self._capture_family("mixed batches", jobs, pool, self.mixed_graphs):
            logger.info("captured %d mixed-batch CUDA graphs (token buckets %s, %d sequence slots)",
                        len(self.mixed_graphs), self.mixed_graph_sizes, seqs)

    def _capture_family(self, what: str, jobs: Sequence[tuple[Any, int, Any, Callable[..., Any]]],
                        pool: Any, into: dict[Any, Any]) -> bool:
        """Capture each job ``(key, sequences, tokens per sequence, body)`` into ``into[key]``
        as ``(graph, outputs)``, sharing ``pool``. One that fails leaves ``what`` eager (an
        optimization never fails start-up): False, ``into`` emptied."""
        try:
            for key, size, q, body in jobs:
                graph, outputs = self._capture(size, q, body, pool)
                pool = graph.pool()
                into[key] = (graph, outputs)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        except Exception as e:
            logger.warning("%s run eagerly: capturing their CUDA graphs failed (%s)", what, e)
            into.clear()
            return False
        return True

    # -- CUDA graphs of verify steps (speculative decoding; GPU-only, see tests/gpu) ----------
    def _verify_graph_body(self, segs: BatchSegments, num_kv_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A verify step up to the logits: every sequence has ``1 + k`` query tokens."""
        assert self.spec is not None
        hidden = self._forward(segs, 1 + self.spec.k, self.max_model_len, None, None, num_kv_splits)
        return hidden, self.model.compute_logits(hidden)

    def _capture_verify_graphs(self, pool: Any) -> None:
        """Graphs of the uniform verify batch (every request ``1 + k`` tokens), for the
        decode buckets up to 64 sequences (above, batches are compute-bound and usually
        have ``disable_by_batch_size`` turn speculation off). Keyed like the decode graphs,
        by (bucket, split-KV count), the count from ``_step_splits`` as ``_execute`` picks it
        (a verify step's queries are longer than one token: always one split). A capture
        that fails leaves verify steps eager."""
        assert self.spec is not None
        q = 1 + self.spec.k
        limit = self.spec_graph_limit
        sizes = [s for s in self.graph_sizes if s <= limit]
        jobs = []
        for size in reversed(sizes):
            splits = self._step_splits(size, q, self.max_model_len)
            jobs.append(((size, splits), size, q, partial(self._verify_graph_body, num_kv_splits=splits)))
        if self._capture_family("verify steps", jobs, pool, self.verify_graphs):
            logger.info("captured %d verify CUDA graphs (%d tokens per sequence, batch sizes %s)",
                        len(self.verify_graphs), q, sizes)

    def _verify_graph_size(self, plan: StepPlan) -> Optional[int]:
        """The bucket of a uniform verify batch that a captured graph can run, else None."""
        if not self.verify_graphs or self.spec is None or plan.drafts is None:
            return None
        q = 1 + self.spec.k
        if (plan.num_seqs > max(size for size, _ in self.verify_graphs) or int(plan.counts.min()) != q
                or int(plan.counts.max()) != q or not plan.samples.all()):
            return None
        return self._bucket(plan.num_seqs)

    # -- the step ------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> Optional[AsyncModelOutput]:
        """Launch one step. A step with constrained requests (``so.grammar_req_ids``) runs
        the forward pass and the LM head only and returns None: ``sample_tokens`` samples it."""
        self._pending = None  # a forward whose sampling never came (its step failed) is dropped
        try:
            return self._execute(so)
        except BaseException:
            # Stopped part-way (an error, or an interrupt in the host code): the engine fails
            # every request of the step and tells us again what to drop, so only what no
            # request id can reach must be put right here.
            self.batch.discard_unapplied()
            raise

    def prepare(self, so: SchedulerOutput) -> None:
        """Build step ``so``'s host inputs now, before the sampling call of the step launched
        last; ``execute_model(so)``, which must follow that call, then only uploads and
        launches them. With a constrained step in flight the engine core sends its sampling
        call as soon as the step's bitmask is filled, and the forward after it must wait for
        that call (it reads the sampled ids); building its inputs first takes that work off
        the path from the bitmask to the next forward. Nothing reaches the device here: the
        device buffers still hold the waiting step's inputs, which its sampling reads. An
        error is kept and raised by ``execute_model(so)``, the step's own call."""
        self._prepared = None
        if self.spec is not None:  # speculative steps stage against the proposer's state: not ahead
            return
        try:
            self._prepared = (so.step_id, self._prepare(so))
        except Exception as e:
            self.batch.discard_unapplied()
            self._prepared = (so.step_id, e)

    def _take_prepared(self, so: SchedulerOutput) -> Optional["PreparedStep"]:
        """The inputs ``prepare`` built for ``so``, if it did (raising its error); a step
        prepared but never launched (abandoned) is dropped."""
        prepared, self._prepared = self._prepared, None
        if prepared is None or prepared[0] != so.step_id:
            return None
        if isinstance(prepared[1], Exception):
            raise prepared[1]
        self.stats_prepared_steps += 1
        return prepared[1]

    def _execute(self, so: SchedulerOutput) -> Optional[AsyncModelOutput]:
        # On the step trace: "prepare" (the inputs built), then in ``_launch`` "forward" (the
        # upload and the forward's launch) and "sample" (the sampling's launch, to the end).
        trace = step_trace.TRACE
        if trace is not None:
            trace.mark("prepare", "b", so.step_id)
        prep = self._take_prepared(so) or self._prepare(so)
        if trace is not None:
            trace.mark("prepare", "e", so.step_id)
        if not prep.plan.num_seqs:  # nothing scheduled (e.g. a call that only primes the pipeline)
            empty = torch.empty(0, dtype=torch.int64, device=self.device)
            return AsyncModelOutput(so.step_id, [], empty, None, {}, self.copy_stream, self.host_ring)
        try:
            return self._launch(so, prep)
        finally:
            if trace is not None:
                trace.mark("sample", "e", so.step_id)

    def _prepare(self, so: SchedulerOutput) -> "PreparedStep":
        """Steps 1 and 2 on the host: the batch updated, every input packed into the staging
        buffer (not uploaded)."""
        plan = self._update_states(so)
        if not plan.num_seqs:
            return PreparedStep(plan)
        graph_size = self._graph_size(plan)
        verify_size = self._verify_graph_size(plan) if graph_size is None and self.verify_graphs else None
        mixed_size = self._mixed_graph_size(plan) if graph_size is None and verify_size is None else None
        sb = self.staging
        sb.begin(0)
        if mixed_size is not None:
            segs, qsl, seq_lens = self._stage_batch(plan, self.graph_sizes[-1], mixed_size)
        else:
            segs, qsl, seq_lens = self._stage_batch(plan, graph_size or verify_size or plan.num_seqs)
        writes = self._stage_table_writes()
        sample_idx = np.flatnonzero(plan.samples)
        layout: Optional[SampleLayout] = None
        if self.spec is not None:  # speculative decoding: 1 + k sampling rows per request
            layout = sample_layout(sample_idx, plan.drafts, plan.counts, qsl, seq_lens)
            row_idx, row_lens, rows_flat = layout.seq, layout.seq_lens, layout.logits_rows
        else:
            row_idx, row_lens, rows_flat = sample_idx, seq_lens[sample_idx], (qsl[1:] - 1)[sample_idx].astype(np.int64)
        logits_rows = sb.put(rows_flat)
        sample_dest = sb.put(plan.rows[row_idx].astype(np.int64) * self.batch.width + row_lens)
        sampling, plain_greedy = self._stage_sampling(plan, row_idx, row_lens)
        spec_staged = self._stage_spec(plan, layout, sample_idx, seq_lens) if layout is not None else None
        return PreparedStep(plan, graph_size, verify_size, mixed_size, segs, qsl, seq_lens, writes, sample_idx, layout,
                            row_idx, row_lens, logits_rows, sample_dest, sampling, plain_greedy, spec_staged)

    def _launch(self, so: SchedulerOutput, prep: "PreparedStep") -> Optional[AsyncModelOutput]:
        """Steps 3 and 4: upload, run the forward pass, and sample unless constrained."""
        plan, graph_size, verify_size, segs = prep.plan, prep.graph_size, prep.verify_size, prep.segs
        qsl, seq_lens, writes, sample_idx, layout = prep.qsl, prep.seq_lens, prep.writes, prep.sample_idx, prep.layout
        row_idx, logits_rows, sample_dest, sampling = prep.row_idx, prep.logits_rows, prep.sample_dest, prep.sampling
        plain_greedy, spec_staged = prep.plain_greedy, prep.spec_staged
        assert logits_rows is not None and sample_dest is not None and sampling is not None  # a step was scheduled
        sb = self.staging
        trace = step_trace.TRACE
        if trace is not None:
            trace.mark("forward", "b", so.step_id)
        n = len(row_idx)
        max_query_len, max_seq_len = int(plan.counts.max()), int(seq_lens.max())
        splits = self._step_splits(plan.num_seqs, max_query_len, max_seq_len)
        all_rows = n == plan.num_seqs and max_query_len == 1
        req_ids = [plan.states[i].req_id for i in sample_idx.tolist()]
        gated = None  # a gated greedy decode step: its graph waits, masks and samples too
        if (so.grammar is not None and self.gated_graphs and graph_size is not None and all_rows and plain_greedy
                and spec_staged is None):
            gated = self.gated_graphs.get((graph_size, splits))
            if gated is not None and not self._stage_gate(so.grammar, req_ids, segs, graph_size):
                gated = None
        sb.upload()
        self.stats_steps += 1

        self._apply_table_writes(writes)
        verify: Optional[VerifyInputs] = None
        seq_lens_host = seq_lens
        if spec_staged is not None:
            verify, corr_rows, corrected = self._spec_inputs(plan, segs, sample_dest, spec_staged)
            if corrected is not None:
                seq_lens_host = corrected
                sampling = partial(sampling, corr_rows)
        graph_logits = graph_ids = None
        if graph_size is not None:
            graph, (hidden, graph_logits, graph_ids) = gated or self.graphs[(graph_size, splits)]
            self._await_static_reads()
            graph.replay()
            self.stats_graph_steps += 1
            if gated is not None:
                self.stats_gated_graph_steps += 1
        elif verify_size is not None:
            vgraph, (hidden, graph_logits) = self.verify_graphs[(verify_size, splits)]
            vgraph.replay()
            self.stats_graph_steps += 1
        elif prep.mixed_size is not None:  # the rows past the batch's tokens are padding
            mgraph, (hidden,) = self.mixed_graphs[prep.mixed_size]
            mgraph.replay()
            self.stats_graph_steps += 1
            self.stats_mixed_graph_steps += 1
        else:
            hidden = self._forward(segs, max_query_len, max_seq_len, qsl, seq_lens_host, splits)
        if self.spec is not None and self.spec.draft is not None:  # the draft's cache follows the target's
            self._forward(segs, max_query_len, max_seq_len, qsl, seq_lens_host, splits, self.spec.draft)

        prompt_out = self._prompt_logprobs(plan, qsl, hidden)
        if trace is not None:
            trace.mark("forward", "e", so.step_id)
            trace.mark("sample", "b", so.step_id)
        if not n:
            empty = torch.empty(0, dtype=torch.int64, device=self.device)
            return AsyncModelOutput(so.step_id, req_ids, empty, None, prompt_out, self.copy_stream, self.host_ring)
        # Feed the device-side token table: step N+1 reads the sampled ids from here.
        dest = sb.view(segs.dest)[:n] if all_rows else sb.view(sample_dest)
        if graph_ids is not None and plain_greedy and (gated is not None or not so.grammar_req_ids):
            # The graph already chose and stored the greedy tokens (no drafts: its steps have
            # one token per sequence), masked in a gated graph.
            sampled = graph_ids[:n] if all_rows else graph_ids[sb.view(logits_rows)]
            if verify is not None and self.spec is not None:
                self.spec.propose(self.batch.token_table, verify.rows, verify.base_len + 1, verify.window,
                                  self.batch.block_table_device)
                self.spec.last_rejected[verify.rows] = 0
            return self._static_read(AsyncModelOutput(so.step_id, req_ids, sampled, None, prompt_out, self.copy_stream,
                                                      self.host_ring), all_rows)
        if graph_logits is not None:
            logits = graph_logits[:n] if all_rows else graph_logits[sb.view(logits_rows)]
        else:
            h = hidden[:n] if all_rows else hidden[sb.view(logits_rows)]
            logits = self.model.compute_logits(h)  # every rank: the LM head gathers
        masked = None
        if plain_greedy and so.grammar_req_ids and verify is None:  # (no masked graphs under TP)
            if graph_size is not None and all_rows:
                graph_entry = self.masked_graphs.get((graph_size, splits))
                masked = (*graph_entry, graph_size) if graph_entry is not None else None
            elif graph_size is None:
                masked = self._masked_eager(logits, dest)
        forward = LaunchedForward(so.step_id, req_ids, logits, sampling, dest, prompt_out, verify, masked,
                                  layout.num_rows if layout is not None and layout.num_drafts else None,
                                  layout.num_rows if layout is not None else None)
        if so.grammar is not None:  # gated: sample now, behind the wait for the bitmask
            self._await_gate(so.grammar)
            return self._sample(forward, so.grammar)
        if so.grammar_req_ids:
            self._pending = forward
            return None
        return self._sample(forward, None)

    def _await_gate(self, grammar: GrammarOutput) -> None:
        """Make what follows wait until the gated bitmask is filled: on CUDA a wait queued on
        the stream (the copies of the bitmask that ``_sample`` queues read it after that), on
        the CPU (or a bitmask not in pinned memory, copied at once) here, on the host."""
        gate = grammar.gate
        if self.device.type == "cuda" and gate.pinned:
            from tandem.kernels.host_flag import wait_for_host_flag

            wait_for_host_flag(gate.flag, gate.seq)
        else:
            gate.wait()

    def _static_read(self, out: AsyncModelOutput, static: bool = True) -> AsyncModelOutput:
        """``out``'s ids are a view of a graph's output buffer, which the next replay of a
        graph writing one rewrites: remember its host copy (on the side stream), which that
        replay must follow (``_await_static_reads``)."""
        if static:
            self._static_copy = out.copy_event
        return out

    def _await_static_reads(self) -> None:
        """Order the next replay after the host copy of the last ids read from a graph's
        output buffer. Normally long done (the copy follows the sampling, the replay a whole
        host step later), so the wait costs nothing; it makes the reuse safe, not likely."""
        if self._static_copy is not None:
            torch.cuda.current_stream().wait_event(self._static_copy)
            self._static_copy = None

    @torch.inference_mode()
    def sample_tokens(self, grammar: GrammarOutput) -> AsyncModelOutput:
        """Sample the constrained step whose forward ``execute_model`` just launched: its
        requests' logits are masked with ``grammar.bitmask`` first."""
        forward, self._pending = self._pending, None
        if forward is None or forward.step_id != grammar.step_id:
            have = "none" if forward is None else f"step {forward.step_id}'s"
            raise RuntimeError(f"sample_tokens for step {grammar.step_id}, but the forward waiting to be sampled "
                               f"is {have} (did that step's execute_model fail?)")
        return self._sample(forward, grammar)

    def _sample(self, fw: "LaunchedForward", grammar: Optional[GrammarOutput]) -> AsyncModelOutput:
        """Rank 0 masks (constrained steps) and samples; every rank gets the ids and writes
        them into its token table."""
        logprobs: Optional[LogprobsTensors] = None
        if grammar is not None and fw.masked_graph is not None:  # a greedy decode step: one replay
            graph, ids, size = fw.masked_graph
            rows = self._bitmask_row_list(grammar, fw.req_ids)
            self.bitmasks.stage_for_graph(grammar.bitmask, rows, size)
            self._await_static_reads()
            graph.replay()
            self.stats_masked_graph_steps += 1
            return self._static_read(AsyncModelOutput(fw.step_id, fw.req_ids, ids[:len(fw.req_ids)], None,
                                                      fw.prompt_logprobs, self.copy_stream, self.host_ring))
        verify = fw.spec
        mask = None
        if grammar is not None and fw.row_counts is not None:  # every rank: the cut is part of verification
            mask, cut = self._grammar_rows(grammar, fw)
            if verify is not None:  # drafts the grammar refuses are never accepted
                verify = dataclasses.replace(verify, is_draft_row=verify.is_draft_row & cut)
        if self.tp_rank == 0:
            if mask is not None:
                apply_token_bitmask(fw.logits, mask)
            elif grammar is not None and grammar.req_ids:
                apply_token_bitmask(fw.logits, *self._bitmask_rows(grammar, fw.req_ids))
            result = self.sampler(fw.logits, fw.sampling())
            sampled, logprobs = result.sampled_token_ids, result.logprobs
        else:
            sampled = torch.empty(fw.logits.shape[0], dtype=torch.int64, device=self.device)  # one per row
        tp_broadcast(sampled, src=0)
        table = self.batch.token_table
        if fw.spec is None:
            table.view(-1).index_copy_(0, fw.dest, sampled)
            return AsyncModelOutput(fw.step_id, fw.req_ids, sampled, logprobs, fw.prompt_logprobs, self.copy_stream,
                                    self.host_ring)
        # Speculative decoding (every rank: the ids are the same everywhere): verify the
        # drafts (read before the ids overwrite them), then propose after the emitted tokens.
        assert self.spec is not None and verify is not None
        num_emitted = self.spec.verify(table, fw.dest, sampled, verify)
        table.view(-1).index_copy_(0, fw.dest, sampled)
        lengths = verify.base_len + num_emitted
        self.spec.propose(table, verify.rows, lengths, verify.window, self.batch.block_table_device)
        spec_out = (num_emitted, fw.spec_rows) if fw.spec_rows is not None else None
        drafts = None
        if grammar is not None:  # the engine core builds the next masks over these drafts
            pos = {rid: i for i, rid in enumerate(fw.req_ids)}
            cols = (lengths[:, None] + torch.arange(self.spec.k, device=self.device)).clamp(max=self.batch.width - 1)
            drafts = (table[verify.rows[:, None], cols], [(rid, pos[rid]) for rid in grammar.req_ids])
        return AsyncModelOutput(fw.step_id, fw.req_ids, sampled, logprobs, fw.prompt_logprobs, self.copy_stream,
                                self.host_ring, spec_out, drafts)

    def _grammar_rows(self, grammar: GrammarOutput, fw: LaunchedForward) -> tuple[torch.Tensor, torch.Tensor]:
        """Speculative decoding: the bitmask by sampled row (``1 + k`` per request), on the
        device, and which rows' drafts the grammar allows ([R] bool); the flags travel as one
        more column of the staged bitmask."""
        counts = fw.row_counts
        assert counts is not None
        first = (np.cumsum(counts) - counts).tolist()
        pos = {rid: i for i, rid in enumerate(fw.req_ids)}
        n_rows = grammar.num_rows or [1] * len(grammar.req_ids)
        valid = grammar.num_valid_drafts or [0] * len(grammar.req_ids)
        words = grammar.bitmask.shape[1]
        ext = torch.empty((grammar.bitmask.shape[0], words + 1), dtype=torch.int32)
        ext[:, :words] = grammar.bitmask
        rows: list[int] = []
        g = 0
        for c, rid in enumerate(grammar.req_ids):
            s = pos.get(rid)
            if s is None or int(counts[s]) != n_rows[c]:
                raise RuntimeError(f"step {grammar.step_id}: bitmask rows of {rid!r} do not match its sampled rows")
            m = n_rows[c]
            rows += range(first[s], first[s] + m)
            ext[g:g + m, words] = (torch.arange(m) < valid[c]).to(torch.int32)
            g += m
        dev = self.bitmasks.stage(ext, rows, int(counts.sum()))
        return dev[:, :words].contiguous(), dev[:, words] != 0

    def _bitmask_rows(self, grammar: GrammarOutput, req_ids: list[str]
                      ) -> tuple[torch.Tensor, Optional[torch.Tensor | list[int]]]:
        """The bitmask by sampled row on the device, and the rows it constrains (None: all);
        only the constrained rows are copied."""
        return self.bitmasks.stage_rows(grammar.bitmask, self._bitmask_row_list(grammar, req_ids), len(req_ids))

    @staticmethod
    def _bitmask_row_list(grammar: GrammarOutput, req_ids: list[str]) -> Optional[list[int]]:
        """The sampled row of each bitmask row (None: every row, in order)."""
        if grammar.req_ids == req_ids:  # every sampled row constrained, in order (no index to build)
            return None
        pos = {rid: k for k, rid in enumerate(req_ids)}
        missing = [rid for rid in grammar.req_ids if rid not in pos]
        if missing:
            raise RuntimeError(f"step {grammar.step_id}: bitmask rows for requests that do not sample: {missing}")
        return [pos[rid] for rid in grammar.req_ids]

    # -- 4. sampling inputs ----------------------------------------------------------------
    def _stage_sampling(self, plan: StepPlan, sample_idx: np.ndarray,
                        row_lens: np.ndarray) -> tuple[Callable[..., SamplingMetadata], bool]:
        """Stage the sampled rows' parameters (row ``r`` samples for the request at batch
        index ``sample_idx[r]`` at sequence length ``row_lens[r]``: a request verifying
        drafts has several rows). Returns a thunk that builds the metadata from device views
        after the upload (only the settings some row uses travel; its optional argument moves
        each row's length back on the device, see ``tandem.worker.speculative``), and whether
        the step is plain greedy (argmax alone decides: a decode graph's own choice stands)."""
        b = self.batch
        sb = self.staging
        rows = plan.rows[sample_idx]
        temps = b.temperature[rows]
        greedy = temps == 0.0
        all_greedy = bool(greedy.all())
        seg: dict[str, Segment] = {}
        if not all_greedy:
            seg["temperature"] = sb.put(temps)
            if (b.top_k[rows] > 0).any():
                seg["top_k"] = sb.put(b.top_k[rows].astype(np.int64))
            if (b.top_p[rows] < 1.0).any():
                seg["top_p"] = sb.put(b.top_p[rows])
            if (b.min_p[rows] > 0.0).any():
                seg["min_p"] = sb.put(b.min_p[rows])
            seeded = np.flatnonzero(b.seeded[rows])
            if len(seeded):
                seg["seeded_rows"] = sb.put(seeded.astype(np.int64))
                seg["seeds"] = sb.put(b.seed[rows[seeded]])
                n_out = row_lens - b.num_prompt_tokens[rows]
                seg["output_index"] = sb.put(n_out[seeded].astype(np.int64))
        n_out_all = row_lens - b.num_prompt_tokens[rows]
        if (n_out_all < b.min_tokens[rows]).any():
            seg["min_tokens_rows"], seg["min_tokens_cols"] = self._stage_min_tokens(plan, sample_idx, n_out_all)
        if b.logit_bias:
            biased = [(k, b.logit_bias[r]) for k, r in enumerate(rows.tolist()) if r in b.logit_bias]
            if biased:
                vocab = self.vocab_size
                seg["logit_bias_index"] = sb.put(np.concatenate([k * vocab + ids for k, (ids, _) in biased]))
                seg["logit_bias_values"] = sb.put(np.concatenate([vals for _, (_, vals) in biased]))
        use_pen = b.uses_penalties[rows].any()
        if use_pen:
            seg["repetition_penalty"] = sb.put(b.repetition_penalty[rows])
            seg["frequency_penalty"] = sb.put(b.frequency_penalty[rows])
            seg["presence_penalty"] = sb.put(b.presence_penalty[rows])
            seg["pen_rows"] = sb.put(rows.astype(np.int64))
            seg["pen_plen"] = sb.put(b.num_prompt_tokens[rows].astype(np.int64))
            seg["pen_slen"] = sb.put(row_lens.astype(np.int64))
            max_p = int(b.num_prompt_tokens[rows].max())
            max_o = int(max(n_out_all.max(), 1))
        lp = b.num_logprobs[rows]
        max_lp = int(lp.max()) if (lp >= 0).any() else None
        plain_greedy = (all_greedy and max_lp is None and not use_pen and "min_tokens_rows" not in seg
                        and "logit_bias_index" not in seg)

        views = {k: sb.view(s) for k, s in seg.items()}  # bound now: the buffer may be packing the next step

        def build(corr_rows: Optional[torch.Tensor] = None) -> SamplingMetadata:
            v = dict(views)
            if corr_rows is not None:  # positions were optimistic (speculative decoding, async)
                if "pen_slen" in v:
                    v["pen_slen"] = v["pen_slen"] - corr_rows
                if "output_index" in v:
                    v["output_index"] = v["output_index"] - corr_rows[v["seeded_rows"]]
            md = SamplingMetadata(
                temperature=v.get("temperature", torch.zeros(0, device=self.device)),
                all_greedy=all_greedy,
                all_random=not bool(greedy.any()),
                top_k=v.get("top_k"), top_p=v.get("top_p"), min_p=v.get("min_p"),
                repetition_penalty=None, frequency_penalty=None, presence_penalty=None,
                prompt_token_ids=None, output_token_ids=None,
                max_num_logprobs=max_lp,
                seeded_rows=v.get("seeded_rows"), seeds=v.get("seeds"), output_index=v.get("output_index"),
                min_tokens_rows=v.get("min_tokens_rows"), min_tokens_cols=v.get("min_tokens_cols"),
                logit_bias_index=v.get("logit_bias_index"), logit_bias_values=v.get("logit_bias_values"),
            )
            if use_pen:
                md.repetition_penalty = v["repetition_penalty"]
                md.frequency_penalty = v["frequency_penalty"]
                md.presence_penalty = v["presence_penalty"]
                md.prompt_token_ids, md.output_token_ids = self._penalty_tokens(
                    v["pen_rows"], v["pen_plen"], v["pen_slen"], max_p, max_o)
            return md

        return build, plain_greedy

    def _stage_min_tokens(self, plan: StepPlan, sample_idx: np.ndarray, n_out: np.ndarray) -> tuple[Segment, Segment]:
        """(row, token) pairs to forbid: stop ids and EOS of rows short of min_tokens."""
        rows_l: list[int] = []
        cols_l: list[int] = []
        for k in np.flatnonzero(n_out < self.batch.min_tokens[plan.rows[sample_idx]]).tolist():
            st = plan.states[int(sample_idx[k])]
            sp = st.sampling_params
            banned = list(sp.stop_token_ids) + ([] if sp.ignore_eos else list(st.eos_token_ids))
            rows_l += [k] * len(banned)
            cols_l += banned
        sb = self.staging
        return sb.put(np.asarray(rows_l, dtype=np.int64)), sb.put(np.asarray(cols_l, dtype=np.int64))

    def _penalty_tokens(self, rows: torch.Tensor, p_len: torch.Tensor, s_len: torch.Tensor, max_p: int,
                        max_o: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompt and output ids of each sampling row, gathered from the token table on the device."""
        width = self.batch.width
        dev = self.device
        table = self.batch.token_table
        pi = torch.arange(max_p, device=dev)[None, :]
        prompt = table[rows[:, None], pi.clamp(max=width - 1)]
        prompt = torch.where(pi < p_len[:, None], prompt, self.vocab_size)
        oi = torch.arange(max_o, device=dev)[None, :] + p_len[:, None]
        out = table[rows[:, None], oi.clamp(max=width - 1)]
        out = torch.where(oi < s_len[:, None], out, self.vocab_size)
        return prompt, out

    # -- speculative decoding (tandem.worker.speculative) -------------------------------------
    def _stage_spec(self, plan: StepPlan, layout: SampleLayout, sample_idx: np.ndarray,
                    seq_lens: np.ndarray) -> Optional[tuple[dict[str, Segment], int]]:
        """Stage what verification, the proposer and the correction of optimistic positions
        read; with the proposer's window (a host bound on every sampling request's length)."""
        if not len(sample_idx):
            return None
        assert plan.correct is not None
        sb = self.staging
        m = layout.num_rows
        first = np.cumsum(m) - m
        j = np.arange(int(m.sum()), dtype=np.int64) - np.repeat(first, m)
        segs = {
            "row_seq": sb.put(np.repeat(np.arange(len(m), dtype=np.int64), m)),
            "is_draft": sb.put((j < np.repeat(m - 1, m)).astype(np.int32)),
            "first_row": sb.put(np.repeat(first, m)),
            "rows": sb.put(plan.rows[sample_idx].astype(np.int64)),
            "drafts": sb.put(layout.drafts),
            "base_len": sb.put(seq_lens[sample_idx].astype(np.int64) - layout.drafts),
        }
        if plan.correct.any():
            segs["flags"] = sb.put(plan.correct.astype(np.int64))
            segs["tok_seq"] = sb.put(np.repeat(np.arange(plan.num_seqs, dtype=np.int64), plan.counts))
            segs["row_b"] = sb.put(layout.seq)
            segs["sample_idx"] = sb.put(sample_idx.astype(np.int64))
        return segs, int(seq_lens[sample_idx].max()) + 1

    def _spec_inputs(self, plan: StepPlan, segs: BatchSegments, sample_dest: Segment,
                     staged: tuple[dict[str, Segment], int]
                     ) -> tuple[VerifyInputs, Optional[torch.Tensor], Optional[np.ndarray]]:
        """The verify inputs, after moving optimistic positions back on the device (async
        scheduling after a verify step); with each sampling row's correction and the
        corrected sequence lengths for the host (None: nothing was optimistic)."""
        assert self.spec is not None
        sb = self.staging
        v = {k: sb.view(seg) for k, seg in staged[0].items()}
        base_len = v["base_len"]
        corr_rows = corrected = None
        if "flags" in v:
            B, T = plan.num_seqs, int(plan.counts.sum())
            rows_b = sb.view(segs.rows)[:B]
            corr = self.spec.corrections(rows_b, v["flags"])
            tok_seq = v["tok_seq"]
            SpecDecoder.correct_tokens(corr[tok_seq], sb.view(segs.positions)[:T], sb.view(segs.gather)[:T],
                                       sb.view(segs.slots)[:T], rows_b.long()[tok_seq], self.batch.block_table_device,
                                       self.block_size)
            lens = sb.view(segs.seq_lens)[:B]
            lens.sub_(corr.to(lens.dtype))
            sb.view(segs.dest)[:B].sub_(corr)
            corr_rows = corr[v["row_b"]]
            sb.view(sample_dest).sub_(corr_rows)
            base_len = base_len - corr[v["sample_idx"]]
            # The SDPA backend loops over sequences on the host (on CUDA this waits for the
            # device; the Triton backend reads the device lengths and does not).
            corrected = lens.cpu().numpy().copy() if self.backend == "sdpa" else plan.starts + plan.counts
        verify = VerifyInputs(v["row_seq"], v["is_draft"].bool(), v["first_row"], v["rows"], v["drafts"], base_len,
                              staged[1])
        return verify, corr_rows, corrected

    def _prompt_logprobs(self, plan: StepPlan, qsl: np.ndarray, hidden: torch.Tensor) -> dict[str, LogprobsTensors]:
        """Logprobs of each prompt position in this step's chunk (target = next prompt token)."""
        out: dict[str, LogprobsTensors] = {}
        if not self.batch.num_prompt_logprobs:  # the common case: no row to look at
            return out
        for i, st in enumerate(plan.states):
            k = st.sampling_params.prompt_logprobs
            start = int(plan.starts[i])
            if k is None or start >= st.num_prompt_tokens - 1:
                continue
            count = min(start + int(plan.counts[i]), st.num_prompt_tokens - 1) - start
            tok0 = int(qsl[i])
            logits = self.model.compute_logits(hidden[tok0:tok0 + count])  # collective under TP
            if self.tp_rank != 0:
                continue
            targets = self.batch.token_table[st.row, start + 1:start + 1 + count]
            out[st.req_id] = gather_logprobs(torch.log_softmax(logits.float(), dim=-1), targets, k)
        return out
