"""Programmatic dependent launch (``tandem.kernels.pdl``): the switch, and, on a Hopper or later
GPU, a batch-1 decoder layer stack (fused GEMVs, rotary + KV write, split-KV attention and its
merge) gives the same bits with PDL on as off, eagerly and captured in a CUDA graph."""
from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

pytestmark = pytest.mark.timeout(300)


def test_the_switch_and_its_launch_options():
    from tandem.config.model import EnvSwitches
    from tandem.kernels import pdl

    assert EnvSwitches.from_environ({}).pdl is True  # where the device supports it
    assert EnvSwitches.from_environ({"TANDEM_PDL": "0"}).pdl is False
    assert EnvSwitches.from_environ({"TANDEM_PDL": "1"}).pdl is True
    assert not pdl.supported(torch.device("cpu"))
    was = pdl.enabled()
    try:
        pdl.set_enabled(True)
        assert pdl.launch_options() == {"PDL": True, "launch_pdl": True}
        pdl.set_enabled(False)
        assert pdl.launch_options() == {"PDL": False}
    finally:
        pdl.set_enabled(was)


def _decode_stack(layers: int, seed: int, fused_rope: bool = False):
    """A step of batch 1 through ``layers`` Qwen2.5-0.5B-shaped layers (random weights, a
    context of 300 cached tokens): the kernels the GEMV path launches, in its order
    (``fused_rope``: rotary and the KV write in the QKV launch)."""
    from tandem.kernels.attention import paged_attention
    from tandem.kernels.fused import rotary_write_kv_cache_
    from tandem.kernels.gemv import RopeWrite, gemv

    g = torch.Generator(device="cuda").manual_seed(seed)
    dev, dt = "cuda", torch.bfloat16
    hidden, inter, nh, nkv, d, block = 896, 4864, 14, 2, 64, 16
    ctx = 300

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=dev) * scale).to(dt)

    ws = [dict(n1=rand(hidden, scale=0.1) + 1, qkv=rand((nh + 2 * nkv) * d, hidden, scale=hidden ** -0.5),
               b=rand((nh + 2 * nkv) * d), o=rand(hidden, nh * d, scale=(nh * d) ** -0.5),
               n2=rand(hidden, scale=0.1) + 1, gu=rand(2 * inter, hidden, scale=hidden ** -0.5),
               down=rand(hidden, inter, scale=inter ** -0.5)) for _ in range(layers)]
    blocks = -(-(ctx + 1) // block)
    caches = [rand(2, blocks, block, nkv, d) for _ in range(layers)]
    positions = torch.tensor([ctx], device=dev)
    slots = torch.tensor([ctx], device=dev)
    qsl = torch.tensor([0, 1], device=dev, dtype=torch.int32)
    seq_lens = torch.tensor([ctx + 1], device=dev, dtype=torch.int32)
    tables = torch.arange(blocks, device=dev, dtype=torch.int32)[None]
    inv = 1.0 / (1e6 ** (torch.arange(0, d, 2, device=dev).float() / d))
    ang = torch.arange(ctx + 8, device=dev).float()[:, None] * inv[None]
    cos, sin = ang.cos(), ang.sin()
    x = rand(1, hidden)

    def step() -> torch.Tensor:
        h, res = x, None
        for w, cache in zip(ws, caches):
            rope = RopeWrite(positions, cos, sin, cache, slots, nh, nkv, d) if fused_rope else None
            if res is None:
                qkv = gemv(h, w["qkv"], w["b"], norm=(w["n1"], 1e-6), rope=rope)
                res = h
            else:
                qkv, res = gemv(h, w["qkv"], w["b"], norm=(w["n1"], 1e-6), residual=res, rope=rope)
            q = qkv[:, :nh * d].view(1, nh, d)
            if not fused_rope:
                k = qkv[:, nh * d:(nh + nkv) * d].view(1, nkv, d)
                v = qkv[:, (nh + nkv) * d:].view(1, nkv, d)
                rotary_write_kv_cache_(positions, q, k, v, cos, sin, d, cache, slots)
            attn = torch.empty_like(q)
            paged_attention(q, cache, attn, query_start_loc=qsl, seq_lens=seq_lens, block_tables=tables,
                            max_query_len=1, max_seq_len=ctx + 1, scale=d ** -0.5, num_kv_splits=4)
            o = gemv(attn.view(1, nh * d), w["o"])
            act, res = gemv(o, w["gu"], norm=(w["n2"], 1e-6), residual=res, silu=True)
            h = gemv(act, w["down"])
        return h + res

    return step


@pytest.mark.skipif(not HAS_CUDA or torch.cuda.get_device_capability()[0] < 9,
                    reason="programmatic dependent launch needs a Hopper or later GPU")
@pytest.mark.parametrize("fused_rope", [False, True])
def test_a_layer_stack_gives_the_same_bits_with_pdl_eager_and_in_a_graph(fused_rope):
    from tandem.kernels import pdl

    step = _decode_stack(layers=6, seed=0, fused_rope=fused_rope)
    was = pdl.enabled()
    try:
        pdl.set_enabled(False)
        want = step().clone()
        pdl.set_enabled(True)
        torch.testing.assert_close(step(), want, rtol=0, atol=0)
        graph_outs = []
        for on in (False, True):
            pdl.set_enabled(on)
            step()  # compile this variant outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = step()
            for _ in range(3):
                graph.replay()
            torch.cuda.synchronize()
            graph_outs.append(out.clone())
        torch.testing.assert_close(graph_outs[0], want, rtol=0, atol=0)
        torch.testing.assert_close(graph_outs[1], want, rtol=0, atol=0)
    finally:
        pdl.set_enabled(was)
