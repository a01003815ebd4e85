"""Where the wall time of an engine step goes on the host, with the real model and device: generation over the
default chat prompts at one row a step (``--batch`` for more), speculation off, then on, every piece of
``LLMEngine.step`` timed with ``time.perf_counter`` wrappers, and Python's garbage collections timed through
``gc.callbacks``.

Pieces per step (microseconds, mean over every step of the timed run): schedule, layout (picking the graph layout),
stage (a graph step's record and its upload; of which reserve, the pinned buffer, and upload, the copy), launch (the
graph replay call, which returns once the work is queued), wait (the one device -> host copy: mostly the device
finishing the step; under the overlap scheduler it is part of results), choose (the draft length's choice), results
(turning the copy into per-row results), update (scheduler bookkeeping), detokenize, outputs (``RequestOutput``
objects), and the rest of ``step`` and of ``LLM.generate`` around it. The wrappers add about a microsecond each.
With ``--events``, gpu is the device's time of the step's replay (CUDA events around the launch), so wall - gpu is
what the host adds to a step. ``--zero-drafts`` adds a third engine, speculating with the adaptive draft length held
at D = 0 (its probes aside): what a step that drafts nothing costs over a plain one in the engine's loop.

    python benchmarks/profile_host.py [--model M] [--draft HEAD] [--num-prompts 16] [--max-tokens 256] [--batch 1]
                                      [--cprofile N]   (also: cProfile's N costliest functions of one more run)
                                      [--forced-acceptance AL] [--events] [--zero-drafts]
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import time

import torch

from specserve import LLM, SamplingParams
from specserve.bench.prompts import DEFAULT_PROMPTS
from specserve.speculative.step_costs import StepCosts


class Timers:
    def __init__(self) -> None:
        self.total: collections.Counter = collections.Counter()
        self.gc_s = 0.0
        self.gc_count = 0
        self._gc_t0 = 0.0

    def wrap(self, obj, attr: str, name: str) -> None:
        fn = getattr(obj, attr)
        total = self.total

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                total[name] += time.perf_counter() - t0

        setattr(obj, attr, timed)

    def gc_callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        else:
            self.gc_s += time.perf_counter() - self._gc_t0
            self.gc_count += 1


class _TimedTensor:
    """Stands for the step's output tensor so that its ``tolist`` (the device -> host copy) is timed."""

    def __init__(self, t: torch.Tensor, timers: Timers) -> None:
        self._t, self._timers = t, timers

    def tolist(self):
        t0 = time.perf_counter()
        out = self._t.tolist()
        self._timers.total["wait"] += time.perf_counter() - t0
        return out


