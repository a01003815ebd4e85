"""Read and write draft heads in the layouts other tools use.

EAGLE-3 (as EAGLE's scripts, SpecForge and vLLM write it): ``config.json`` with ``draft_vocab_size`` and
``eagle_config.eagle_aux_hidden_state_layer_ids`` (ids of the target layers whose *input* is captured),
tensors ``fc.weight, midlayer.*, norm.weight`` and optional ``lm_head.weight, d2t, t2d, embed_tokens.weight``.
Without ``lm_head.weight`` the head shares the target's lm_head: all of it, or (specserve's variant, when
``draft_vocab_size`` is smaller than the target's vocabulary and ``d2t`` is there) its rows at the draft
vocabulary's tokens.

MTP (DeepSeek style): one group of tensors per module under ``model.layers.{i}.`` (i ascending), each with
``enorm, hnorm, eh_proj``, one decoder block (``input_layernorm, self_attn.*, post_attention_layernorm,
mlp.*``), ``shared_head.norm`` and optional ``shared_head.head`` (else the target's lm_head);
``config.json`` has ``num_nextn_predict_layers``.

Checkpoints store q/k/v and gate/up separately; specserve's modules hold them fused.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from specserve.config import ModelConfig
from specserve.loaders.hf import iter_safetensors
from specserve.speculative.config import SpeculativeConfig, default_eagle3_layers
from specserve.speculative.heads import DraftHead, Eagle3Head, MTPHead

log = logging.getLogger("specserve")

_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def fuse(tensors: dict[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
    """Concatenate ``*.{q,k,v}_proj.*`` into ``*.qkv_proj.*`` and ``*.{gate,up}_proj.*`` into ``*.gate_up_proj.*``."""
    out: dict[str, torch.Tensor] = {}
    groups: dict[str, dict[int, torch.Tensor]] = {}
    for name, t in tensors.items():
        m = re.match(r"(.*\.)(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$", name)
        if m:
            fused, idx = _FUSED[m.group(2)]
            groups.setdefault(f"{m.group(1)}{fused}.{m.group(3)}", {})[idx] = t
        else:
            out[name] = t
    for name, parts in groups.items():
        need = 3 if ".qkv_proj." in name else 2
        if len(parts) != need:
            missing = [k for k, (f, i) in _FUSED.items() if f in name and i not in parts]
            raise ValueError(f"{source}: missing tensor {name.replace(name.split('.')[-2], missing[0])!r}")
        out[name] = torch.cat([parts[i] for i in range(need)], dim=0)
    return out


def unfuse(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    out = {}
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    for name, t in state.items():
        if ".qkv_proj." in name:
            for part, chunk in zip(("q_proj", "k_proj", "v_proj"), t.split([q, kv, kv], dim=0)):
                out[name.replace("qkv_proj", part)] = chunk.contiguous()
        elif ".gate_up_proj." in name:
            for part, chunk in zip(("gate_proj", "up_proj"), t.chunk(2, dim=0)):
                out[name.replace("gate_up_proj", part)] = chunk.contiguous()
        else:
            out[name] = t.contiguous()
    return out


def load_into(module: torch.nn.Module, tensors: dict[str, torch.Tensor], source: str) -> None:
    """Copy tensors into a module's parameters/buffers, naming the first missing or mis-shaped tensor."""
    own = dict(module.state_dict())
    for name, t in tensors.items():
        if name not in own:
            continue
        if tuple(own[name].shape) != tuple(t.shape):
            raise ValueError(f"{source}: tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(own[name].shape)}")
    missing = sorted(set(own) - set(tensors))
    if missing:
        raise ValueError(f"{source}: missing tensor {missing[0]!r}" + (f" (and {len(missing) - 1} more)"
                                                                        if len(missing) > 1 else ""))
    module.load_state_dict({k: tensors[k] for k in own}, strict=True)


