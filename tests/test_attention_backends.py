"""FlexAttention (eager on the CPU) agrees with the SDPA reference, windows included. The Triton kernel and
compiled Flex on the GPU: tests/kernel_checks.py via tests/test_kernels.py."""

from __future__ import annotations

import torch

from specserve.kernels.attention import causal_prompt_sdpa, paged_attention_flex, paged_attention_sdpa


def test_flex_matches_sdpa_on_cpu():
    g = torch.Generator().manual_seed(5)
    kc, vc = (torch.randn(20, 16, 2, 32, generator=g) for _ in range(2))
    tables = torch.tensor([[3, 7, 1, 0], [5, 0, 0, 0]])
    qidx = torch.tensor([[0, 1, 2], [3, 6, 6]])  # row 1 has one query; 6 = T (padding)
    qpos = torch.tensor([[50, 51, 52], [9, 0, 0]])
    q = torch.randn(6, 4, 32, generator=g)
    args = (q, kc, vc, tables, qidx, qpos, 0.2)
    ref = paged_attention_sdpa(*args)
    got = paged_attention_flex(*args)
    assert torch.allclose(got[:4], ref[:4], atol=1e-5)
    for w in (4, 30):
        assert torch.allclose(paged_attention_flex(*args, sliding_window=w)[:4],
                              paged_attention_sdpa(*args, sliding_window=w)[:4], atol=1e-5)



def test_causal_prompt_sdpa_matches_the_reference_for_prompts_from_position_zero():
    """Rows whose queries are their first tokens: causal SDPA over each row's first Q keys equals the masked
    reference, for one row (flat tokens are its columns) and for rows of different lengths (padding queries, whose
    keys past the row's tokens hold other data, are not compared)."""
    g = torch.Generator().manual_seed(6)
    kc, vc = (torch.randn(24, 4, 2, 16, generator=g) for _ in range(2))
    q = torch.randn(11, 6, 16, generator=g)  # GQA: 6 query heads on 2 KV heads
    one = (torch.tensor([[3, 9, 1]]), torch.arange(11)[None], torch.arange(11)[None])  # 11 tokens in 3 blocks
    got = causal_prompt_sdpa(q, kc, vc, one[0], one[1], 0.25)
    assert torch.allclose(got, paged_attention_sdpa(q, kc, vc, *one, 0.25), atol=1e-5)
    # rows of 7 and 4 tokens: flat 0..6 and 7..10, the second row's padding columns reading row T = 11
    tables = torch.tensor([[5, 2], [8, 0]])
    qidx = torch.tensor([[0, 1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 11, 11]])
    qpos = torch.tensor([[0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 0, 0, 0]])
    got = causal_prompt_sdpa(q, kc, vc, tables, qidx, 0.25)
    assert torch.allclose(got, paged_attention_sdpa(q, kc, vc, tables, qidx, qpos, 0.25), atol=1e-5)


def test_one_rule_marks_prompts_from_zero_for_packed_steps_and_graphs():
    """``causal_prompts``: "auto" and the SDPA backend, not the Triton backend (which keeps every step on the
    paged kernel). The runner marks packed steps and keys prefill graphs by it alike."""
    from specserve.models.attention import causal_prompts

    assert causal_prompts("auto") and causal_prompts("sdpa") and not causal_prompts("triton")


def test_only_a_prompts_first_chunk_takes_the_causal_kernel(tmp_path, monkeypatch):
    """``from_zero`` is set for a step whose rows all start at position 0: a prompt's first chunk; its later
    chunks, and a prompt whose start the prefix cache already holds, take the paged path. The tokens equal an
    engine that prefills each prompt in one step."""
    import specserve.models.attention as attention
    from specserve import LLM, SamplingParams
    from tiny_models import make_hf_model

    make_hf_model(tmp_path / "target", "llama", num_hidden_layers=2)
    prompt = {"prompt_token_ids": list(range(5, 25))}  # 20 tokens: chunks of 8, 8 and 4
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    whole = LLM(str(tmp_path / "target"), device="cpu", dtype="float32").generate([prompt], sp)[0].token_ids
    widths = []

    def spy(q, k_cache, v_cache, block_tables, query_index, *a):
        widths.append(query_index.shape[1])
        return causal_prompt_sdpa(q, k_cache, v_cache, block_tables, query_index, *a)

    monkeypatch.setattr(attention, "causal_prompt_sdpa", spy)
    llm = LLM(str(tmp_path / "target"), device="cpu", dtype="float32", max_num_batched_tokens=8)
    assert llm.generate([prompt], sp)[0].token_ids == whole
    assert widths == [8, 8]  # the first chunk, in each of the two layers
    widths.clear()
    assert llm.generate([prompt], sp)[0].token_ids == whole  # its first 16 tokens' blocks are cached
    assert widths == []
    # a one-row prefill graph (its layout run without capture on the CPU) is keyed by the mark, and so is its
    # prompt: a whole prompt from position 0 takes the kernel there too
    from specserve.runner.cuda_graph import CudaGraphs

    runner = llm.engine.runner
    runner.graphs = CudaGraphs(4, runner._staging_buffers(), capture=False)
    pick, layouts = runner.graph_layout, []
    runner.graph_layout = lambda batch: layouts.append(pick(batch)) or layouts[-1]
    llm.engine.pool.reset_cache()
    short = {"prompt_token_ids": list(range(5, 12))}  # 7 tokens: one chunk, a prefill graph of 16
    ref = LLM(str(tmp_path / "target"), device="cpu", dtype="float32").generate([short], sp)[0].token_ids
    widths.clear()  # the packed engine's prompt: [7, 7]
    assert llm.generate([short], sp)[0].token_ids == ref
    first = next(lay for lay in layouts if lay is not None and lay.prefill)
    assert first.from_zero and first.q == 16 and widths == [16, 16]
    # a packed step whose dense layout would pad past twice its tokens (one long prompt beside short ones) keeps
    # the paged path; two prompts of like lengths take the kernel together
    llm = LLM(str(tmp_path / "target"), device="cpu", dtype="float32", enable_prefix_caching=False)
    ragged = [prompt] + [{"prompt_token_ids": [7 + i]} for i in range(3)]  # 4 rows x 20 > 2 x 23 tokens
    refs = [o.token_ids for o in LLM(str(tmp_path / "target"), device="cpu", dtype="float32").generate(ragged, sp)]
    widths.clear()
    assert [o.token_ids for o in llm.generate(ragged, sp)] == refs and widths == []
    assert [o.token_ids for o in llm.generate([prompt, short], sp)] == [whole, ref] and widths == [20, 20]
