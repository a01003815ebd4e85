"""The seconds of a speculative step by (rows, option): ``StepCosts`` (measured at engine start through the runner's
own launch and collect, ``measure_step_costs``, or loaded from ``step_cost_file``, ``load_or_measure_costs``), which
the draft length's choice (``draft_len``) and a tree's choice between tree and chain (``tree_choice``) weigh, and
whose estimates observed step periods move (``StepCosts.observe``)."""

from __future__ import annotations

import bisect
import json
import logging
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger("specserve")

# an observed step period moves its (rows, D) estimate by this share of the difference, counting at most
# OBSERVE_CLIP times the estimate (a period that holds a graph capture moves it at most 12.5%); a period past
# OBSERVE_DROP times the estimate is not a step's cost (the engine waited for work) and is dropped. A host-bound
# step can cost a few times its start-up measurement: the estimate climbs there in steps of up to 12.5%.
OBSERVE_WEIGHT = 0.25
OBSERVE_CLIP = 1.5
OBSERVE_DROP = 8.0


@dataclass
class StepCosts:
    """Seconds of one speculative step by (rows, D): ``seconds[i][d]`` for a step of ``buckets[i]`` rows (a
    graph step's rows are padded up to its capture size, so a step of B rows costs what the smallest bucket
    >= B costs)."""

    buckets: list[int]  # ascending row counts
    seconds: list[list[float]]  # [bucket][D = 0..max_draft_len]

    def __post_init__(self) -> None:
        if not self.buckets or len(self.buckets) != len(self.seconds) or self.buckets != sorted(set(self.buckets)):
            raise ValueError("step costs need ascending, distinct row counts, one row of seconds each")
        widths = {len(s) for s in self.seconds}
        if len(widths) != 1 or min(widths) < 1 or any(t <= 0 for s in self.seconds for t in s):
            raise ValueError("step costs need positive seconds for the same draft lengths in every bucket")

    @property
    def max_draft_len(self) -> int:
        return len(self.seconds[0]) - 1

    def row(self, rows: int) -> list[float]:
        """Seconds of a step of ``rows`` rows for each D: the smallest bucket holding them; past the largest,
        that bucket's scaled by rows (a step's cost grows at most linearly in its rows)."""
        i = bisect.bisect_left(self.buckets, rows)
        if i < len(self.buckets):
            return self.seconds[i]
        scale = rows / self.buckets[-1]
        return [t * scale for t in self.seconds[-1]]

    def observe(self, rows: int, draft_len: int, seconds: float) -> None:
        """Move the estimate of a step of ``rows`` rows and D = ``draft_len`` towards an observed period (module
        docstring); rows past the largest bucket are not recorded."""
        i = bisect.bisect_left(self.buckets, rows)
        if i == len(self.buckets) or not 0 <= draft_len <= self.max_draft_len or seconds <= 0:
            return
        old = self.seconds[i][draft_len]
        if seconds > OBSERVE_DROP * old:
            return
        self.seconds[i][draft_len] = old + OBSERVE_WEIGHT * (min(seconds, OBSERVE_CLIP * old) - old)

    def copy(self) -> "StepCosts":
        return StepCosts(list(self.buckets), [list(s) for s in self.seconds])

    def as_dict(self) -> dict:
        return {"buckets": self.buckets, "seconds": self.seconds}

    def save(self, path: str | Path, key: str) -> None:
        """Write under ``key`` (the model, head, dtype and device the costs belong to) into a JSON file, keeping
        the other keys it holds."""
        p = Path(path)
        data = json.loads(p.read_text()) if p.is_file() else {}
        data[key] = self.as_dict()
        p.write_text(json.dumps(data, indent=1))

    @classmethod
    def load(cls, path: str | Path, key: str) -> "StepCosts | None":
        """The costs stored under ``key`` in a JSON file written by ``save``; None when the file or key is
        missing. A file that is not such JSON raises ``ValueError`` naming it."""
        p = Path(path)
        if not p.is_file():
            return None
        try:
            entry = json.loads(p.read_text()).get(key)
            return None if entry is None else cls([int(b) for b in entry["buckets"]],
                                                  [[float(t) for t in s] for s in entry["seconds"]])
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"step cost file {p} is not one written by specserve ({e})") from e