def _head_model_config(raw: dict, target: ModelConfig, source: str) -> ModelConfig:
    """The head's layer shapes; must share hidden size, vocabulary and KV shape with the target."""
    hidden = raw.get("hidden_size", target.hidden_size)
    if hidden != target.hidden_size:
        raise ValueError(f"{source}: head hidden_size {hidden} does not match the target's {target.hidden_size}")
    vocab = raw.get("vocab_size", target.vocab_size)
    if vocab != target.vocab_size:
        raise ValueError(f"{source}: head vocab_size {vocab} does not match the target's {target.vocab_size}")
    heads = raw.get("num_attention_heads", target.num_attention_heads)
    kv_heads = raw.get("num_key_value_heads", heads)
    head_dim = raw.get("head_dim") or hidden // heads
    if (kv_heads, head_dim) != (target.num_key_value_heads, target.head_dim):
        raise ValueError(
            f"{source}: head KV shape (num_key_value_heads={kv_heads}, head_dim={head_dim}) must match the target's "
            f"({target.num_key_value_heads}, {target.head_dim}): the head's KV lives in the target's paged pool"
        )
    return ModelConfig(
        architecture=target.architecture, vocab_size=vocab, hidden_size=hidden,
        intermediate_size=raw.get("intermediate_size", target.intermediate_size), num_hidden_layers=1,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", target.rms_norm_eps)), rope_theta=target.rope_theta,
        rope_scaling=target.rope_scaling, max_position_embeddings=target.max_position_embeddings,
        sliding_window=target.sliding_window,
    )


def _read(folder: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    if not folder.is_dir():
        raise ValueError(f"draft model {str(folder)!r} is not a folder (config.json + *.safetensors)")
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"{folder}: no config.json in the draft model folder")
    return json.loads(cfg_path.read_text()), dict(iter_safetensors(folder))


def check_head_folder(draft_model: str) -> Path:
    """A head folder that exists and has a config.json (checked before any weights load) -> its path."""
    folder = Path(draft_model).expanduser()
    if not folder.is_dir():
        raise ValueError(f"draft head {draft_model!r} (--draft) is not a folder (config.json + *.safetensors)")
    if not (folder / "config.json").is_file():
        raise ValueError(f"{folder}: no config.json in the draft head folder (--draft)")
    return folder


def head_kind(draft_model: str) -> str | None:
    """The method a head folder's layout says it is ("eagle3" or "mtp"; None when it says nothing or is not a
    head folder): its config.json (``eagle_config`` / ``draft_vocab_size`` / an Eagle architecture, or
    ``num_nextn_predict_layers`` / ``model_type: mtp`` / an MTP architecture), else its tensor names (``model.layers.<i>.
    enorm|hnorm|eh_proj``, or ``fc.weight`` / ``midlayer.*``), read from the safetensors headers only."""
    folder = Path(draft_model).expanduser()
    try:
        raw = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    archs = " ".join(str(a) for a in raw.get("architectures") or []).lower()
    # Eagle's own keys first: an EAGLE-3 config copied from its target may carry the target's
    # num_nextn_predict_layers too
    if "eagle_config" in raw or "draft_vocab_size" in raw or ("eagle" in archs and "mtp" not in archs):
        return "eagle3"
    if "num_nextn_predict_layers" in raw or raw.get("model_type") == "mtp" or "mtp" in archs:
        return "mtp"
    from safetensors import safe_open

    from specserve.loaders.hf import safetensors_files

    try:
        names = [n for f in safetensors_files(folder) for n in safe_open(str(f), framework="pt").keys()]
    except (OSError, ValueError):
        return None
    if any(re.match(r"model\.layers\.\d+\.(enorm|hnorm|eh_proj)\.", n) for n in names):
        return "mtp"
    if any(n == "fc.weight" or n.startswith("midlayer.") for n in names):
        return "eagle3"
    return None


def load_draft_head(spec: SpeculativeConfig, target_model, device, dtype) -> DraftHead:
    """Build the head named by ``spec`` for ``target_model`` (a LlamaForCausalLM) on ``device``."""
    if spec.draft_model is None:
        raise ValueError("speculative decoding needs a draft_model folder (--draft PATH)")
    if spec.draft_model == "random":  # benchmarks: a random head with the target's shapes, built on the device
        from specserve.speculative.random_heads import random_head

        with torch.device(device):
            head = random_head(target_model.config, spec.method, draft_vocab=min(32000, target_model.config.vocab_size),
                               own_head=spec.method == "eagle3")
        head = head.to(dtype=dtype)
        if isinstance(head, Eagle3Head):
            head.d2t = head.d2t.to(torch.int64)
        return bind_head(head, target_model)
    folder = Path(spec.draft_model).expanduser()
    raw, tensors = _read(folder)
    target_cfg = target_model.config
    cfg = _head_model_config(raw, target_cfg, str(folder))
    if spec.method == "eagle3":
        head = _build_eagle3(spec, raw, tensors, cfg, target_cfg, str(folder))
    else:
        head = _build_mtp(spec, raw, tensors, cfg, str(folder))
    head = head.to(device=device, dtype=dtype)
    if isinstance(head, Eagle3Head):
        head.d2t = head.d2t.to(torch.int64)
    return bind_head(head, target_model)


