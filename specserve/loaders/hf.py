"""Hugging Face folder loader: config.json, one or many *.safetensors (with or without an index)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open

from specserve.config import ModelConfig


def load_hf_config(folder: Path) -> ModelConfig:
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"{folder}: no config.json; a Hugging Face model folder needs one")
    try:
        raw = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_path}: not valid JSON ({e})") from None
    return ModelConfig.from_hf_dict(raw)


def safetensors_files(folder: Path) -> list[Path]:
    """The shard files of a checkpoint: those named by ``model.safetensors.index.json`` if present,
    else every ``*.safetensors`` in the folder."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({folder / f for f in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise ValueError(f"{index}: names shard {f.name!r}, which is not in the folder")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder}: no *.safetensors files")
    return files


def iter_safetensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for f in safetensors_files(folder):
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():
                yield name, fh.get_tensor(name)
