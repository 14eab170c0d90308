"""Tensor-parallel model layers: TP=2 over gloo gives the TP=1 logits, and each rank loads
exactly its slice of every checkpoint tensor."""
from __future__ import annotations

import contextlib
import multiprocessing
import pickle
import socket
import traceback
from typing import Iterator

import pytest
import torch

from tandem.config import ModelConfig
from tandem.distributed import destroy_tensor_parallel, init_tensor_parallel, parallel_state
from tandem.layers.attention import AttentionMetadata, set_forward_context
from tandem.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from tandem.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from tandem.models.loader import load_hf_config, load_model

BLOCK = 4
# (seq id, tokens) chunks per step: two prompts (one chunked), then decodes.
STEPS = [
    [(0, [3, 9, 17, 4, 22, 8, 5]), (1, [40, 41, 42, 43, 44])],
    [(1, [45, 46, 47]), (2, [7, 7, 2])],
    [(0, [11]), (1, [12]), (2, [13])],
    [(0, [14]), (1, [15]), (2, [16])],
]


@contextlib.contextmanager
def pretend_tp_rank(monkeypatch: pytest.MonkeyPatch, rank: int, world_size: int) -> Iterator[None]:
    """Layers built inside the ``with`` block see ``rank``/``world_size`` without a process
    group (for checking weight sharding; no collective may run). The previous state is
    restored on exit."""
    with monkeypatch.context() as mp:
        mp.setattr(parallel_state, "_STATE", parallel_state._TPState(rank=rank, world_size=world_size))
        yield