def run(model, draft, prompts, max_tokens: int, repeats: int, cprofile: int = 0, forced: float | None = None,
        events: bool = False, async_output: bool | None = None, zero_drafts: bool = False, batch: int = 1) -> dict:
    spec = dict(method="eagle3", draft_model=draft, max_draft_len=4, forced_acceptance=forced) if draft else None
    if zero_drafts:
        spec["adaptive_draft_len"] = True
    # a set KV cache, so an engine still held by a reference cycle leaves the next one its memory
    llm = LLM(model, speculative_config=spec, max_num_seqs=batch, async_output=async_output,
              kv_cache_memory_bytes=2_000_000_000)
    eng = llm.engine
    if zero_drafts:  # costs under which drafting never pays: the adaptive policy holds D = 0 (its probes aside)
        eng.draft_policy.costs = StepCosts([1], [[1e-3] + [1.0] * 4])
        eng.draft_policy.timed = False
    chat = llm.tokenizer.has_chat_template  # random models' word-level tokenizers have no template
    ids = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]) if chat else llm.tokenizer.encode(p)
           for p in prompts]
    # forced acceptance, or a random model (whose replies would end wherever its end token happens to come)
    sp = SamplingParams(temperature=0, max_tokens=max_tokens,
                        ignore_eos=forced is not None or str(model).startswith("random:"))
    llm.generate([{"prompt_token_ids": x} for x in ids], sp)  # warm-up: graph capture
    tm = Timers()
    runner = eng.runner
    tm.wrap(eng.scheduler, "schedule", "schedule")
    tm.wrap(eng.scheduler, "update", "update")
    tm.wrap(eng, "_detokenize", "detokenize")
    tm.wrap(eng, "_output", "outputs")
    tm.wrap(runner, "stage_graph", "stage")
    tm.wrap(runner, "graph_layout", "layout")
    tm.wrap(runner._ints, "reserve", "reserve")  # inside "stage": the pinned buffer (and any wait for it),
    tm.wrap(runner._ints, "rewrite", "reserve")  # or the same buffer rewritten in place
    tm.wrap(runner._ints, "upload", "upload")  # inside "stage": the copy to the device
    tm.wrap(runner, "launch", "execute")  # the engine's two runner calls: launch (stage + replay), then
    tm.wrap(runner, "collect", "collect")  # collect (the copy back and the per-row results)
    tm.wrap(eng, "step", "step")
    if eng.draft_policy is not None:
        tm.wrap(eng.draft_policy, "choose", "choose")  # inside "execute": the draft length's choice
    if runner.graphs is not None:
        graphs = runner.graphs
        real_run = graphs.run

        def run_timed(key, step, rerun=True):
            t0 = time.perf_counter()
            if events:  # the device's time for this replay alone (it starts when the launch reaches it)
                ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                ev[0].record()
            out = real_run(key, step, rerun)
            if events:
                ev[1].record()
                gpu_events.append(ev)
            tm.total["launch"] += time.perf_counter() - t0
            return _TimedTensor(out, tm) if isinstance(out, torch.Tensor) else out

        graphs.run = run_timed
    gpu_events: list = []
    gc.callbacks.append(tm.gc_callback)
    best = None
    for _ in range(repeats):
        before = dict(tm.total), tm.gc_s, tm.gc_count, eng.num_steps
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": x} for x in ids], sp)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        steps = eng.num_steps - before[3]
        per = {k: (v - before[0].get(k, 0.0)) / steps * 1e6 for k, v in tm.total.items()}
        if gpu_events:  # device time of the replays: their sum over the run's steps, and the median replay
            ms = sorted(a.elapsed_time(b) for a, b in gpu_events)
            per["gpu"] = sum(ms) / steps * 1e3
            per["gpu_median"] = ms[len(ms) // 2] * 1e3
            gpu_events.clear()
        res = dict(wall_s=wall, steps=steps, tokens=sum(len(o.outputs[0].token_ids) for o in outs),
                   gc_ms=(tm.gc_s - before[1]) * 1e3, gc_count=tm.gc_count - before[2], us_per_step=per)
        if best is None or wall < best["wall_s"]:
            best = res
    gc.callbacks.remove(tm.gc_callback)
    if cprofile:
        import cProfile
        import io
        import pstats

        pr = cProfile.Profile()
        steps0 = eng.num_steps
        pr.enable()
        llm.generate([{"prompt_token_ids": x} for x in ids], sp)
        pr.disable()
        text = io.StringIO()
        pstats.Stats(pr, stream=text).sort_stats("tottime").print_stats(cprofile)
        print(f"cProfile, speculation {'on' if draft else 'off'}, {eng.num_steps - steps0} steps "
              "(tottime: seconds in the function itself):")
        print("\n".join(line for line in text.getvalue().splitlines() if line.strip())[-6000:])
    p = best["us_per_step"]
    p["wall"] = best["wall_s"] / best["steps"] * 1e6
    p["execute"] = p.get("execute", 0) + p.pop("collect", 0)
    p["results"] = p.get("execute", 0) - sum(p.get(k, 0) for k in ("stage", "launch", "wait", "layout", "choose"))
    p["step_other"] = p["step"] - p.get("execute", 0) - sum(p.get(k, 0) for k in ("schedule", "update", "detokenize",
                                                                                  "outputs"))
    p["generate_other"] = p["wall"] - p["step"]
    del llm, eng, runner
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return best


def set_sync(mode: str) -> None:
    """The CUDA runtime's wait for the device (spin, yield or block on a sync), set before its first use."""
    import ctypes
    import glob
    import os

    flags = {"auto": 0, "spin": 1, "yield": 2, "block": 4}[mode]
    libs = glob.glob(os.path.join(os.path.dirname(torch.__file__), "..", "nvidia", "cu*", "lib", "libcudart.so*"))
    for name in libs + ["libcudart.so.13", "libcudart.so.12", "libcudart.so"]:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        # the primary context's flags: the driver's, whichever copy of the runtime sets them
        print(f"cudaSetDeviceFlags({mode}) through {name} -> {lib.cudaSetDeviceFlags(flags)}")
        return
    print("no CUDA runtime library found; --sync ignored")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft", default=None, help="EAGLE-3 head folder (default: the shipped head)")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--batch", type=int, default=1,
                    help="rows a step (max_num_seqs); the prompts are repeated to at least this many")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--cprofile", type=int, default=0, help="print cProfile's N costliest functions")
    ap.add_argument("--forced-acceptance", type=float, default=None,
                    help="forced acceptance length (random heads; runs ignore end of sequence)")
    ap.add_argument("--only", choices=["off", "on", "zero"], default=None, help="run one engine only (one per process)")
    ap.add_argument("--sync", choices=["auto", "spin", "yield", "block"], default=None,
                    help="how the host waits for the device (cudaSetDeviceFlags, before CUDA starts)")
    ap.add_argument("--events", action="store_true",
                    help="also time each replay on the device with CUDA events (adds ~2 records per step)")
    ap.add_argument("--zero-drafts", action="store_true",
                    help="a third engine, speculating with the adaptive draft length held at D = 0: what a step "
                         "that drafts nothing costs the engine's loop over a plain one")
    ap.add_argument("--disable-async-output-proc", action="store_true",
                    help="detokenize and report each step before launching the next")
    a = ap.parse_args()
    if a.sync:
        set_sync(a.sync)
    from specserve.heads import default_speculative_config

    draft = a.draft or default_speculative_config("eagle3", 4)["draft_model"]
    n = max(a.num_prompts, a.batch)
    prompts = (DEFAULT_PROMPTS * (n // len(DEFAULT_PROMPTS) + 1))[:n]
    out = {}
    engines = [("off", None, False), ("on", draft, False)] + ([("zero", draft, True)] if a.zero_drafts else [])
    for name, d, zero in engines:
        if a.only and name != a.only:
            continue
        out[name] = run(a.model, d, prompts, a.max_tokens, a.repeats, a.cprofile, a.forced_acceptance, a.events,
                        False if a.disable_async_output_proc else None, zero, a.batch)
    keys = ["wall", "gpu", "gpu_median", "step", "schedule", "layout", "stage", "reserve", "upload", "launch", "wait",
            "choose", "results", "update", "detokenize", "outputs", "step_other", "generate_other"]
    print(f"{'us per step':<16}" + "".join(f"{k:>10}" for k in out))
    for k in keys:
        print(f"{k:<16}" + "".join(f"{r['us_per_step'].get(k, 0):>10.1f}" for r in out.values()))
    for name, r in out.items():
        print(f"{name}: {r['steps']} steps, {r['tokens']} tokens, {r['wall_s']:.3f} s, "
              f"gc {r['gc_count']} collections {r['gc_ms']:.1f} ms")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(date=time.strftime("%Y-%m-%d %H:%M"), torch=torch.__version__, runs=out), f, indent=1)


if __name__ == "__main__":
    main()