def bind_head(head: DraftHead, target_model) -> DraftHead:
    """Share the target's embedding/lm_head and RoPE table with the head."""
    from specserve.models.llama import Attention

    head.bind(target_model)
    for m in head.modules():
        if isinstance(m, Attention):
            m.rope = target_model.rope
    return head.eval().requires_grad_(False)


def _build_eagle3(spec, raw, tensors, cfg, target_cfg, source) -> Eagle3Head:
    n = target_cfg.num_hidden_layers
    ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if spec.eagle3_layers_to_capture is not None:
        aux = spec.eagle3_layers_to_capture
        if ids is not None and tuple(i - 1 for i in ids) != aux:
            log.warning("%s: eagle3_layers_to_capture %s overrides the checkpoint's layer ids %s (input convention)",
                        source, aux, ids)
    elif ids is not None:
        aux = tuple(int(i) - 1 for i in ids)  # checkpoint: inputs of layers i == outputs of layers i - 1
    else:
        aux = default_eagle3_layers(n)
    if len(aux) != 3 or any(not 0 <= a < n for a in aux):
        raise ValueError(f"{source}: EAGLE-3 aux layers {aux} must be three layer ids in [0, {n})")
    # other tools' aliases for the one decoder layer
    renamed = {}
    for name, t in tensors.items():
        for alias in ("model.layers.0.", "layers.0."):
            if name.startswith(alias):
                name = "midlayer." + name[len(alias):]
        renamed[name] = t
    tensors = fuse(renamed, source)
    has_head = "lm_head.weight" in tensors
    dv = raw.get("draft_vocab_size") or (tensors["lm_head.weight"].shape[0] if has_head else None)
    if has_head and tensors["lm_head.weight"].shape[0] != dv:
        raise ValueError(f"{source}: lm_head.weight has {tensors['lm_head.weight'].shape[0]} rows but "
                         f"draft_vocab_size is {dv}")
    if has_head and "d2t" not in tensors:
        if dv != cfg.vocab_size:
            raise ValueError(f"{source}: a draft vocabulary smaller than the target's needs the 'd2t' tensor")
        tensors["d2t"] = torch.zeros(dv, dtype=torch.int64)
    # no lm_head but a draft vocabulary (specserve's variant): the target's lm_head rows at those tokens
    shared = not has_head and dv is not None and dv < cfg.vocab_size
    if shared and ("d2t" not in tensors or len(tensors["d2t"]) != dv):
        raise ValueError(f"{source}: draft_vocab_size {dv} without lm_head.weight needs a 'd2t' tensor of {dv} "
                         "entries (the draft vocabulary's rows of the target's lm_head)")
    own_embed = "embed_tokens.weight" in tensors
    head = Eagle3Head(cfg, aux, dv if has_head or shared else None, own_embedding=own_embed, shared_lm_head=shared)
    if not has_head and not shared:
        tensors["d2t"] = torch.zeros(0, dtype=torch.int64)
    tensors = {k: v for k, v in tensors.items() if k != "t2d"}
    tensors["d2t"] = tensors["d2t"].to(torch.int64)
    if has_head or shared:
        target_ids = torch.arange(dv) + tensors["d2t"]
        if target_ids.min() < 0 or target_ids.max() >= cfg.vocab_size:
            raise ValueError(f"{source}: d2t maps draft ids outside the target vocabulary [0, {cfg.vocab_size})")
    load_into(head, tensors, source)
    return head


