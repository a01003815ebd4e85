"""Attention layouts used in training, plugged into the model's attention through ``meta.attend``.

``DenseCausal``: plain causal attention over ``[B, S]`` (the target's forward for features, no KV cache).

``TrainingTimeTest``: EAGLE-3's training-time test. Unroll step k runs the head for every anchor position
i at once: the query of anchor i sits at position i + k and attends to the step-0 keys at positions
<= i (features of the real sequence) and to the keys of unroll steps 1..k of the same anchor (the head's
own earlier outputs), exactly what the query at last_pos + k sees in the inference draft loop.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class DenseCausal:
    def attend(self, q, k, v, scale):
        """q [B, S, Hq, D]; k, v [B, S, Hkv, D] -> [B, S, Hq, D]."""
        hq, hkv = q.shape[2], k.shape[2]
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True, scale=scale, enable_gqa=hq != hkv)
        return out.transpose(1, 2)


class TrainingTimeTest:
    """Holds the keys/values of earlier unroll steps of one attention layer; call ``attend`` once per step."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []  # [B, Hq, S, D] per unroll step
        self.values: list[torch.Tensor] = []

    def attend(self, q, k, v, scale):
        """q [B, S, Hq, D]; k, v [B, S, Hkv, D] (this step) -> [B, S, Hq, D]."""
        rep = q.shape[2] // k.shape[2]
        self.keys.append(k.repeat_interleave(rep, dim=2).transpose(1, 2))
        self.values.append(v.repeat_interleave(rep, dim=2).transpose(1, 2))
        qh = q.transpose(1, 2)  # [B, Hq, S, D]
        s = qh.shape[2]
        causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
        scores0 = (qh @ self.keys[0].transpose(-1, -2)) * scale  # [B, Hq, S, S]
        scores0 = scores0.masked_fill(~causal, float("-inf"))
        diag = [(qh * kj).sum(-1, keepdim=True) * scale for kj in self.keys[1:]]  # [B, Hq, S, 1] each
        probs = torch.cat([scores0] + diag, dim=-1).float().softmax(dim=-1).to(q.dtype)
        out = probs[..., :s] @ self.values[0]
        for j, vj in enumerate(self.values[1:]):
            out = out + probs[..., s + j:s + j + 1] * vj
        return out.transpose(1, 2)
