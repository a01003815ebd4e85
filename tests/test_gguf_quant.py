"""GGUF quantized types: specserve's dequantization and q/k un-permutation against transformers' GGUF
loader and an independent numpy decoder of the llama.cpp block layouts (K-quants written by quantizers in
this file, since gguf's quantize() cannot produce them)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from test_models import ATOL, assert_close, cosine_rows, hf_forward, load_llm, prompt_ids, specserve_forward
from tiny_models import make_hf_model, write_gguf

# transformers' GGUF loader dequantizes with the same ``gguf.quants.dequantize`` that specserve uses,
# so it is an independent reference for GGUF naming, config and q/k un-permutation but not for the
# dequantization itself. For that, each type is also compared with a reference built here: the HF
# model whose 2-D weights are replaced by an independent numpy decoding of the quantized blocks
# (written from the llama.cpp block layouts). gguf-py cannot quantize K-quants, so Q4_K and Q6_K
# blocks are produced by the small quantizers below, which return their own reconstruction.

QTYPES = ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K", "F16", "BF16"]
QK_K = 256


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float32)


def quantize_q6_k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [rows, cols] (cols % 256 == 0) -> (Q6_K blocks as uint8 [rows, cols/256*210], reconstruction)."""
    rows, cols = x.shape
    xb = x.reshape(-1, QK_K // 16, 16).astype(np.float32)  # blocks x 16 sub-blocks x 16
    nb = xb.shape[0]
    sub = np.abs(xb).max(-1) / 31.0  # per sub-block scale
    d = _f16(sub.max(-1) / 127.0)  # [nb]
    sc = np.where(d[:, None] > 0, np.round(sub / np.where(d > 0, d, 1)[:, None]), 0).clip(-128, 127)
    step = (d[:, None] * sc)[..., None]  # [nb, 16, 1]
    q = np.where(step > 0, np.round(xb / np.where(step > 0, step, 1)), 0).clip(-32, 31)
    recon = (d[:, None] * sc.astype(np.float32)).reshape(nb, 16, 1) * q
    u = (q + 32).astype(np.uint8).reshape(nb, QK_K)
    low, high = u & 0x0F, u >> 4
    lo = low.reshape(nb, 2, 2, 64)
    ql = (lo[:, :, 0] | (lo[:, :, 1] << 4)).reshape(nb, 128)
    hi = high.reshape(nb, 2, 4, 32)
    qh = (hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)).reshape(nb, 64)
    blocks = np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8),
                             d.astype(np.float16).view(np.uint8).reshape(nb, 2)], axis=1)
    return blocks.reshape(rows, -1), recon.reshape(rows, cols).astype(np.float32)


def quantize_q4_k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [rows, cols] (cols % 256 == 0) -> (Q4_K blocks as uint8 [rows, cols/256*144], reconstruction)."""
    rows, cols = x.shape
    xb = x.reshape(-1, 8, 32).astype(np.float32)  # blocks x 8 sub-blocks x 32
    nb = xb.shape[0]
    lo = np.minimum(xb.min(-1), 0.0)
    scale = (xb.max(-1) - lo) / 15.0
    mins = -lo
    d, dmin = _f16(scale.max(-1) / 63.0), _f16(mins.max(-1) / 63.0)
    sc = np.where(d[:, None] > 0, np.round(scale / np.where(d > 0, d, 1)[:, None]), 0).clip(0, 63)
    m = np.where(dmin[:, None] > 0, np.round(mins / np.where(dmin > 0, dmin, 1)[:, None]), 0).clip(0, 63)
    step = (d[:, None] * sc.astype(np.float32))[..., None]
    off = (dmin[:, None] * m.astype(np.float32))[..., None]
    q = np.where(step > 0, np.round((xb + off) / np.where(step > 0, step, 1)), 0).clip(0, 15)
    recon = step * q - off
    sc8, m8 = sc.astype(np.uint8), m.astype(np.uint8)
    packed = np.concatenate([
        sc8[:, :4] | ((sc8[:, 4:] >> 4) << 6),
        m8[:, :4] | ((m8[:, 4:] >> 4) << 6),
        (sc8[:, 4:] & 0x0F) | ((m8[:, 4:] & 0x0F) << 4),
    ], axis=1)
    qq = q.astype(np.uint8).reshape(nb, 4, 2, 32)
    qs = (qq[:, :, 0] | (qq[:, :, 1] << 4)).reshape(nb, 128)
    blocks = np.concatenate([d.astype(np.float16).view(np.uint8).reshape(nb, 2),
                             dmin.astype(np.float16).view(np.uint8).reshape(nb, 2), packed, qs], axis=1)
    return blocks.reshape(rows, -1), recon.reshape(rows, cols).astype(np.float32)


_OWN_QUANTIZERS = {"Q4_K": quantize_q4_k, "Q6_K": quantize_q6_k}


def reference_dequantize(data: np.ndarray, qtype: str, cols: int) -> np.ndarray:
    """Independent decoding of gguf-py's quantize() output (llama.cpp block layouts)."""
    rows = data.shape[0]
    if qtype == "F16":
        return data.astype(np.float32)
    if qtype == "BF16":
        return (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(rows, cols)
    nb = rows * cols // 32
    if qtype == "Q8_0":  # f16 d, 32 x int8
        b = data.reshape(nb, 34)
        d = b[:, :2].copy().view(np.float16).astype(np.float32)
        return (d * b[:, 2:].view(np.int8).astype(np.float32)).reshape(rows, cols)
    if qtype in ("Q4_0", "Q4_1"):  # f16 d [, f16 m], 16 bytes: low nibbles = elements 0..15, high = 16..31
        head = 2 if qtype == "Q4_0" else 4
        b = data.reshape(nb, head + 16)
        d = b[:, :2].copy().view(np.float16).astype(np.float32)
        qs = b[:, head:]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)
        if qtype == "Q4_0":
            return (d * (q - 8)).reshape(rows, cols)
        m = b[:, 2:4].copy().view(np.float16).astype(np.float32)
        return (d * q + m).reshape(rows, cols)
    raise AssertionError(qtype)


