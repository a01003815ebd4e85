"""The paged KV cache: a block pool (host bookkeeping) and the KV tensor it indexes (device).

One tensor ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` holds every layer's keys
and values; ``layer_views()`` hands each attention layer its ``(k, v)`` slice. Draft-head layers are
extra layers in the same tensor (``num_layers`` = target layers + head layers), so one block id
addresses a token's KV in every layer. Block 0 is reserved: padding tokens write there and padded
block-table entries point there, so no index is ever garbage.
"""

from __future__ import annotations

import gc
import logging
from collections import OrderedDict, deque

import torch

from specserve.config import CacheConfig, blocks_for_bytes, cdiv

log = logging.getLogger("specserve")

PAD_BLOCK = 0


class BlockPool:
    """Physical block ids ``1 .. num_blocks-1`` (block 0 is the padding block), with reference counts.

    With ``caching`` (automatic prefix caching) a full block whose KV is computed can be registered under a key
    (``block_keys``: its tokens, everything before them, and the tokens after it that a draft head's KV at its end
    reads); a request whose prompt starts with the same keys takes those blocks (``match``) instead of computing
    them. A block nobody uses keeps its content while it is free ("evictable"), and is handed out again, least
    recently freed first, only once the plain free list is empty."""

    def __init__(self, num_blocks: int, block_size: int, caching: bool = False) -> None:
        if num_blocks < 2:
            raise ValueError(f"a KV pool needs at least 2 blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.caching = caching
        self._free: deque[int] = deque(range(1, num_blocks))  # blocks whose content nobody can reuse
        self._ref = [0] * num_blocks  # requests holding each block
        self._key_of: dict[int, int] = {}  # registered block -> its key
        self._by_key: dict[int, int] = {}  # key -> registered block
        self._evictable: OrderedDict[int, None] = OrderedDict()  # registered blocks nobody holds, oldest first
        self.queried = 0  # blocks looked up by ``match``
        self.hit = 0  # of them, found

    @property
    def num_free(self) -> int:
        """Blocks a request can take: the free list and the evictable cached blocks."""
        return len(self._free) + len(self._evictable)

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    @property
    def hit_rate(self) -> float | None:
        """Share of the full prompt blocks looked up that were found cached (None before any lookup)."""
        return self.hit / self.queried if self.queried else None

    def blocks_needed(self, block_ids: list[int], num_slots: int) -> int:
        """How many more blocks a request holding ``block_ids`` needs for ``num_slots`` token slots."""
        return max(0, cdiv(num_slots, self.block_size) - len(block_ids))

    def can_reserve(self, block_ids: list[int], num_slots: int) -> bool:
        return self.blocks_needed(block_ids, num_slots) <= self.num_free

    def reserve(self, block_ids: list[int], num_slots: int) -> None:
        """Grow ``block_ids`` in place so it covers ``num_slots`` slots (reserve-ahead included)."""
        if not self.try_reserve(block_ids, num_slots):
            need = self.blocks_needed(block_ids, num_slots)
            raise RuntimeError(f"KV pool exhausted: need {need} blocks, {self.num_free} free")

    def try_reserve(self, block_ids: list[int], num_slots: int) -> bool:
        """``reserve`` where the pool can hold it -> whether it did (the scheduler's test and grow in one, once a
        row and step)."""
        need = self.blocks_needed(block_ids, num_slots)
        if need == 0:
            return True
        if need > self.num_free:
            return False
        for _ in range(need):
            if self._free:
                block = self._free.popleft()
            else:  # the least recently freed cached block gives up its content
                block, _ = self._evictable.popitem(last=False)
                del self._by_key[self._key_of.pop(block)]
            self._ref[block] = 1
            block_ids.append(block)
        return True

    def free(self, block_ids: list[int]) -> None:
        """Release every block of a request and empty its list; a block nobody holds any more goes back to the
        free list, or, registered, becomes evictable (its content kept for a later ``match``)."""
        for block in reversed(block_ids):
            self._ref[block] -= 1
            if self._ref[block] == 0:
                if block in self._key_of:
                    self._evictable[block] = None
                else:
                    self._free.append(block)
        block_ids.clear()

    def share(self, block_ids: list[int]) -> list[int]:
        """Blocks another request holds, held once more (a fork) -> a new list of them."""
        for block in block_ids:
            self._ref[block] += 1
        return list(block_ids)

    def match(self, keys: list[int]) -> list[int]:
        """The registered blocks of the longest run of ``keys`` from the first, each now held once more."""
        found = []
        if self.caching:
            for key in keys:
                block = self._by_key.get(key)
                if block is None:
                    break
                if self._ref[block] == 0:
                    del self._evictable[block]
                self._ref[block] += 1
                found.append(block)
            self.queried += len(keys)
            self.hit += len(found)
        return found

    def cached_run(self, keys: list[int], limit: int) -> int:
        """How many of the first ``limit`` ``keys``, from the first, are registered (``match`` without taking them
        or counting)."""
        n, limit = 0, min(limit, len(keys))
        if self.caching:
            while n < limit and keys[n] in self._by_key:
                n += 1
        return n

    def register(self, block_ids: list[int], keys: list[int]) -> None:
        """Register each block under its key (pairwise; their KV computed); a key already registered keeps its
        block."""
        if not self.caching:
            return
        for block, key in zip(block_ids, keys):
            if block not in self._key_of and key not in self._by_key:
                self._key_of[block] = key
                self._by_key[key] = block

    def reset_cache(self) -> None:
        """Forget every cached block (``specserve bench`` between runs of the same prompts): held blocks keep
        their holders, the others return to the free list; the hit counters restart."""
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._key_of.clear()
        self._by_key.clear()
        self.queried = self.hit = 0

    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_usable


def block_keys(keys: list[int], token_ids: list[int], block_size: int, after: int) -> list[int]:
    """Extend ``keys`` (a request's block keys so far) in place to every full block of ``token_ids`` followed by at
    least ``after`` more tokens -> keys. Block i's key hashes the key before it, its tokens and the ``after`` tokens
    past it (a draft head's KV at a position reads tokens after it: 0 without speculation)."""
    n = (len(token_ids) - after) // block_size
    for i in range(len(keys), n):
        prev = keys[i - 1] if i else 0
        lo, hi = i * block_size, (i + 1) * block_size
        keys.append(hash((prev, tuple(token_ids[lo:hi]), tuple(token_ids[hi:hi + after]))))
    return keys


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


# GPU memory an engine keeps outside its KV cache besides what it holds when the cache is sized (the weights):
# activations of a prefill chunk, logits, staging buffers, CUDA-graph pools
ACTIVATION_RESERVE = 2 << 30


def cpu_kv_budget(cfg: CacheConfig, per_block: int, seq_blocks: int, max_num_seqs: int) -> int:
    """Default KV bytes on the CPU: what ``max_num_seqs`` sequences of ``seq_blocks`` blocks each (max_model_len
    plus speculation's slots) need, at most ``cfg.cpu_kv_cache_bytes`` or an eighth of the memory available now
    (the pool is zeroed, so every byte of it is touched at start). A model whose one sequence needs more (a long
    context) gets the cap, and the engine lowers max_model_len to what it holds, with a warning."""
    wanted = (max_num_seqs * seq_blocks + 1) * per_block
    cap = cfg.cpu_kv_cache_bytes
    available = _available_memory()
    if available is not None:
        cap = min(cap, available // 8)
    return max(min(wanted, cap), 2 * per_block)


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def plan_num_blocks(cfg: CacheConfig, per_block: int, device: torch.device, weight_bytes: int = 0,
                    seq_blocks: int = 0, max_num_seqs: int = 1) -> int:
    """Pool size from the cache config: an exact count, an explicit byte budget, or on CUDA vLLM's rule: the
    engine may use ``gpu_memory_utilization`` of the GPU's total memory, and its KV cache takes what is left of
    that after its weights (``weight_bytes``: target and head) and ``ACTIVATION_RESERVE``; that must be free.
    On the CPU: ``cpu_kv_budget`` (``seq_blocks``: the blocks one sequence of max_model_len tokens needs)."""
    if cfg.num_blocks is not None:
        return cfg.num_blocks
    if cfg.kv_cache_memory_bytes is not None:
        budget = cfg.kv_cache_memory_bytes
    elif device.type == "cuda":
        # memory this process no longer uses counts as free: engines dropped but not yet collected (reference
        # cycles) and blocks PyTorch's allocator keeps cached (an earlier engine's cache, a training run's
        # activations) go back to the device first
        gc.collect()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)  # free: besides what the weights took already
        util, gib = cfg.gpu_memory_utilization, 2 ** 30
        budget = int(total * util) - weight_bytes - ACTIVATION_RESERVE
        if budget <= 0:
            raise ValueError(
                f"--gpu-memory-utilization {util} ({total * util / gib:.1f} GiB) leaves no room for a KV cache after "
                f"the weights ({weight_bytes / gib:.1f} GiB) and {ACTIVATION_RESERVE / gib:.0f} GiB for activations: "
                "raise it or give --kv-cache-memory")
        if budget + ACTIVATION_RESERVE > free:
            raise ValueError(
                f"--gpu-memory-utilization {util} lets this engine use {total * util / gib:.1f} GiB of the GPU's "
                f"{total / gib:.1f} GiB, but only {(free + weight_bytes) / gib:.1f} GiB are free to it (other engines "
                "or processes hold the rest): lower --gpu-memory-utilization or give --kv-cache-memory")
    else:
        budget = cpu_kv_budget(cfg, per_block, seq_blocks, max_num_seqs) if seq_blocks else cfg.cpu_kv_cache_bytes
    n = blocks_for_bytes(budget, per_block)
    if n < 2:
        raise ValueError(f"KV cache budget of {budget} bytes holds {n} blocks of {per_block} bytes; need at least 2")
    return n


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        self.tensor = torch.zeros(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim,
                                  dtype=dtype, device=device)
        self.block_size = block_size
        self.num_blocks = num_blocks
        log.info("KV cache: %d blocks x %d tokens (%.1f MiB)", num_blocks, block_size,
                 self.tensor.numel() * self.tensor.element_size() / 2**20)

    def layer_views(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(self.tensor[i, 0], self.tensor[i, 1]) for i in range(self.tensor.shape[0])]
