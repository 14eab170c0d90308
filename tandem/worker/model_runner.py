"""Turns a ``SchedulerOutput`` into one forward pass + sampling, without waiting for it.

``execute_model`` updates the persistent batch, gathers inputs from the device-side token
table, launches the model and the sampler, scatters the sampled ids back into the table
(so the next step can read them on the device), and returns an ``AsyncModelOutput``. The
host copy of the sampled ids (and logprobs) runs on a side CUDA stream into pinned memory;
``AsyncModelOutput.get()`` waits on that copy's event only when the engine needs the tokens.
On the CPU there is no stream: the same object simply holds finished tensors.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
import xxhash

from tandem.distributed import get_tp_rank, tp_broadcast
from tandem.layers.attention import AttentionMetadata, set_forward_context
from tandem.layers.sampler import LogprobsTensors, Sampler, SamplingMetadata, gather_logprobs
from tandem.types.scheduler_output import SchedulerOutput
from tandem.worker.async_output import AsyncModelOutput
from tandem.worker.input_batch import CachedRequestState, InputBatch

logger = logging.getLogger(__name__)


def token_seed(sample_seed: int, output_index: int) -> int:
    """Seed of the noise for a request's ``output_index``-th token.

    Stateless on purpose: the same token gets the same noise whatever the batch, whether
    or not the request was preempted and recomputed, and whether steps ran ahead (async).
    """
    h = xxhash.xxh3_64()
    h.update(sample_seed.to_bytes(8, "little", signed=True))
    h.update(output_index.to_bytes(8, "little"))
    return h.intdigest() & 0x7FFF_FFFF_FFFF_FFFF


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        vocab_size: int,
        block_size: int,
        max_model_len: int,
        max_num_seqs: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.model = model
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.device = device
        self.dtype = dtype
        # Twice the running set: a finished request keeps its row until the worker hears of
        # it, while its replacement may already have arrived.
        self.batch = InputBatch(2 * max_num_seqs + 4, max_model_len, device)
        self.sampler = Sampler()
        self.kv_caches: list[torch.Tensor] = []
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # With tensor parallelism only rank 0 samples; the others receive its ids by broadcast
        # so every rank's token table (hence every rank's next input) stays identical.
        self.tp_rank = get_tp_rank()

    def init_kv_cache(self, num_blocks: int, num_layers: int, num_kv_heads: int, head_dim: int) -> None:
        self.kv_caches = [
            torch.zeros(2, num_blocks, self.block_size, num_kv_heads, head_dim, dtype=self.dtype, device=self.device)
            for _ in range(num_layers)
        ]

    # -- one step ---------------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> list[CachedRequestState]:
        for rid in so.finished_req_ids:
            self.batch.remove(rid)
        for rid in so.preempted_req_ids:
            self.batch.remove(rid)
        states = []
        for r in so.requests:
            if r.new is not None:
                states.append(self.batch.add(r.req_id, r.new, r.new_block_ids))
            else:
                st = self.batch.requests.get(r.req_id)
                if st is None:
                    raise RuntimeError(f"worker has no state for request {r.req_id!r} (step {so.step_id})")
                st.block_ids.extend(r.new_block_ids)
                states.append(st)
        return states

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> AsyncModelOutput:
        states = self._update_states(so)
        if not states:  # nothing scheduled (e.g. a call that only primes the pipeline)
            empty = torch.empty(0, dtype=torch.int64, device=self.device)
            return AsyncModelOutput(so.step_id, [], empty, None, {}, self.copy_stream)
        width = self.batch.width
        positions: list[int] = []
        flat_index: list[int] = []
        query_lens, seq_lens, block_tables = [], [], []
        logits_rows: list[int] = []  # token index whose logits sample
        sample_states: list[tuple[CachedRequestState, int]] = []  # (state, seq_len)
        prompt_lp: list[tuple[CachedRequestState, int, int, int]] = []  # (state, tok0, pos0, count)
        tok = 0
        for r, st in zip(so.requests, states):
            start, n = r.num_computed_tokens, r.num_scheduled_tokens
            end = start + n
            positions.extend(range(start, end))
            base = st.row * width
            flat_index.extend(range(base + start, base + end))
            query_lens.append(n)
            seq_lens.append(end)
            block_tables.append(st.block_ids)
            want_plp = st.sampling_params.prompt_logprobs is not None and start < st.num_prompt_tokens - 1
            if want_plp:
                count = min(end, st.num_prompt_tokens - 1) - start
                prompt_lp.append((st, tok, start, count))
            if r.samples:
                logits_rows.append(tok + n - 1)
                sample_states.append((st, end))
            tok += n

        dev = self.device
        flat_t = torch.tensor(flat_index, dtype=torch.int64).to(dev, non_blocking=True)
        table = self.batch.token_table.view(-1)
        input_ids = table[flat_t]
        pos_t = torch.tensor(positions, dtype=torch.int64).to(dev, non_blocking=True)
        md = AttentionMetadata.build(query_lens, seq_lens, block_tables, self.block_size, dev)
        with set_forward_context(md, self.kv_caches):
            hidden = self.model(input_ids, pos_t)

        # Prompt logprobs: logits at each prompt position of the chunk, target = next token.
        prompt_out: dict[str, LogprobsTensors] = {}
        for st, tok0, pos0, count in prompt_lp:
            if count <= 0:
                continue
            logits = self.model.compute_logits(hidden[tok0:tok0 + count])  # collective under TP
            if self.tp_rank != 0:
                continue
            targets = self.batch.token_table[st.row, pos0 + 1:pos0 + 1 + count]
            k = st.sampling_params.prompt_logprobs or 0
            prompt_out[st.req_id] = gather_logprobs(torch.log_softmax(logits.float(), dim=-1), targets, k)

        req_ids = [st.req_id for st, _ in sample_states]
        if sample_states:
            rows_t = torch.tensor(logits_rows, dtype=torch.int64).to(dev, non_blocking=True)
            logits = self.model.compute_logits(hidden[rows_t])  # every rank: the LM head gathers
            if self.tp_rank == 0:
                result = self.sampler(logits, self._sampling_metadata(sample_states))
                sampled, logprobs = result.sampled_token_ids, result.logprobs
            else:
                sampled = torch.empty(len(sample_states), dtype=torch.int64, device=dev)
                logprobs = None
            tp_broadcast(sampled, src=0)
            # Feed the device-side token table: step N+1 reads these ids from here.
            dest = torch.tensor([st.row * width + end for st, end in sample_states], dtype=torch.int64)
            table.index_copy_(0, dest.to(dev, non_blocking=True), sampled)
        else:
            sampled = torch.empty(0, dtype=torch.int64, device=dev)
            logprobs = None
        return AsyncModelOutput(so.step_id, req_ids, sampled, logprobs, prompt_out, self.copy_stream)

    def _sampling_metadata(self, sample_states: list[tuple[CachedRequestState, int]]) -> SamplingMetadata:
        dev = self.device
        temps, top_k, top_p, min_p = [], [], [], []
        rep, freq, pres = [], [], []
        generators: dict[int, torch.Generator] = {}
        min_tok_mask: list[tuple[int, list[int]]] = []
        max_lp: Optional[int] = None
        use_pen = False
        for i, (st, seq_len) in enumerate(sample_states):
            sp = st.sampling_params
            temps.append(0.0 if sp.greedy else sp.temperature)
            top_k.append(sp.top_k)
            top_p.append(sp.top_p)
            min_p.append(sp.min_p)
            rep.append(sp.repetition_penalty)
            freq.append(sp.frequency_penalty)
            pres.append(sp.presence_penalty)
            use_pen |= sp.uses_penalties
            n_out = seq_len - st.num_prompt_tokens  # tokens already generated before this one
            if st.sample_seed is not None and not sp.greedy:
                g = torch.Generator(device=dev)
                g.manual_seed(token_seed(st.sample_seed, n_out))
                generators[i] = g
            if n_out < sp.min_tokens:
                banned = list(sp.stop_token_ids) + ([] if sp.ignore_eos else list(st.eos_token_ids))
                if banned:
                    min_tok_mask.append((i, banned))
            if sp.logprobs is not None:
                max_lp = max(max_lp or 0, sp.logprobs)
        all_greedy = all(t == 0.0 for t in temps)
        meta = SamplingMetadata(
            temperature=torch.tensor(temps, dtype=torch.float32).to(dev),
            all_greedy=all_greedy,
            all_random=all(t > 0.0 for t in temps),
            top_k=torch.tensor(top_k, dtype=torch.int64).to(dev) if any(k > 0 for k in top_k) else None,
            top_p=torch.tensor(top_p, dtype=torch.float32).to(dev) if any(p < 1.0 for p in top_p) else None,
            min_p=torch.tensor(min_p, dtype=torch.float32).to(dev) if any(p > 0.0 for p in min_p) else None,
            repetition_penalty=None,
            frequency_penalty=None,
            presence_penalty=None,
            prompt_token_ids=None,
            output_token_ids=None,
            generators=generators,
            min_tokens_mask=min_tok_mask,
            max_num_logprobs=max_lp,
        )
        if use_pen:
            meta.repetition_penalty = torch.tensor(rep, dtype=torch.float32).to(dev)
            meta.frequency_penalty = torch.tensor(freq, dtype=torch.float32).to(dev)
            meta.presence_penalty = torch.tensor(pres, dtype=torch.float32).to(dev)
            meta.prompt_token_ids, meta.output_token_ids = self._penalty_tokens(sample_states)
        return meta

    def _penalty_tokens(self, sample_states: list[tuple[CachedRequestState, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompt and output ids of each sampling row, gathered from the token table on the device."""
        max_p = max(st.num_prompt_tokens for st, _ in sample_states)
        max_o = max(max(seq_len - st.num_prompt_tokens, 0) for st, seq_len in sample_states) or 1
        width = self.batch.width
        rows = torch.tensor([st.row for st, _ in sample_states], dtype=torch.int64)
        p_len = torch.tensor([st.num_prompt_tokens for st, _ in sample_states], dtype=torch.int64)
        s_len = torch.tensor([seq_len for _, seq_len in sample_states], dtype=torch.int64)
        dev = self.device
        rows, p_len, s_len = rows.to(dev), p_len.to(dev), s_len.to(dev)
        table = self.batch.token_table
        pi = torch.arange(max_p, device=dev)[None, :]
        prompt = table[rows[:, None], pi.clamp(max=width - 1)]
        prompt = torch.where(pi < p_len[:, None], prompt, self.vocab_size)
        oi = torch.arange(max_o, device=dev)[None, :] + p_len[:, None]
        out = table[rows[:, None], oi.clamp(max=width - 1)]
        out = torch.where(oi < s_len[:, None], out, self.vocab_size)
        return prompt, out
