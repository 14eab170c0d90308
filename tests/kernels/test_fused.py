"""Fused Triton kernels (RMSNorm + residual, rotary, SiLU-and-multiply) against the eager
torch modules they replace. On the CPU they run under the Triton interpreter (fp32, fp16);
on CUDA also in bf16 at real sizes. The eager code rounds to the activation dtype at fixed
points and the kernels round at the same points, so results agree to ~1 ulp."""
from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from tandem.layers.activation import SiluAndMul  # noqa: E402
from tandem.layers.norm import RMSNorm  # noqa: E402
from tandem.layers.rotary import RotaryEmbedding  # noqa: E402

pytestmark = pytest.mark.timeout(300)
DEV = "cuda" if HAS_CUDA else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if HAS_CUDA else [])
SIZES = [(5, 48)] + ([(300, 896), (64, 1536)] if HAS_CUDA else [])


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # at most one rounding step apart
        eps = torch.finfo(got.dtype).eps
        torch.testing.assert_close(got.float(), want.float(), rtol=2 * eps, atol=2 * eps)


def _interpreted() -> None:
    if not HAS_CUDA:
        from tandem.kernels import fused

        if type(fused._rms_norm_kernel).__name__ != "InterpretedFunction":
            pytest.skip("triton was imported before TRITON_INTERPRET was set in this process")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H", SIZES)
def test_rms_norm_with_and_without_residual(dtype, T, H):
    _interpreted()
    torch.manual_seed(0)
    norm = RMSNorm(H, eps=1e-6).to(DEV, dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(H) * 0.5 + 1)
    x = torch.randn(T, H, device=DEV, dtype=dtype)
    r = torch.randn(T, H, device=DEV, dtype=dtype)
    want, want_res = norm(x, r)
    want_plain = norm(x)
    norm.fused = True
    got, got_res = norm(x, r)
    got_plain = norm(x)
    _close(got_res, want_res)
    _close(got, want)
    _close(got_plain, want_plain)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim,rotary_dim", [(4, 2, 16, 16), (3, 1, 16, 8)]
                         + ([(14, 2, 64, 64), (12, 2, 128, 128)] if HAS_CUDA else []))
def test_rotary_in_place_on_fused_qkv_views(dtype, heads, kv_heads, head_dim, rotary_dim):
    _interpreted()
    torch.manual_seed(1)
    T = 7 if not HAS_CUDA else 257
    inv = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    rope = RotaryEmbedding(head_dim, rotary_dim, 4096, inv).to(DEV)
    qkv = torch.randn(T, (heads + 2 * kv_heads) * head_dim, device=DEV, dtype=dtype)
    pos = torch.randint(0, 4096, (T,), device=DEV)

    def views(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return t[:, :heads * head_dim], t[:, heads * head_dim:(heads + kv_heads) * head_dim]

    want_q, want_k = rope(pos, *views(qkv.clone()))
    rope.fused = True
    buf = qkv.clone()
    got_q, got_k = rope(pos, *views(buf))
    _close(got_q, want_q)
    _close(got_k, want_k)
    torch.testing.assert_close(buf[:, (heads + kv_heads) * head_dim:], qkv[:, (heads + kv_heads) * head_dim:],
                               rtol=0, atol=0)  # v untouched


@pytest.mark.parametrize("dtype,cache_dtype", [(d, d) for d in DTYPES] + [(torch.float16, torch.float32)])
@pytest.mark.parametrize("heads,kv_heads,head_dim,rotary_dim", [(4, 2, 16, 16), (3, 1, 16, 8), (2, 2, 24, 16)]
                         + ([(14, 2, 64, 64), (28, 4, 128, 128)] if HAS_CUDA else []))
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rotary_fused_into_the_kv_write(dtype, cache_dtype, heads, kv_heads, head_dim, rotary_dim, qk_norm):
    """One kernel = (Qwen3's per-head q/k RMSNorm,) eager rotary, then the KV write (the
    reference), on views of one fused QKV output; padding tokens (slot -1) write nothing and
    the rest of the cache is kept."""
    from tandem.kernels.fused import rotary_write_kv_cache_
    from tandem.kernels.reference import write_kv_cache_reference

    _interpreted()
    torch.manual_seed(3)
    T = 9 if not HAS_CUDA else 300
    block_size, num_blocks = 4, -(-T // 4) + 3
    inv = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    rope = RotaryEmbedding(head_dim, rotary_dim, 4096, inv).to(DEV)
    qkv = torch.randn(T, (heads + 2 * kv_heads) * head_dim, device=DEV, dtype=dtype)
    pos = torch.randint(0, 4096, (T,), device=DEV)
    slots = torch.randperm(num_blocks * block_size, device=DEV)[:T]
    slots[1::4] = -1
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, device=DEV, dtype=cache_dtype)

    def views(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = t.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        return q.view(T, heads, head_dim), k.view(T, kv_heads, head_dim), v.view(T, kv_heads, head_dim)

    if qk_norm and rotary_dim != head_dim:
        pytest.skip("the kernel norms only fully rotated heads")
    norms = [RMSNorm(head_dim, eps=1e-6).to(DEV, dtype) for _ in range(2)]
    with torch.no_grad():
        for n in norms:
            n.weight.copy_(torch.randn(head_dim) * 0.5 + 1)
    q, k, v = views(qkv.clone())
    if qk_norm:
        q, k = norms[0](q), norms[1](k)
    want_q, want_k = rope(pos, q.reshape(T, -1), k.reshape(T, -1))
    want_cache = cache.clone()
    write_kv_cache_reference(want_k.view(T, kv_heads, head_dim), v, want_cache, slots)

    buf = qkv.clone()
    got_cache = cache.clone()
    q, k, v = views(buf)
    rotary_write_kv_cache_(pos, q, k, v, rope.cos_cache, rope.sin_cache, rotary_dim, got_cache, slots,
                           qk_norm=(norms[0].weight, norms[1].weight, 1e-6) if qk_norm else None)
    _close(q.reshape(T, -1), want_q)
    if cache_dtype == dtype:
        _close(got_cache, want_cache)
    else:  # a wider cache: the compiled kernel may fold the round trip through the activation
        # dtype (fp32 -> fp16 -> fp32) away and keep the key's extra bits, so the cache holds
        # it to within one rounding step of the activation dtype, not bit for bit.
        _close(got_cache.to(dtype), want_cache.to(dtype))
    torch.testing.assert_close(buf[:, heads * head_dim:], qkv[:, heads * head_dim:], rtol=0, atol=0)  # k, v kept


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,D", [(3, 40)] + ([(256, 4864), (17, 8960)] if HAS_CUDA else []))
def test_silu_and_mul(dtype, T, D):
    _interpreted()
    torch.manual_seed(2)
    x = torch.randn(T, 2 * D, device=DEV, dtype=dtype) * 3
    act = SiluAndMul()
    want = act(x)
    act.fused = True
    _close(act(x), want)
