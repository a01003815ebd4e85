"""The two builders of a step's inputs compute the same thing: a packed step's arrays built on the host with numpy
(``ModelRunner.stage``) and a graph step's record expanded on the device (``expand_record``, whose PyTorch
reference is checked here; tests/kernel_checks.py checks the Triton kernel against that reference)."""

from __future__ import annotations

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.cache.kv_cache import PAD_BLOCK
from specserve.kernels.step_inputs import expand_record_ref
from specserve.runner.graph_inputs import row_fields
from specserve.runner.step_batch import ArrayPack
from tiny_models import PROMPTS, target_with_eagle3


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return target_with_eagle3(tmp_path_factory.mktemp("step_batch"))


def test_array_pack_lays_named_arrays_one_after_another():
    pack = ArrayPack(dict(a=(2, 3), b=(4,), c=(0,), d=(1, 2)))
    assert pack.size == 12 and pack.spans == {"a": (0, 6), "b": (6, 4), "c": (10, 0), "d": (10, 2)}
    v = pack.views(torch.arange(pack.size))
    assert v["a"].tolist() == [[0, 1, 2], [3, 4, 5]] and v["b"].tolist() == [6, 7, 8, 9]
    assert v["c"].numel() == 0 and v["d"].tolist() == [[10, 11]]


@pytest.mark.parametrize("draft_len", [None, 3])
def test_packed_arrays_equal_the_expanded_record_token_by_token(dirs, draft_len):
    """Every step of a run with chunked prefill, mixed batches and (with a head) drafts: positions, cache slots and
    token ids of each token, and the verified positions, drafts and token table of each row agree between the two
    builders (packed steps lay tokens flat, records in [B, q]: tokens are matched by row and column)."""
    spec = None if draft_len is None else dict(method="eagle3", draft_model=str(dirs / "eagle3"),
                                               max_draft_len=draft_len)
    llm = LLM(str(dirs / "target"), device="cpu", dtype="float32", speculative_config=spec,
              max_num_batched_tokens=12)
    runner = llm.engine.runner
    launch, seen = runner.launch, []

    def check(batch):
        sched = batch.scheduled
        b, q = len(sched), max(s.num_tokens for s in sched)
        packed = runner.prepare(batch, runner.speculator)
        flat = packed.meta.flat_index  # [T] row * q + column
        row, col = flat // q, flat % q
        ints, tables = row_fields(sched, b, q, runner.block_size, runner.table_lookahead)
        m = packed.meta.block_tables.shape[1]
        tab = torch.full((b, m), PAD_BLOCK, dtype=torch.int64)
        for i, ids in enumerate(tables):
            tab[i, :len(ids)] = torch.tensor(ids, dtype=torch.int64)
        assert torch.equal(tab, packed.meta.block_tables)
        t = {k: torch.tensor(v, dtype=torch.int64) for k, v in ints.items()}
        tokens = t["tokens"].view(b, q)
        more = {}
        if draft_len is not None:
            flags = torch.zeros(4, b, dtype=torch.int64)
            flags[0] = torch.tensor([int(s.sample) for s in sched])
            # a packed step verifies as many drafts as its rows can hold (q - 1 at most), as a graph layout of q does
            more = dict(draft_len=min(draft_len, q - 1), flags=flags)
        x = expand_record_ref(t["start"], t["count"], t["num_drafts"], tokens, tab, runner.block_size, **more)
        assert torch.equal(packed.input_ids, tokens[row, col])
        assert torch.equal(packed.positions, x["positions"][row, col])
        assert torch.equal(packed.meta.slot_mapping, x["slots"][row, col])
        assert torch.equal(packed.meta.query_pos[row, col], x["positions"][row, col])
        if draft_len is not None:
            s = packed.spec
            assert torch.equal(s.row_of_token, x["row_of_token"][row, col])
            assert torch.equal(s.col_of_token, x["col_of_token"][row, col])
            assert torch.equal(s.base_col, x["base_col"]) and torch.equal(s.drafts, x["drafts"])
            # flat indices differ by layout: compare them from each row's first token
            assert torch.equal(s.verify_idx - s.t0[:, None], x["verify_idx"] - x["t0"][:, None])
            for i, r in enumerate(sched):  # the row's own tokens (a non-final chunk's lookahead follows them)
                assert torch.equal(s.ext[i, :r.num_tokens], x["ext"][i, :r.num_tokens])
        seen.append((b, max(r.num_drafts for r in sched)))
        return launch(batch)

    runner.launch = check
    params = [SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
              SamplingParams(temperature=0.7, seed=5, max_tokens=7, ignore_eos=True)]
    outs = llm.generate(PROMPTS[:4], [params[i % 2] for i in range(4)])
    assert all(o.token_ids for o in outs)
    assert len(seen) > 5 and max(b for b, _ in seen) > 1
    assert draft_len is None or max(d for _, d in seen) == draft_len
