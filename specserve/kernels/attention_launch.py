"""The paged attention kernel's launch shape for a step (``kernels.attention``): query rows of a tile, queries per
tile, tiles per row and key splits, from sizes known on the host, so a step's launch can be captured in a CUDA
graph: the rules, and the measurements they come from."""

from __future__ import annotations

# Launch choices, from a sweep on the H200 (bf16, batch 1, 1 and 5 queries, SmolLM2-135M and Llama-3.1-8B
# shapes, 30 calls in one CUDA graph; docs/BENCHMARKS.md): a program walks its keys one dependent load after
# another, so fewer, wider iterations and more programs win even at the price of the merge kernel: at 512
# table positions 4 splits of 128 keys took 6.8 us against 11.3 us for one split in 64-key iterations.
SPLIT = 256  # key positions per split past MIN_SPLITS splits
MIN_SPLITS = 4  # a table past ONE_SPLIT_KEYS positions splits at least this many ways
ONE_SPLIT_KEYS = 256  # block tables up to this many positions: SHORT_SPLIT positions a split, or one split
# A short table splits too where the o projection merges the splits in its prologue (no merge kernel:
# ``split_short``) and the step has tiles of at most 32 query rows (decode, verify and prefills of a few tokens)
# and at most SHORT_PROGRAMS (row, query tile, KV head) programs, in SHORT_SPLIT-position splits (at most
# MIN_SPLITS). At 256 positions (batch 1, bf16, H200) 4 splits of 64 keys made a 1 + 4-token verify step 84 us
# shorter (0.644 -> 0.560 ms) and a decode step 22 us; batches of 2-10 rows (up to 32 programs of the default
# model) split alike, not measured.
SHORT_SPLIT = 64
SHORT_PROGRAMS = 32
# Split partial sums (float32, per row x query tile x KV head x split) a step may allocate: past this it takes one
# split. A train-draft regeneration's prefill of 137 long prompts (thousands of programs, which fill the GPU
# without splitting) asked the H200 for 45.7 GiB. Batch-64 verify steps (D = 4) stay below it: the default
# model's over 8,192 positions 26 MB, 8B shapes' over 1,024 34 MB and over 16,384 545 MB.
MAX_PARTIALS = 1 << 30
# A draft tree's verify step of a few rows (rows of at most TREE_VERIFY_QUERIES queries, the root and its nodes; at
# batch 1 and the default model's 3 query heads a KV head a 24-node tree is 75 tile rows, two 64-row tiles by the
# rule above, with 4 splits over 512 positions) runs in 16-row tiles of 8 warps and at least 8 splits where it
# splits: on one H100 (bf16, batch 1, ``bench_attention.py --tree``) 5.7 us against 9.8 over 512 table positions
# and 9.0 against 15.2 over 2,048; more programs walk the keys side by side. Up to TREE_VERIFY_ROWS rows such a step
# still has fewer programs than the GPU has SMs; larger batches (not measured) and a tree engine's prompt chunks
# (hundreds of queries a row, with the tree mask's bits too) keep the rule above.
TREE_BLOCK_M = 16
TREE_WARPS = 8
TREE_MIN_SPLITS = 8  # at most gemv.MERGE_MAX_SPLITS: the o projection still merges them (a test checks)
TREE_VERIFY_QUERIES = 64  # the most a tree's verify row takes (the acceptance kernel's limit)
TREE_VERIFY_ROWS = 4


def query_tiling(qw: int, g: int, block_m: int | None = None) -> tuple[int, int, int]:
    """Query rows of a program's tile, queries per tile and tiles per row, for rows of ``qw`` queries and ``g``
    query heads per KV head (a tile packs a query's heads together: GQA heads and a row's 1 + D queries share
    one ``tl.dot``); ``block_m`` overrides the tile's rows (tuning)."""
    if block_m is None:
        block_m = max(16, min(64, 1 << (qw * g - 1).bit_length()))  # the next power of two, 16 to 64
    qpt = max(1, block_m // g)
    return block_m, qpt, -(-qw // qpt)


def default_splits(keys: int, programs: int, tile_bytes: int, short: bool = False) -> int:
    """Key splits of a step with ``keys`` table positions and ``programs`` (row, query tile, KV head)
    programs, each split's partial sums ``tile_bytes`` a program: up to ``ONE_SPLIT_KEYS`` positions
    ``SHORT_SPLIT`` positions a split for a step of few programs (``short``: decode and verify tiles), else one;
    one where the partial sums would pass ``MAX_PARTIALS``; else ``SPLIT`` positions a split, at least
    ``MIN_SPLITS``."""
    if keys <= ONE_SPLIT_KEYS:
        return max(1, min(MIN_SPLITS, -(-keys // SHORT_SPLIT))) if short and programs <= SHORT_PROGRAMS else 1
    splits = max(MIN_SPLITS, -(-keys // SPLIT))
    return 1 if programs * splits * tile_bytes > MAX_PARTIALS else splits


def partial_bytes(block_m: int, head_d: int) -> int:
    """Bytes of one program's partial sums for one split: the accumulator and the running max and sum."""
    return 4 * block_m * (head_d + 2)


def tree_verify_tiles(rows: int, qw: int, g: int, tree: bool, block_m: int | None) -> bool:
    """Whether a step takes a draft tree's verify launch (``TREE_BLOCK_M``): at most ``TREE_VERIFY_ROWS`` rows with
    the tree mask of at most ``TREE_VERIFY_QUERIES`` queries, where no tile rows are asked for."""
    return (tree and block_m is None and rows <= TREE_VERIFY_ROWS and qw <= TREE_VERIFY_QUERIES
            and g <= TREE_BLOCK_M)


def launch_shape(rows: int, qw: int, g: int, hkv: int, head_d: int, keys: int, split_short: bool = False,
                 block_m: int | None = None, tree: bool = False) -> tuple[int, int, int, int]:
    """A step of ``rows`` rows of ``qw`` queries, ``g`` query heads per KV head, ``hkv`` KV heads, head size
    ``head_d`` (a power of two) and ``keys`` table positions -> (query rows of a tile, queries per tile, tiles
    per row, default key splits). ``split_short``: the splits' merge costs no kernel of its own (the o
    projection merges them), so a short table of a decode or verify step splits too. ``tree``: the rows carry a
    draft tree's mask (``tree_verify_tiles``)."""
    tree_tiles = tree_verify_tiles(rows, qw, g, tree, block_m)
    block_m, qpt, n_qt = query_tiling(qw, g, TREE_BLOCK_M if tree_tiles else block_m)
    programs, tile = rows * n_qt * hkv, partial_bytes(block_m, head_d)
    splits = default_splits(keys, programs, tile, short=split_short and block_m <= 32)
    if tree_tiles and keys > ONE_SPLIT_KEYS and 1 < splits < TREE_MIN_SPLITS \
            and programs * TREE_MIN_SPLITS * tile <= MAX_PARTIALS:
        splits = TREE_MIN_SPLITS
    return block_m, qpt, n_qt, splits
