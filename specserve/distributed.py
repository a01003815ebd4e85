"""Tensor parallelism through ``torch.distributed`` (NCCL on GPUs, gloo on CPUs).

One process per rank. Rank 0 is the engine users talk to; it starts ranks 1..N-1 itself (``start_workers``, as
``vllm serve --tensor-parallel-size`` does), or every rank is started by ``torchrun`` (``RANK`` / ``WORLD_SIZE`` in
the environment; ranks other than 0 then run ``serve_rank``). Every rank builds the same engine over its shard of
the weights and runs the same steps in lockstep: before each step rank 0 broadcasts what changed since the last
one (requests added, with their seeds, and aborted), so every rank's scheduler makes the same choices; the
decoder's row-parallel outputs are summed across ranks (``all_reduce``), which leaves every rank the same hidden
states, logits, samples and acceptance, with no host round trip beyond that broadcast.

What is sharded: each attention layer's heads (the fused qkv projection by q and KV heads, the o projection by its
input), each MLP's intermediate features (gate/up by rows, down by its input), and so the KV cache by KV heads; the
embedding and the output layer by vocabulary rows (``VocabParallelEmbedding``: each rank looks up the ids it holds
and the ranks' rows are summed; the output layer's logits are gathered, so every rank samples and accepts over the
whole vocabulary). The draft head is replicated (it is small; its KV lives in a tensor of its own with all its KV
heads); where it shares the target's embedding or output layer it reads them through the same collectives.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import socket

import torch
import torch.distributed as dist

# a collective that waits this long for a rank that died or hung raises instead of hanging (longer than any rank's
# load or graph capture before the first collective)
TIMEOUT = datetime.timedelta(seconds=300)


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """This process's place among the tensor-parallel ranks."""

    rank: int = 0
    size: int = 1

    @property
    def active(self) -> bool:
        return self.size > 1

    def shard(self, n: int, what: str) -> tuple[int, int]:
        """(start, length) of this rank's share of ``n`` units (heads, features); ``n`` must divide evenly."""
        if n % self.size:
            raise ValueError(f"tensor_parallel_size={self.size} does not divide the model's {n} {what}")
        k = n // self.size
        return self.rank * k, k

    def smallest(self, n: int) -> int:
        """The smallest of every rank's ``n`` (a size each rank must agree on, such as the KV pool's blocks)."""
        if not self.active:
            return n
        t = torch.tensor([n], dtype=torch.int64)
        if dist.get_backend() == "nccl":
            t = t.cuda()
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place (every rank gets the same values)."""
        if self.active:
            dist.all_reduce(x)
        return x

    def vocab_shard(self, vocab: int) -> tuple[int, int]:
        """(start, rows) of this rank's vocabulary rows: ``ceil(vocab / size)`` each, the last rank's padded past
        ``vocab`` (a vocabulary rarely divides evenly)."""
        rows = -(-vocab // self.size)
        return self.rank * rows, rows

    def gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., n] on each rank -> [..., size * n], the ranks' parts side by side in rank order (every rank gets
        the whole)."""
        if not self.active:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]  # [..., n] each
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)


SINGLE = TensorParallel()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_group(tp: TensorParallel, device: torch.device, address: str) -> None:
    """Join the process group of ``tp.size`` ranks at ``address`` (tcp://host:port)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    kw = {}
    if device.type == "cuda":  # collectives and their tensors on this rank's GPU
        torch.cuda.set_device(device)
        kw = dict(device_id=device)
    dist.init_process_group(backend, init_method=address, rank=tp.rank, world_size=tp.size, timeout=TIMEOUT, **kw)


def rank_device(device: torch.device, tp: TensorParallel) -> torch.device:
    """Rank r runs on cuda:r (a CPU rank on the CPU)."""
    return torch.device("cuda", tp.rank) if device.type == "cuda" and tp.active else device


def from_torchrun() -> TensorParallel | None:
    """The rank ``torchrun`` gave this process, if it did."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return TensorParallel(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    return None


class Commands:
    """Rank 0's side of the lockstep: what changed since the last step, broadcast before the next one."""

    def __init__(self, workers: list | None = None) -> None:
        self.pending: list[tuple] = []
        self.workers = workers or []  # processes rank 0 started (checked before each broadcast)

    def add(self, *command) -> None:
        self.pending.append(command)

    def check(self) -> None:
        """Raise if a rank this one started has exited (a collective with it would fail or wait)."""
        for p in self.workers:
            if not p.is_alive():
                raise RuntimeError(f"tensor-parallel rank {self.workers.index(p) + 1} exited "
                                   f"(exit code {p.exitcode}); the engine cannot continue")

    def broadcast(self, final: bool = False) -> None:
        """Send the pending commands (and ``step``, or ``stop`` when ``final``) to every other rank."""
        self.check()
        msg = [self.pending + [("stop",) if final else ("step",)]]
        self.pending = []
        dist.broadcast_object_list(msg, src=0)
        if final:  # every rank has the stop before any tears its connections down (gloo aborts on a closed peer)
            dist.barrier()


def broadcast_object(tp: TensorParallel, obj):
    """Rank 0's ``obj`` on every rank (a value measured on rank 0 that every rank must decide by alike)."""
    if not tp.active:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def receive() -> list[tuple]:
    """A rank other than 0: the next commands from rank 0."""
    msg = [None]
    dist.broadcast_object_list(msg, src=0)
    return msg[0]


def serve_rank(engine) -> None:
    """A rank other than 0: apply rank 0's commands and run every step it runs, until it stops."""
    try:
        while True:
            for cmd in receive():
                if cmd[0] == "add":  # token ids, parameters (seeded by rank 0), request id
                    engine.add_request(*cmd[1:])
                elif cmd[0] == "abort":
                    engine.abort_request(cmd[1])
                elif cmd[0] == "step":
                    engine.step()
                elif cmd[0] == "stop":
                    dist.barrier()  # rank 0's, after the stop: no rank closes its connections first
                    return
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _worker_main(args, rank: int, size: int, address: str) -> None:
    from specserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(args, tp=TensorParallel(rank, size), address=address)
    serve_rank(engine)


def start_workers(args, size: int, address: str) -> list:
    """Rank 0: start ranks 1..size-1, each building the engine from ``args`` (``EngineArgs``) over its shard."""
    ctx = torch.multiprocessing.get_context("spawn")
    procs = []
    for rank in range(1, size):
        p = ctx.Process(target=_worker_main, args=(args, rank, size, address), daemon=True)
        p.start()
        procs.append(p)
    return procs
