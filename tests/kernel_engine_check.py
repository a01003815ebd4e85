"""The whole engine with every Triton kernel (through Triton's interpreter on the CPU) gives the greedy tokens
of the PyTorch reference path: plain and speculative, packed and padded (graph) layouts, chunked prefill.
Run by tests/test_kernels.py as ``TRITON_INTERPRET=1 python tests/kernel_engine_check.py``; with
SPECSERVE_KERNEL_CHECKS=quick (the CPU suite) a few runs that between them take every layout and kernel, instead
of each case alone."""

import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from check_util import faster_interpreter_device_calls  # noqa: E402
from specserve import LLM, SamplingParams  # noqa: E402
from specserve.runner.cuda_graph import CudaGraphs  # noqa: E402
from tiny_models import PROMPTS, make_head, make_hf_model  # noqa: E402

faster_interpreter_device_calls()
if os.environ.get("SPECSERVE_BUILD_SM"):  # also build each launched kernel for that GPU (kernel_build.py)
    import kernel_build  # noqa: E402
    launched = kernel_build.record()
root = Path(tempfile.mkdtemp())
make_hf_model(root / "t", "llama", initializer_range=0.4, num_hidden_layers=2)
make_head(root / "e3", root / "t", "eagle3", own_head=False, seed=1)
# the same head's weights drafting over 60 of the target's lm_head rows (gathered rows, mapped argmax)
make_head(root / "e3v", root / "t", "eagle3", own_head=False, draft_vocab=60, seed=1)
QUICK = os.environ.get("SPECSERVE_KERNEL_CHECKS") == "quick"


def run(backend: str, spec: bool, padded: bool, head: str = "e3", overlap: bool = False,
        tree: bool = False, tokens: int = 12, draft_lens: list[int] | None = None) -> list[list[int]]:
    # a short context: the interpreter runs every key block of a row's table
    sc = dict(method="eagle3", draft_model=str(root / head), max_draft_len=3) if spec else None
    if tree:  # a draft tree: its ancestor bits in the attention kernel, its correction under the overlap scheduler
        sc.update(topk=2, max_total_draft_tokens=6)
    if draft_lens:  # the draft length by step, in turn (a schedule that never binds lets it vary)
        sc.update(draft_len_schedule={64: 3})
    llm = LLM(str(root / "t"), device="cpu", dtype="float32", attention_backend=backend, max_num_batched_tokens=9,
              max_model_len=64, speculative_config=sc, overlap_scheduler=overlap, async_output=overlap)
    if draft_lens:
        steps = iter(draft_lens * 100)
        llm.engine.draft_policy.choose = lambda requests, generation=False, captured=None, verifying=0: next(steps)
    if padded:
        llm.engine.runner.graphs = CudaGraphs(8, llm.engine.runner._staging_buffers(), capture=False)
    return [o.token_ids for o in llm.generate(PROMPTS[:3], SamplingParams(temperature=0, max_tokens=tokens,
                                                                           ignore_eos=True))]


import specserve.kernels.gemv as gemv  # noqa: E402

# the reference: cuBLAS-style linears, norms and activations of their own (no few-row kernels)
rows_enabled, gemv._rows_enabled = gemv._rows_enabled, lambda *a: False
ref = run("sdpa", False, False)
gemv._rows_enabled = rows_enabled
bad = 0
for spec, padded in ((False, True),) if QUICK else ((False, False), (False, True), (True, False), (True, True)):
    same = run("triton", spec, padded) == ref
    bad += not same
    print(f"triton spec={spec} padded={padded}: {'ok' if same else 'DIFFERENT'}", flush=True)
# the norm after attention folded into the o projection and the down projection (SwiGLU.norm_folds): with the
# defaults this tiny model's verify steps of at least gemv_rows.MIN_ROWS rows take it (gate/up on the kernel that
# reads each weight block once for all rows, gemv_rows, and the qkv projection with RoPE on its several-row
# kernel); here every few-row step folds (as gate/up leaving the one-row kernel would make it), once with those
# several-row kernels and once without (MIN_ROWS past MAX_ROWS: gate/up on cuBLAS, qkv one program per row)
import specserve.kernels.gemv_rows as gemv_rows  # noqa: E402
import specserve.kernels.qkv_rope as qkv_rope  # noqa: E402
import specserve.models.layers as layers  # noqa: E402
import specserve.models.llama as llama  # noqa: E402