def _build_mtp(spec, raw, tensors, cfg, source) -> MTPHead:
    layer_ids = sorted({int(m.group(1)) for name in tensors if (m := re.match(r"model\.layers\.(\d+)\.", name))})
    if not layer_ids:
        raise ValueError(f"{source}: no MTP module tensors (model.layers.<i>.enorm.weight, ...)")
    n = len(layer_ids)
    declared = raw.get("num_nextn_predict_layers")
    if declared is not None and declared != n:
        raise ValueError(f"{source}: config.json declares {declared} MTP modules but the tensors hold {n}")
    # trees need one module that drafts any node (MTP-Eagle)
    eagle = spec.mtp_eagle if spec.mtp_eagle is not None else (spec.tree or n < spec.max_draft_len)
    if not eagle and spec.max_draft_len > n:
        raise ValueError(f"{source}: vanilla MTP needs one module per draft position; the checkpoint has {n} "
                         f"modules and max_draft_len is {spec.max_draft_len} (use mtp_eagle=True)")
    renamed = {}
    for name, t in tensors.items():
        m = re.match(r"model\.layers\.(\d+)\.(.*)$", name)
        if m:
            k, rest = layer_ids.index(int(m.group(1))), m.group(2)
            rest = {"shared_head.norm.weight": "shared_head_norm.weight",
                    "shared_head.head.weight": "shared_head_head.weight"}.get(rest, rest)
            if rest.startswith(("input_layernorm", "post_attention_layernorm", "self_attn.", "mlp.")):
                rest = "block." + rest
            if rest == "embed_tokens.weight":
                renamed["embed_tokens.weight"] = t
                continue
            renamed[f"modules_.{k}.{rest}"] = t
        elif name in ("embed_tokens.weight", "model.embed_tokens.weight"):
            renamed["embed_tokens.weight"] = t
    tensors = fuse(renamed, source)
    own_head = "modules_.0.shared_head_head.weight" in tensors
    head = MTPHead(cfg, n, own_head=own_head, eagle=eagle, own_embedding="embed_tokens.weight" in tensors)
    load_into(head, tensors, source)
    return head


# ---------------------------------------------------------------------------------------------
# writers


def _base_config(cfg: ModelConfig) -> dict:
    return dict(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
                head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps, vocab_size=cfg.vocab_size,
                rope_theta=cfg.rope_theta, max_position_embeddings=cfg.max_position_embeddings,
                hidden_act="silu")


def _float_state(head, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {k: (v.detach().cpu().to(dtype) if v.is_floating_point() else v.detach().cpu())
            for k, v in head.state_dict().items()}


def save_eagle3_head(head: Eagle3Head, folder: str | Path, extra_config: dict | None = None,
                     dtype: torch.dtype = torch.float32) -> None:
    """Write ``head`` in the EAGLE-3 layout (unfused tensors, ``d2t``/``t2d`` when it has a draft vocabulary)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = head.config
    state = unfuse(_float_state(head, dtype), cfg)
    if len(head.d2t):  # an own lm_head over a draft vocabulary, or the target's rows of one
        d2t = head.d2t.detach().cpu().to(torch.int64)
        state["d2t"] = d2t
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[torch.arange(len(d2t)) + d2t] = True
        state["t2d"] = t2d
    else:
        state.pop("d2t", None)
    save_file(state, str(folder / "model.safetensors"))
    conf = dict(_base_config(cfg), torch_dtype=str(dtype).removeprefix("torch."),
                architectures=["LlamaForCausalLMEagle3"], model_type="llama", num_hidden_layers=1,
                draft_vocab_size=len(head.d2t) or cfg.vocab_size,
                tie_word_embeddings=False,
                eagle_config={"eagle_aux_hidden_state_layer_ids": [a + 1 for a in head.aux_layers],
                              "use_aux_hidden_state": True})
    conf.update(extra_config or {})
    (folder / "config.json").write_text(json.dumps(conf, indent=2))


def save_mtp_head(head: MTPHead, folder: str | Path, extra_config: dict | None = None,
                  dtype: torch.dtype = torch.float32) -> None:
    """Write ``head`` in the DeepSeek-style MTP layout (``model.layers.{i}.*``)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = unfuse(_float_state(head, dtype), head.config)
    out = {}
    for name, t in state.items():
        m = re.match(r"modules_\.(\d+)\.(.*)$", name)
        if not m:
            out[name] = t
            continue
        rest = m.group(2)
        rest = {"shared_head_norm.weight": "shared_head.norm.weight",
                "shared_head_head.weight": "shared_head.head.weight"}.get(rest, rest)
        if rest.startswith("block."):
            rest = rest[len("block."):]
        out[f"model.layers.{m.group(1)}.{rest}"] = t
    save_file(out, str(folder / "model.safetensors"))
    conf = dict(_base_config(head.config), torch_dtype=str(dtype).removeprefix("torch."),
                architectures=["DeepseekMTPHead"], model_type="mtp",
                num_nextn_predict_layers=len(head.modules_))
    conf.update(extra_config or {})
    (folder / "config.json").write_text(json.dumps(conf, indent=2))