def measure_step_costs(runner, pool, options: dict[int, list[int] | None], buckets: list[int], context: int = 256,
                       repeats: int = 5) -> StepCosts:
    """Seconds of a speculative step of each (rows in ``buckets``, option), as the engine runs it (staging, launch,
    device, copy back; graphs replayed where the engine would replay them; under the overlap scheduler each step
    launched before the one before it is collected, so a step costs the larger of the host's and the device's
    time, as it does there). ``options`` (``SpeculatorBase.cost_options``), in the order of the costs' columns:
    the drafts a step proposes a row (a chain's D, a tree's N), each with the parents of the drafts it verifies
    (None: a chain's). Synthetic requests of ``context`` tokens whose KV blocks come from ``pool`` and go back,
    each step verifying as many drafts as it proposes, the median of ``repeats`` after a warm-up (which compiles
    kernels and captures graphs). The values computed are never read: only the time counts."""
    from specserve.core.request import Request
    from specserve.sampling_params import SamplingParams
    from specserve.scheduler.scheduler import ScheduledRequest, SchedulerOutput

    rows, most = max(buckets), max(options)
    sp = SamplingParams(temperature=0, max_tokens=1 << 20, ignore_eos=True)
    reqs = []
    try:
        for i in range(rows):
            r = Request(f"cost-{i}", None, [1] * context, sp, context + most + 2 + (1 << 20), ())
            # the drafts it verifies, then the draft loop's own slots (a tree's topk x (D - 1) may pass N)
            slots = context + max(2 * most + 1, runner.speculator.spec.kv_slots_past_len)
            if not pool.can_reserve(r.block_ids, slots):
                break
            pool.reserve(r.block_ids, slots)
            r.num_computed_tokens = context - 1
            reqs.append(r)
        usable = [b for b in buckets if b <= len(reqs)]
        if not usable:
            raise ValueError("the KV cache holds no request to measure step costs with")
        seconds = []
        for b in usable:
            per_d = []
            for d, parents in options.items():
                for r in reqs[:b]:
                    r.spec_token_ids, r.spec_parents = [1] * d, parents
                times, pending = [], None
                for rep in range(repeats + 2):
                    sched = [ScheduledRequest(r, context - 1, 1 + d, True, d, column=j) for j, r in enumerate(reqs[:b])]
                    t0 = time.perf_counter()
                    launched = runner.launch(SchedulerOutput(sched), draft_len=d)
                    if runner.overlap:  # the step before is collected while this one runs
                        pending, launched = launched, pending
                    if launched is not None:
                        runner.collect(launched)
                    if rep >= 2:
                        times.append(time.perf_counter() - t0)
                if pending is not None:
                    runner.collect(pending)
                per_d.append(statistics.median(times))
            seconds.append(per_d)
        return StepCosts(usable, seconds)
    finally:
        for r in reqs:
            pool.free(r.block_ids)
            r.spec_token_ids, r.spec_parents = [], None


def cost_buckets(max_rows: int) -> list[int]:
    """Row counts whose step costs are measured: powers of two below ``max_rows``, then ``max_rows`` (each a
    graph capture size too)."""
    out, b = [], 1
    while b < max_rows:
        out.append(b)
        b *= 2
    return out + [max_rows]


def load_or_measure_costs(engine, options: dict[int, list[int] | None]) -> StepCosts:
    """The engine's step costs for its speculator's ``options`` (``cost_options``: ``adaptive_draft_len``'s draft
    lengths, or a tree and its chains of 1..D): from its ``step_cost_file`` where that holds this model, head,
    dtype, device and those options, else measured now (and written there)."""
    spec = engine.spec_config
    dev = engine.device
    device_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    shape = f"D={spec.max_draft_len}" if not spec.tree else f"tree={spec.topk}x{spec.max_draft_len}x{spec.num_nodes}"
    key = "|".join(map(str, (engine.model_path, spec.draft_model, spec.method, engine.dtype, device_name,
                             shape, f"options={','.join(map(str, options))}",
                             f"rows={engine.config.scheduler_config.max_num_seqs}",
                             f"graphs={engine.runner.graphs is not None}")))
    if spec.step_cost_file is not None:
        costs = StepCosts.load(spec.step_cost_file, key)
        if costs is not None:
            return costs
    buckets = cost_buckets(engine.config.scheduler_config.max_num_seqs)
    log.info("measuring speculative step costs for %d batch sizes x %d kinds of step (drafts %s)", len(buckets),
             len(options), list(options))
    t0 = time.perf_counter()
    costs = measure_step_costs(engine.runner, engine.pool, options, buckets)
    log.info("step costs measured in %.1f s", time.perf_counter() - t0)
    if spec.step_cost_file is not None and engine.tp.rank == 0:  # every rank measures (in step); one writes
        costs.save(spec.step_cost_file, key)
    return costs