taken = {"gate/up": [], "qkv": []}
rows_linear, qkv_rows, takes_kernel = layers.rows_linear, qkv_rope._qkv_rows, layers.takes_kernel
layers.rows_linear = lambda x, w: taken["gate/up"].append(layers.rows_takes(x, w)) or rows_linear(x, w)
qkv_rope._qkv_rows = lambda *a, **k: taken["qkv"].append(True) or qkv_rows(*a, **k)
layers.takes_kernel = lambda n, k, t: False
min_rows = gemv_rows.MIN_ROWS
for rows in (True, False):
    gemv_rows.MIN_ROWS = min_rows if rows else gemv.MAX_ROWS + 1
    for calls in taken.values():
        calls.clear()
    same = run("triton", True, False) == ref  # quick: also the packed speculative layout's only runs
    if not taken["gate/up"] or any(taken["gate/up"]) != rows or bool(taken["qkv"]) != rows:
        print(f"the folded and several-row kernels did not run as asked: {({k: sum(v) for k, v in taken.items()})}")
        same = False
    bad += not same
    print(f"triton spec=True padded=False norm folded in every few-row step, several-row kernels {rows}: "
          f"{'ok' if same else 'DIFFERENT'}", flush=True)
gemv_rows.MIN_ROWS = min_rows
layers.rows_linear, qkv_rope._qkv_rows, layers.takes_kernel = rows_linear, qkv_rows, takes_kernel
same = run("triton", True, True, "e3v") == ref
bad += not same
print(f"triton spec=True padded=True draft vocabulary of the target's rows: {'ok' if same else 'DIFFERENT'}",
      flush=True)
# attention split in 16-key ranges (this tiny context otherwise takes 64-key splits or one): the o projection
# merges the partial sums in its prologue (gemv.merged_linear; with the defaults, verify steps of at least
# gemv_rows.MIN_ROWS rows fold the norm, so it also writes the stream and its scaled copy); the full run also
# checks the merge kernel, the fold off
import specserve.kernels.attention as attention  # noqa: E402
import specserve.kernels.attention_launch as attention_launch  # noqa: E402

attention_launch.ONE_SPLIT_KEYS, attention.BLOCK_N_WIDE = 0, 16
merged = []
merged_linear = llama.merged_linear
llama.merged_linear = lambda *a: merged.append(merged_linear(*a)) or merged[-1]
for fold in (True,) if QUICK else (True, False):
    llama.MERGE_FOLD = fold
    merged.clear()
    same = run("triton", True, True) == ref
    if fold and not any(o is not None for o in merged):
        print("the o projection never merged the partial sums itself")
        same = False
    bad += not same
    print(f"triton spec=True padded=True attention in splits, merged in the o projection={fold}: "
          f"{'ok' if same else 'DIFFERENT'}", flush=True)
# the overlap scheduler (rows corrected on the device from the step in flight: correct_record's kernel), with a
# chain, with a draft tree (the tree attention mask, positions by depth from the parents) and with a chain whose
# draft length changes every step (layouts of 1 + its drafts, 0 included; a step drafting 0 runs no head; the
# third D = 0 in a row neither verifies nor continues a row that verifies drafts: a plain step, whose correction
# reads the speculator's carry from its second column)
from specserve.speculative.speculator import Speculator  # noqa: E402

plain = []  # per step: whether it ran as a plain step continuing a row of the step in flight
drafts_nothing = Speculator.drafts_nothing


def counted(self, sched) -> bool:
    out = drafts_nothing(self, sched)
    plain.append(out and any(s.after is not None for s in sched))
    return out


Speculator.drafts_nothing = counted
for tree, lens in ((False, None), (True, None), (False, [0, 3, 1, 0, 0, 0, 2, 3])):
    # 7 tokens (greedy: the reference's first 7), as a tree step in the interpreter is slow
    plain.clear()
    same = run("triton", True, True, overlap=True, tree=tree, tokens=7, draft_lens=lens) == [r[:7] for r in ref]
    if lens and not any(plain):
        print("no plain step continued a row of the step in flight")
        same = False
    bad += not same
    print(f"triton spec=True padded=True overlap scheduler, tree={tree}, draft lengths {lens}: "
          f"{'ok' if same else 'DIFFERENT'}", flush=True)
from specserve import kernels  # noqa: E402

if kernels.FAILED:  # a kernel fell back to its reference: the comparison above did not test it
    print(f"kernels that did not build: {sorted(kernels.FAILED)}")
    bad += 1
if os.environ.get("SPECSERVE_BUILD_SM"):
    try:
        kernel_build.build_recorded(launched, int(os.environ["SPECSERVE_BUILD_SM"]))
    except kernel_build.BuildError:
        bad += 1
sys.exit(1 if bad else 0)