def paged_logits(folder: str, world_size: int) -> torch.Tensor:
    """All logits of ``STEPS`` through the paged cache (this process's rank of the model)."""
    cfg = load_hf_config(folder)
    model = load_model(folder, torch.float32, "cpu")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = max(1, (getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads) // world_size)
    g = torch.Generator().manual_seed(0)  # garbage in unwritten slots would show
    kv = [torch.randn(2, 32, BLOCK, kv_heads, head_dim, generator=g) for _ in range(cfg.num_hidden_layers)]
    tables: dict[int, list[int]] = {}
    lens: dict[int, int] = {}
    free = list(range(31, -1, -1))
    out = []
    for chunks in STEPS:
        ids, pos, qlens, slens, tabs = [], [], [], [], []
        for sid, toks in chunks:
            start = lens.get(sid, 0)
            end = start + len(toks)
            t = tables.setdefault(sid, [])
            while len(t) * BLOCK < end:
                t.append(free.pop())
            ids += toks
            pos += range(start, end)
            qlens.append(len(toks))
            slens.append(end)
            tabs.append(list(t))
            lens[sid] = end
        md = AttentionMetadata.build(qlens, slens, tabs, BLOCK, torch.device("cpu"))
        with torch.inference_mode(), set_forward_context(md, kv):
            hidden = model(torch.tensor(ids), torch.tensor(pos))
            out.append(model.compute_logits(hidden))
    return torch.cat(out)


def _rank_main(rank: int, world_size: int, port: int, folders: list[str], conn) -> None:
    torch.set_num_threads(1)
    try:
        init_tensor_parallel(rank, world_size, f"tcp://127.0.0.1:{port}", torch.device("cpu"))
        logits = [paged_logits(f, world_size) for f in folders]
        # Plain pickle: Connection.send would hand tensors over as shared memory, which a
        # rank that has already exited can no longer serve.
        conn.send_bytes(pickle.dumps(("ok", logits if rank == 0 else None)))
    except BaseException:
        conn.send_bytes(pickle.dumps(("error", f"rank {rank}:\n{traceback.format_exc()}")))
    finally:
        destroy_tensor_parallel()
        conn.close()


def run_tp(folders: list[str], world_size: int = 2, timeout: float = 120) -> list[torch.Tensor]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    pipes = [ctx.Pipe(duplex=False) for _ in range(world_size)]  # pipes: no semaphores in /dev/shm
    procs = [ctx.Process(target=_rank_main, args=(r, world_size, port, folders, pipes[r][1]), daemon=True)
             for r in range(world_size)]
    try:
        for p in procs:
            p.start()
        for _, w in pipes:
            w.close()
        replies = []
        for rank, (r, _) in enumerate(pipes):
            if not r.poll(timeout):
                codes = [p.exitcode for p in procs]
                pytest.fail(f"TP rank {rank} answered nothing in {timeout} s (exit codes {codes})")
            replies.append(pickle.loads(r.recv_bytes()))
        for status, payload in replies:
            assert status == "ok", payload
        for p in procs:
            p.join(timeout=30)
        return replies[0][1]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
        for r, _ in pipes:
            r.close()


CASES = {
    "llama-gqa": ("llama", dict(num_attention_heads=4, num_key_value_heads=2)),
    "llama-kv1-replicated": ("llama", dict(num_attention_heads=4, num_key_value_heads=1)),
    "qwen2-bias-odd-vocab": ("qwen2", dict(vocab_size=131)),
    "qwen3-qk-norm": ("qwen3", dict()),
    "llama-tied-odd-vocab": ("llama", dict(tie_word_embeddings=True, vocab_size=129)),
}


@pytest.mark.timeout(240)
def test_tp2_logits_equal_tp1(tiny_factory):
    folders = {name: tiny_factory(arch, **kw) for name, (arch, kw) in CASES.items()}
    tp2 = run_tp(list(folders.values()))
    for (name, folder), got in zip(folders.items(), tp2):
        want = paged_logits(folder, 1)
        assert got.shape == want.shape, name
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")
        assert torch.equal(got.argmax(-1), want.argmax(-1)), name


@pytest.mark.timeout(30)
def test_each_rank_loads_its_slice(monkeypatch):
    g = torch.Generator().manual_seed(0)
    hidden, heads, kv_heads, hd, inter, vocab = 8, 4, 2, 2, 6, 11
    q = torch.randn(heads * hd, hidden, generator=g)
    k = torch.randn(kv_heads * hd, hidden, generator=g)
    v = torch.randn(kv_heads * hd, hidden, generator=g)
    gate, up = torch.randn(inter, hidden, generator=g), torch.randn(inter, hidden, generator=g)
    down = torch.randn(hidden, inter, generator=g)
    emb = torch.randn(vocab, hidden, generator=g)
    for rank in range(2):
        with pretend_tp_rank(monkeypatch, rank, 2):
            qkv = QKVParallelLinear(hidden, hd, heads, kv_heads)
            mlp = MergedColumnParallelLinear(hidden, [inter, inter])
            row = RowParallelLinear(inter, hidden, bias=True)
            ve = VocabParallelEmbedding(vocab, hidden)
            head = ParallelLMHead(vocab, hidden)
        for shard, t in (("q", q), ("k", k), ("v", v)):
            qkv.weight.weight_loader(qkv.weight, t, shard)
        mlp.weight.weight_loader(mlp.weight, gate, 0)
        mlp.weight.weight_loader(mlp.weight, up, 1)
        row.weight.weight_loader(row.weight, down)
        row.bias.weight_loader(row.bias, torch.arange(hidden, dtype=torch.float32))
        ve.weight.weight_loader(ve.weight, emb)
        head.weight.weight_loader(head.weight, emb)
        qh, kvh = heads // 2 * hd, kv_heads // 2 * hd
        assert torch.equal(qkv.weight, torch.cat([q[rank * qh:(rank + 1) * qh], k[rank * kvh:(rank + 1) * kvh],
                                                  v[rank * kvh:(rank + 1) * kvh]]))
        half = inter // 2
        assert torch.equal(mlp.weight, torch.cat([gate[rank * half:(rank + 1) * half],
                                                  up[rank * half:(rank + 1) * half]]))
        assert torch.equal(row.weight, down[:, rank * half:(rank + 1) * half])
        assert torch.equal(row.bias, torch.arange(hidden, dtype=torch.float32))  # whole, added once
        shard = 6  # ceil(11 / 2): rank 1 holds 5 real rows and one zero padding row
        real = emb[rank * shard:(rank + 1) * shard]
        assert torch.equal(ve.weight[: len(real)], real) and torch.equal(head.weight, ve.weight)
        assert torch.count_nonzero(ve.weight[len(real):]) == 0


@pytest.mark.timeout(30)
@pytest.mark.parametrize("heads,kv_heads,tp,match", [
    (3, 3, 2, "num_attention_heads 3 is not divisible by tensor_parallel_size 2"),
    (8, 3, 4, "must be a multiple of num_key_value_heads 3"),
])
def test_unsplittable_shapes_are_refused_clearly(monkeypatch, heads, kv_heads, tp, match):
    with pretend_tp_rank(monkeypatch, 0, tp), pytest.raises(ValueError, match=match):
        QKVParallelLinear(16, 4, heads, kv_heads)


@pytest.mark.timeout(30)
def test_kv_heads_replicate_when_ranks_outnumber_them(monkeypatch):
    with pretend_tp_rank(monkeypatch, 3, 4):
        qkv = QKVParallelLinear(16, 4, 8, 2)
    assert (qkv.num_heads, qkv.num_kv_heads, qkv.kv_replicas) == (2, 1, 2)


@pytest.mark.timeout(60)
def test_engine_refuses_unsplittable_model_before_starting_workers(tiny_factory, capsys):
    from types import SimpleNamespace

    from tandem.entrypoints.cli import main

    with pytest.raises(ValueError, match="num_attention_heads 9 is not divisible by it"):
        ModelConfig(folder="x", tokenizer="x", dtype="float32", device="cpu", max_model_len=8, eos_token_ids=(),
                    max_num_seqs=64, max_num_batched_tokens=2048,
                    hf_config=SimpleNamespace(num_attention_heads=9, num_key_value_heads=3, intermediate_size=64)
                    ).check_tensor_parallel(2)
    folder = tiny_factory("llama", num_attention_heads=4, num_key_value_heads=2)
    argv = ["generate", "--model", folder, "--tensor-parallel-size", "3", "--prompt", "t5", "--max-tokens", "2"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "tensor_parallel_size 3 does not fit this model" in err and "num_attention_heads 4" in err
