"""The one configuration path: EngineArgs -> EngineConfig (validated before a model loads, derived numbers named),
and the train-draft flags derived from TrainConfig."""

from __future__ import annotations

import dataclasses
import logging
import subprocess
import sys

import pytest

from specserve import LLM
from specserve.cli import build_parser, engine_args
from specserve.train.cli import train_config
from specserve.config import EngineArgs, EngineConfig, ModelConfig
from specserve.speculative.config import SpeculativeConfig
from specserve.train.config import NO_FLAG, TrainConfig, field_defaults
from tiny_models import hf_config, make_hf_model

SPEC = dict(method="eagle3", draft_model="unused", max_draft_len=3)


def cpu_config(**kw) -> EngineConfig:
    return EngineArgs(device="cpu", **kw).create_engine_config()


def model_config(**over) -> ModelConfig:
    return ModelConfig.from_hf_dict(hf_config(**over))  # max_position_embeddings 512


@pytest.mark.parametrize("kwargs, message", [
    (dict(block_size=3), "block_size must be a positive power of two"),
    (dict(block_size=0), "block_size must be at least 1"),
    (dict(block_size="16"), "block_size must be an integer"),
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(max_num_batched_tokens=2.5), "max_num_batched_tokens must be an integer"),
    (dict(max_model_len=0), "max_model_len"),
    (dict(num_kv_blocks=1), "num_blocks must be at least 2"),
    (dict(kv_cache_memory_bytes=-1), "kv_cache_memory_bytes"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
    (dict(gpu_memory_utilization="0.5"), "gpu_memory_utilization"),
    (dict(attention_backend="flash"), "attention_backend"),
    (dict(max_cuda_graph_batch_size=-1), "max_cuda_graph_batch_size"),
    (dict(async_output="yes"), "async_output"),
    (dict(enforce_eager="no"), "enforce_eager"),
    (dict(dtype="int8"), "dtype"),
    (dict(speculative_config=dict(SPEC, max_draft_len=0)), "max_draft_len"),
    (dict(speculative_config=dict(SPEC, max_draft_len=17)), "max_draft_len"),
    (dict(speculative_config=dict(SPEC, max_draft_len=True)), "max_draft_len"),
    (dict(speculative_config=dict(method="eagle3")), "draft_model"),
    (dict(speculative_config=dict(SPEC, num_draft_tokens=3)), "unknown speculative_config fields"),
    (dict(speculative_config=dict(SPEC, max_draft_len=2, num_speculative_tokens=3)), "gives both"),
])
def test_bad_engine_settings_fail_before_a_model_loads(kwargs, message):
    with pytest.raises(ValueError, match=message):
        cpu_config(**kwargs)
    with pytest.raises(ValueError, match=message):  # the model does not exist: the setting is reported first
        LLM("/no/such/model", device="cpu", **kwargs)


def test_derived_numbers_are_named_and_computed_from_d():
    spec = SpeculativeConfig(**SPEC)
    assert (spec.lookahead_slots, spec.verify_len, spec.kv_slots_past_len) == (2, 4, 6)
    cfg = cpu_config(speculative_config=SPEC, max_num_seqs=8)
    assert cfg.speculative_config == spec and cfg.max_draft_len == 3
    assert cfg.lookahead_slots == 2 and cfg.scheduler_config.num_lookahead_slots == 2  # what the scheduler reads
    assert cfg.cuda_graph_max_rows == 8 and cpu_config(max_cuda_graph_batch_size=4).cuda_graph_max_rows == 4
    plain = cpu_config()
    assert (plain.max_draft_len, plain.lookahead_slots, plain.verify_len, plain.kv_slots_past_len) == (0, 0, 1, 0)
    assert plain.scheduler_config.num_lookahead_slots == 0 and plain.async_output is False
    with pytest.raises(RuntimeError, match="loaded"):
        plain.max_model_len  # not known before the model is


