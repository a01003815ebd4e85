"""Rotary embedding of q and k fused with the write of k and v into the paged KV cache."""

from __future__ import annotations

import torch

from specserve.kernels import use_triton
from specserve.kernels.pdl import kernel_args

from specserve.kernels._triton import HAVE_TRITON, tl, triton

if HAVE_TRITON:
    from specserve.kernels.pdl import pdl_begin, pdl_wait


def rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., H, D]; cos/sin [..., 1, D] (halves repeated) -> NeoX-layout rotation."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def rope_ref(positions, q, k, cos_cache, sin_cache):
    """positions [...]; q [..., Hq, D]; k [..., Hkv, D]; caches [P, D/2] float32 -> rotated (q, k)."""
    cos = cos_cache[positions].to(q.dtype)
    sin = sin_cache[positions].to(q.dtype)
    cos = torch.cat((cos, cos), dim=-1).unsqueeze(-2)
    sin = torch.cat((sin, sin), dim=-1).unsqueeze(-2)
    return rotate_ref(q, cos, sin), rotate_ref(k, cos, sin)


def write_kv_ref(k_cache, v_cache, k, v, slot_mapping) -> None:
    """k_cache/v_cache [N, block_size, Hkv, D]; k/v [T, Hkv, D]; slot_mapping [T] (flat slot per token)."""
    n, bs, h, d = k_cache.shape
    k_cache.view(n * bs, h, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(n * bs, h, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def rope_and_cache(positions, q, k, v, cos_cache, sin_cache, k_cache, v_cache, slot_mapping) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] (views of the qkv projection) -> rotated q [T, Hq, D]; the rotated k
    and v go to the cache at ``slot_mapping``."""
    if not use_triton(q) or q.shape[-1] % 2 or q.shape[-1] > 256:
        q, k = rope_ref(positions, q, k, cos_cache, sin_cache)
        write_kv_ref(k_cache, v_cache, k, v, slot_mapping)
        return q
    t, hq, d = q.shape
    hkv = k.shape[1]
    q_out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    if t:
        _rope_cache_kernel[(t,)](
            positions, q, k, v, cos_cache, sin_cache, k_cache, v_cache, slot_mapping, q_out,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), cos_cache.stride(0), k_cache.shape[1],
            HQ=hq, HKV=hkv, HALF=d // 2, BLOCK_H=triton.next_power_of_2(max(hq, hkv)),
            BLOCK_D=triton.next_power_of_2(d // 2), **kernel_args(q))
    return q_out


if HAVE_TRITON:
    @triton.jit
    def _rope_cache_kernel(POS, Q, K, V, COS, SIN, KC, VC, SLOT, QO,
                           sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sc_blk, sc_slot, sc_h, s_cos, BS,
                           HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr,
                           BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
        pdl_begin(PDL)
        pdl_wait(PDL)
        t = tl.program_id(0).to(tl.int64)
        pos = tl.load(POS + t)
        h = tl.arange(0, BLOCK_H)[:, None]
        c = tl.arange(0, BLOCK_D)[None, :]
        cm = c < HALF
        cos = tl.load(COS + pos * s_cos + c, mask=cm, other=0.0).to(Q.dtype.element_ty).to(tl.float32)
        sin = tl.load(SIN + pos * s_cos + c, mask=cm, other=0.0).to(Q.dtype.element_ty).to(tl.float32)
        # q: out = x * cos + rotate_half(x) * sin, per half
        mq = (h < HQ) & cm
        q1 = tl.load(Q + t * sq_t + h * sq_h + c, mask=mq, other=0.0).to(tl.float32)
        q2 = tl.load(Q + t * sq_t + h * sq_h + HALF + c, mask=mq, other=0.0).to(tl.float32)
        qo = QO + t * (HQ * 2 * HALF) + h * (2 * HALF) + c
        tl.store(qo, (q1 * cos - q2 * sin).to(QO.dtype.element_ty), mask=mq)
        tl.store(qo + HALF, (q2 * cos + q1 * sin).to(QO.dtype.element_ty), mask=mq)
        # k, v -> cache slot
        slot = tl.load(SLOT + t)
        blk = slot // BS
        off = slot % BS
        mk = (h < HKV) & cm
        base = blk * sc_blk + off * sc_slot + h * sc_h + c
        k1 = tl.load(K + t * sk_t + h * sk_h + c, mask=mk, other=0.0).to(tl.float32)
        k2 = tl.load(K + t * sk_t + h * sk_h + HALF + c, mask=mk, other=0.0).to(tl.float32)
        tl.store(KC + base, (k1 * cos - k2 * sin).to(KC.dtype.element_ty), mask=mk)
        tl.store(KC + base + HALF, (k2 * cos + k1 * sin).to(KC.dtype.element_ty), mask=mk)
        v1 = tl.load(V + t * sv_t + h * sv_h + c, mask=mk, other=0.0)
        v2 = tl.load(V + t * sv_t + h * sv_h + HALF + c, mask=mk, other=0.0)
        tl.store(VC + base, v1.to(VC.dtype.element_ty), mask=mk)
        tl.store(VC + base + HALF, v2.to(VC.dtype.element_ty), mask=mk)
