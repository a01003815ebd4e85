"""Pick launch settings on the GPU machine from measurements made in the same call, for the stages after it
(``gpu_bench.sh tune`` writes the exports to a file that later stages source). Two choices:

* the one-row output layer's launch for int8 drafts (``bench_lm_head.py``): the sweep's best, if at least 3%
  faster than the engine's launch;
* K split in two loads or whole (``SPECSERVE_GEMV_SPLITK``): split if the whole speculative step's replay is
  at least 1% shorter with it (random SmolLM2-shaped weights, ``specserve bench --steps 1``, one process
  each), else whole. (The tenth session chose 32 features / 4 warps and the split; both are now defaults.)

    python benchmarks/gpu_tune.py LM_HEAD_JSON STEPS_SPLIT0_JSON STEPS_SPLIT1_JSON > choice.env
"""

import json
import sys


def main() -> None:
    lm, s0, s1 = (json.load(open(p)) for p in sys.argv[1:4])
    out = []
    table = lm.get("int8_folded") or lm["int8"]  # the folded kernel's sweep (bench_lm_head.py since 2026-12-03)
    sweep = table["sweep"]
    default = sweep.get(lm["default"]["int8"])
    best = table["best"]
    if default and sweep[best] <= 0.97 * default:
        bn, w = best[2:].split("/w")
        out.append(f"export SPECSERVE_GEMV_LM_LAUNCH={bn},{w}")
    a, b = s0["steps"][0], s1["steps"][0]
    print(f"# int8 output layer: default {default} µs, best {best} {sweep[best]} µs; speculative step "
          f"{a['spec_step_ms']:.3f} ms (K whole) / {b['spec_step_ms']:.3f} ms (K split); decode "
          f"{a['decode_ms']:.3f} / {b['decode_ms']:.3f} ms")
    out.append(f"export SPECSERVE_GEMV_SPLITK={int(b['spec_step_ms'] <= 0.99 * a['spec_step_ms'])}")
    print("\n".join(out))


if __name__ == "__main__":
    main()