def test_with_model_fixes_max_model_len(caplog):
    cfg = cpu_config(speculative_config=SPEC, block_size=16)
    done = cfg.with_model(model_config(), num_kv_blocks=101)  # 100 usable blocks
    assert done.kv_capacity == 1600 and done.max_model_len == 512  # the model's context
    assert cpu_config(max_model_len=100).with_model(model_config(), 101).max_model_len == 100
    with caplog.at_level(logging.WARNING, logger="specserve"):
        small = cfg.with_model(model_config(), num_kv_blocks=11)  # 160 slots, 6 of them past the end
    assert small.max_model_len == 154 and small.scheduler_config.max_model_len == 154
    assert "lowered from 512 to 154" in caplog.text
    assert cfg.scheduler_config.max_model_len is None  # configs are values: the original is unchanged
    with pytest.raises(ValueError, match="too few for one sequence"):
        cpu_config(block_size=4, speculative_config=SPEC).with_model(model_config(), num_kv_blocks=2)  # 4 < 6
    with pytest.raises(ValueError, match="too few"):
        cpu_config(block_size=1, speculative_config=SPEC).with_model(model_config(), num_kv_blocks=8)
    with pytest.raises(ValueError, match="exceeds the model's context of 512"):
        cpu_config(max_model_len=513).with_model(model_config(), 101)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_llama_config")
    make_hf_model(d, "llama", num_hidden_layers=1)
    return str(d)


def test_engine_reads_its_config(model_dir):
    eng = LLM(model_dir, device="cpu", dtype="float32", max_model_len=100, num_kv_blocks=20, block_size=8,
              max_num_seqs=4).engine
    cfg = eng.config
    assert isinstance(cfg, EngineConfig) and not hasattr(eng, "args")
    assert cfg.model_config is eng.model_config and cfg.num_kv_blocks == 20 == eng.pool.num_blocks
    assert eng.scheduler.cfg is cfg.scheduler_config and eng.max_model_len == cfg.max_model_len == 100
    assert eng.kv_cache.block_size == 8 and cfg.cuda_graph_max_rows == 4
    with pytest.raises(ValueError, match="exceeds the model's context of 512"):
        LLM(model_dir, device="cpu", max_model_len=513)


def test_cli_builds_engine_args():
    a = build_parser().parse_args(["generate", "x", "--model", "m", "--draft", "h", "--draft-len", "3",
                                   "--block-size", "32", "--num-gpu-blocks-override", "9",
                                   "--disable-async-output-proc"])
    args = engine_args(a)
    assert (args.model, args.block_size, args.num_kv_blocks, args.async_output) == ("m", 32, 9, False)
    assert args.speculative_config["max_draft_len"] == 3 and args.speculative_config["draft_model"] == "h"
    assert engine_args(build_parser().parse_args(["serve", "--model", "m"])).speculative_config is None
    # the flags' defaults are EngineArgs'
    plain = dataclasses.asdict(engine_args(build_parser().parse_args(["serve", "--no-spec"])))
    assert plain == dataclasses.asdict(EngineArgs())


def test_every_train_config_field_has_a_flag_with_its_default():
    a = build_parser().parse_args(["train-draft", "--method", "eagle3", "--out", "o", "--synthetic-prompts", "3"])
    flags = vars(a)
    for f in dataclasses.fields(TrainConfig):
        assert (f.name in flags) != (f.name in NO_FLAG), f.name
    for name, default in field_defaults().items():
        if name not in NO_FLAG and name != "synthetic_prompts":
            assert flags[name] == default, name
    cfg = train_config(a)
    assert isinstance(cfg, TrainConfig) and cfg.synthetic_prompts == 3 and cfg.out == "o"


@pytest.mark.parametrize("over, message", [
    (dict(eval_draft_len=0), "eval-draft-len"),
    (dict(eval_draft_len=17), "eval-draft-len"),
    (dict(eval_max_tokens=0), "eval-max-tokens"),
    (dict(lr=0.0), "--lr"),
    (dict(warmup=-1), "--warmup"),
    (dict(export_dtype="int8"), "export-dtype"),
])
def test_bad_train_settings_fail_before_training(over, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(target=None, method="eagle3", prompts=["x"], out="o", **over)


def test_train_modules_import_without_a_cycle():
    """data.py and generate.py need TrainConfig only, not the trainer that imports them."""
    code = ("import sys, specserve.train.data, specserve.train.generate; "
            "assert 'specserve.train.trainer' not in sys.modules; "
            "from specserve.train.trainer import TrainConfig; from specserve.train.config import TrainConfig as C; "
            "assert TrainConfig is C")
    subprocess.run([sys.executable, "-c", code], check=True)