@pytest.fixture(scope="module")
def quant_base(tmp_path_factory):
    """A llama whose every row length is a multiple of 256 (K-quant super-blocks), plus its F32 GGUF."""
    root = tmp_path_factory.mktemp("quant")
    folder = root / "hf"
    hf = make_hf_model(folder, "llama", seed=7, hidden_size=256, intermediate_size=512)
    f32 = root / "model-F32.gguf"
    write_gguf(f32, folder, hf, arch="llama", qtype="F32")
    ids = prompt_ids(hf.config.vocab_size, n=24, seed=4)
    f32_logits, _ = specserve_forward(load_llm(f32), ids)
    assert_close(f32_logits, hf_forward(hf, ids).logits[0])
    return root, folder, hf, ids, f32_logits


def _write_quantized(path: Path, folder: Path, hf, qtype: str) -> dict[str, np.ndarray]:
    """write_gguf with ``qtype``; returns an independent reconstruction of every quantized weight
    (HF name -> float32 array in HF layout)."""
    import gguf.quants

    recon: dict[str, np.ndarray] = {}
    real_quantize = gguf.quants.quantize

    def quantize(arr, qt):
        if qtype in _OWN_QUANTIZERS:
            blocks, _ = _OWN_QUANTIZERS[qtype](arr)
            return blocks
        return real_quantize(arr, qt)

    # Quantization works row by row, and llama.cpp's q/k permutation only reorders rows, so the
    # reconstruction of the unpermuted HF weight is the un-permuted reconstruction of the file's.
    for name, t in hf.state_dict().items():
        arr = t.float().numpy()
        if arr.ndim != 2:
            continue
        if qtype in _OWN_QUANTIZERS:
            recon[name] = _OWN_QUANTIZERS[qtype](arr)[1]
        else:
            import gguf

            data = real_quantize(arr, getattr(gguf.GGMLQuantizationType, qtype))
            recon[name] = reference_dequantize(np.asarray(data), qtype, arr.shape[1])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf.quants, "quantize", quantize)
        write_gguf(path, folder, hf, arch="llama", qtype=qtype)
    return recon


@pytest.mark.parametrize("qtype", QTYPES)
def test_gguf_quantized_matches_references(quant_base, qtype):
    import copy

    import gguf
    from transformers import AutoModelForCausalLM

    root, folder, hf, ids, f32_logits = quant_base
    path = root / f"model-{qtype}.gguf"
    recon = _write_quantized(path, folder, hf, qtype)
    reader = gguf.GGUFReader(str(path))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.attn_q.weight"] == qtype and types["output.weight"] == qtype
    assert types["blk.0.attn_norm.weight"] == "F32"

    llm = load_llm(path)
    logits, _ = specserve_forward(llm, ids)

    # (a) transformers' own GGUF loader
    tf = AutoModelForCausalLM.from_pretrained(str(root), gguf_file=path.name, dtype=torch.float32).eval()
    assert_close(logits, hf_forward(tf, ids).logits[0])

    # (b) the HF model with independently dequantized weights
    ref = copy.deepcopy(hf)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name in recon:
                p.copy_(torch.from_numpy(recon[name]))
    assert_close(logits, hf_forward(ref, ids).logits[0])
    q_proj = llm.engine.model.layers[1].self_attn.qkv_proj.weight[: hf.config.hidden_size]
    assert_close(q_proj, torch.from_numpy(recon["model.layers.1.self_attn.q_proj.weight"]), atol=1e-6)

    # (c) quantization really changed the model, but not beyond recognition
    assert (logits - f32_logits).abs().max() > ATOL  # more than the equality checks above tolerate
    assert cosine_rows(logits, f32_logits).min() > 0.9


def test_own_k_quantizers_roundtrip():
    """The test's K-quant writers agree with gguf-py's dequantizer (so files written with them are valid)."""
    import gguf
    from gguf.quants import dequantize

    x = np.random.default_rng(0).standard_normal((3, 512)).astype(np.float32) * 0.05
    x[0, :40] += 0.3  # sub-blocks with only positive values (Q4_K min clamps at 0)
    for name, fn in _OWN_QUANTIZERS.items():
        blocks, recon = fn(x)
        got = dequantize(blocks, getattr(gguf.GGMLQuantizationType, name)).reshape(x.shape)
        np.testing.assert_allclose(got, recon, atol=1e-7, rtol=0)
        assert np.abs(recon - x).max() < 0.05 * np.abs(x).max()


# --------------------------------------------------------------------------------------------------
# 6. errors


def test_error_gguf_unsupported_quant_type(quant_base, monkeypatch):
    import specserve.loaders.gguf_loader as gl

    root, folder, hf, _, _ = quant_base
    path = root / "model-Q8_0-unsupported.gguf"
    write_gguf(path, folder, hf, arch="llama", qtype="Q8_0")
    monkeypatch.setattr(gl, "SUPPORTED_QUANTS", tuple(q for q in gl.SUPPORTED_QUANTS if q != "Q8_0"))
    with pytest.raises(ValueError, match="Q8_0") as e:
        load_llm(path)
    msg = str(e.value)
    assert any(f"'{n}'" in msg for n in ("token_embd.weight", "output.weight", "blk.0.attn_q.weight")), msg
    assert str(path) in msg
