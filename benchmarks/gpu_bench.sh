#!/usr/bin/env bash
# Issue #5 on the GPU machine in one call (model at /root/model.gguf): GPU tests, then `specserve bench` on the
# default model (side by side with transformers), throughput over batch sizes, and the Llama-3.1-8B-shaped
# random model with step timings. Every stage has its own time limit; results land in $OUT/<stage>/.
#   bash benchmarks/gpu_bench.sh [tests] [tests-quick] [kernels] [default] [throughput] [scale] [scale1]
#                                [attention] [sweep] [spec16] [hf4] [hfc] [profile] [host] [cprofile] [humaneval]
#                                [gemv] [gemvsteps] [upload] [uploadr] [graphtests] [gputests] [gemvkernels] [diag]
#                                [host2] [programs] [int8] [lmhead] [tune] [gemvab] [ab] [bars] [scaleall] [attnbench]
#                                [rows] [hewhole]
# Stage limits (s): tests 420 (the kernel checks compile ~100 signatures of the few-row linears alone);
# tests-quick 240 (the step-input kernels and the engine-level GPU tests); the twentieth session's 520 s ran out
# after 31 tests of `tests`, so give each of kernels, graphtests (~250 s: 15 tests in 215 s) and gputests (test_gpu.py
# and the PDL token test; TEST_S, default 200) a call of its own;
# default 580 (transformers eager alone, 16 prompts x ~200 tokens x 4 runs at ~45 tok/s, needs ~300 s: give
# it a call of its own; 200 s killed it once before it printed); throughput 120; scale 300 (batches 8-64;
# with batch 1 it ran out of 200 s and 300 s: 64 prompts at batch 1 take that long); scale1 SCALE_S, default 200
# (batch 1 only, 8 prompts, its whole log in $OUT/scale1.log; about 100 s); attention 230;
# spec16 180; hf4 200; profile 150; kernels 300; sweep 240; host 150; cprofile 150; humaneval 150 (needs
# .traindata carried); gemv 150 and gemvsteps 2 x 120 (no model file needed: random weights); upload 2 x 150; uploadr (random weights) 2 x 100;
# graphtests 120 (random tiny models); gemvkernels 420 (the few-row kernels' GPU checks, nine tests: 300 s ran out after five with a cold compile cache; the whole output in $OUT/gemvkernels.txt);
# humaneval writes humaneval-<head folder name> (ROUNDS=N: the engines alternately N times, 40 + 100 N s);
# hfc 300; diag (random weights: host profile with device events, graph-replay kernel profiles) ~200;
# host2 (random weights: host profiles one engine per process, waits spinning / blocking, cProfile) ~250;
# programs (random weights, SPECSERVE_GEMV_PROGRAMS 0 then 1024, with step replays) 2 x 100;
# int8 (random weights, SPECSERVE_DRAFT_INT8 0 then 1, with step replays) 2 x 100;
# tune (~310: the int8 output layer's launch sweep and K split or whole, chosen for later stages and calls on
# the machine through /root/choice.env); gemvab (bench_gemv.py with the weights loaded after / before the
# prologue) 2 x 100; ab (random weights, step replays; each of AB_VARS, default SPECSERVE_GEMV_WFIRST
# SPECSERVE_QKV_ROPE, set to each of AB_VALS, default 0 then 1, the others at their defaults) 2 x 100 per variable; lmhead (a draft step's output layer: int8 launch sweep over the whole vocabulary and 32,768 rows, and the speculative step's graph profile) ~200.
# bars (~320 s: transformers eager, 8 prompts x 256 tokens x 4 runs at ~45 tok/s, is most of it): every batch-1
# bar side by side in one run, every engine generating exactly 256 tokens; scaleall (~150 s): the 8B shapes at
# batches 1, 8, 32 and 64 with step replays; attnbench (~150 s): bench_attention.py alone.
# sets (~2 x 150 s, .traindata carried): batch 1, EAGLE-3 against no speculation on every HumanEval prompt (164)
# and every Alpaca seed task (175), REPEATS (default 2) timed runs each.
# rows (~100 s, no model file): bench_rows.py, the several-row kernel's forms and launches against one program per
# row and cuBLAS; hewhole (40 + 110 x ROUNDS s, default 2 rounds, .traindata carried): every HumanEval prompt at
# batch 1, EAGLE-3 against no speculation, the engines alternating. host (~150 s): profile_host.py on the default
# model and HEAD; HOST_ARGS=--events adds each step's replay's device time to set its wall time against.
# Give the device call at least the sum of the stages it runs (one call was killed for less), and do not
# pipe the whole script through `tail`: a killed call then returns no output at all.
source "$(dirname "$0")/gpu_env.sh"
# GPU tests with a time limit, one line per test as it ends (a killed run still shows what passed before)
vtest() { local limit=$1; shift; timeout $limit python3 -m pytest -v --tb=short -m gpu -p no:cacheprovider "$@" 2>&1 \
          | grep --line-buffered -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|^E "; }
# launch settings chosen by an earlier `tune` stage on this machine (benchmarks/gpu_tune.py), if any
[ -f /root/choice.env ] && { echo "settings from tune: $(grep -v '^#' /root/choice.env | tr '\n' ' ')"; source /root/choice.env; }
M=/root/model.gguf
HEAD=${HEAD:-specserve/heads/smollm2-135m-eagle3}  # HEAD=DIR: a head not yet in the package
stages=${*:-tests default throughput scale}
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader
for st in $stages; do
  echo "===== $st $(date +%T)"
  case $st in
    tests) SPECSERVE_TEST_GGUF=$M vtest 420 tests/test_kernels.py tests/test_cuda_graph.py tests/test_gpu.py ;;
    tests-quick) vtest 60 tests/test_kernels.py -k "draft_inputs or step_inputs"
             SPECSERVE_TEST_GGUF=$M vtest 180 tests/test_cuda_graph.py tests/test_gpu.py ;;
    kernels) vtest 300 tests/test_kernels.py ;;
    gputests) SPECSERVE_TEST_GGUF=$M vtest ${TEST_S:-200} tests/test_gpu.py \
             tests/test_cuda_graph.py::test_pdl_launches_give_the_tokens_of_ordinary_ones ;;
    host) timeout 150 python3 benchmarks/profile_host.py --model $M --draft $HEAD ${HOST_ARGS:-} --json $OUT/host.json 2>&1 \
          | quiet | tail -22 ;;
    cprofile) timeout 150 python3 benchmarks/profile_host.py --model $M --draft $HEAD --repeats 1 --num-prompts 4 \
             --cprofile 30 --json $OUT/host-cprofile.json 2>&1 | quiet | tail -100 ;;
    sweep) timeout 240 python3 benchmarks/bench_attention.py --sweep --json $OUT/sweep.json 2>&1 | grep -v Warning | tail -16 ;;
    default) timeout 580 python3 -m specserve.cli bench --model $M --draft $HEAD --draft-len 4 --batch-size 1 \
             --max-tokens 256 --num-prompts 16 --repeats 3 --compare hf hf-compile --out $OUT/default 2>&1 | quiet | tail -22 ;;
    throughput) timeout 120 python3 -m specserve.cli bench --model $M --draft $HEAD --draft-len 4 \
             --batch-size 1 8 32 64 --max-tokens 256 --num-prompts 16 --repeats 3 --out $OUT/throughput 2>&1 | quiet | tail -16 ;;
    attention) SPECSERVE_TEST_GGUF=$M timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels.py \
               -k check_attention 2>&1 | tail -5
             timeout 200 python3 benchmarks/bench_attention.py --json $OUT/attention.json 2>&1 | grep -v Warning | tail -20 ;;
    attnbench) timeout 200 python3 benchmarks/bench_attention.py --json $OUT/attention.json 2>&1 | grep -v Warning | tail -20 ;;
    spec16) timeout 180 python3 -m specserve.cli bench --model $M --draft $HEAD --draft-len 4 --batch-size 1 \
             --max-tokens 256 --num-prompts 16 --repeats 3 --steps 1 --out $OUT/spec16 2>&1 | quiet | tail -22 ;;
    humaneval) timeout $((40 + 100 * ${ROUNDS:-1})) python3 -m specserve.cli bench --model $M --draft $HEAD --draft-len 4 \
             --batch-size 1 --prompts .traindata/HumanEval.jsonl.gz --max-tokens 256 --num-prompts 16 --repeats 3 \
             --rounds ${ROUNDS:-1} \
             --out $OUT/humaneval-$(basename $HEAD) 2>&1 | quiet | tail -12 ;;
    sets) for f in HumanEval.jsonl.gz alpaca-seed-tasks.jsonl; do echo "--- $f (every prompt)"
             timeout 280 python3 -m specserve.cli bench --model $M --draft $HEAD --draft-len 4 --batch-size 1 \
             --prompts .traindata/$f --max-tokens 256 --num-prompts 100000 --repeats ${REPEATS:-2} \
             --out $OUT/sets-${f%%.*} 2>&1 | quiet | tail -12; done ;;
    hfc) timeout 300 python3 -m specserve.cli bench --model $M --draft $HEAD --draft-len 4 --batch-size 1 \
             --max-tokens 256 --num-prompts 16 --repeats 3 --compare hf-compile --out $OUT/hfc 2>&1 | quiet | tail -16 ;;
    hf4) timeout 200 python3 -m specserve.cli bench --model $M --draft $HEAD --draft-len 4 --batch-size 1 \
             --max-tokens 256 --num-prompts 4 --repeats 2 --compare hf hf-compile --out $OUT/hf4 2>&1 | quiet | tail -16 ;;
    profile) mkdir -p $OUT/profile
             timeout 90 python3 benchmarks/profile_step.py --model random:llama-3.1-8b --draft random \
               --forced-acceptance ${FORCED:-1.64} --context 512 --kv-cache-memory 24000000000 \
               --json $OUT/profile/scale-spec.json 2>&1 | quiet | tail -28
             timeout 60 python3 benchmarks/profile_step.py --model $M --draft $HEAD --context 512 \
               --json $OUT/profile/default-spec.json 2>&1 | quiet | tail -16 ;;
    gemv) timeout 150 python3 benchmarks/bench_gemv.py --json $OUT/gemv.json 2>&1 | grep -v Warning | tail -16 ;;
    rows) timeout 200 python3 benchmarks/bench_rows.py --json $OUT/rows.json 2>&1 | grep -v Warning ;;
    hewhole) timeout $((40 + 110 * ${ROUNDS:-2})) python3 -m specserve.cli bench --model $M --draft $HEAD --draft-len 4 \
             --batch-size 1 --prompts .traindata/HumanEval.jsonl.gz --max-tokens 256 --num-prompts 100000 --repeats 1 \
             --rounds ${ROUNDS:-2} --out $OUT/hewhole 2>&1 | quiet | tail -12 ;;
    gemvkernels) timeout 420 python3 -m pytest -q --tb=short -m gpu -p no:cacheprovider tests/test_kernels.py \
             -k "check_gemv or check_qkv_rope or check_argmax" > $OUT/gemvkernels.txt 2>&1; tail -c 2500 $OUT/gemvkernels.txt ;;
    gemvab) for w in 0 1; do echo "--- SPECSERVE_GEMV_WFIRST=$w"
             SPECSERVE_GEMV_WFIRST=$w timeout 100 python3 benchmarks/bench_gemv.py --json $OUT/gemv-wfirst-$w.json 2>&1 \
             | grep -v Warning | tail -12; done ;;
    ab) for var in ${AB_VARS:-SPECSERVE_GEMV_WFIRST SPECSERVE_QKV_ROPE}; do for v in ${AB_VALS:-0 1}; do echo "--- $var=$v"
             env $var=$v timeout 100 python3 -m specserve.cli bench --model random:smollm2-135m --draft random \
             --draft-len 4 --forced-acceptance ${FORCED:-2.58} --ignore-eos --random-input-len 256 --batch-size 1 \
             --max-tokens 128 --num-prompts 4 --repeats 2 --steps 1 --out $OUT/ab-$var-$v 2>&1 | quiet | tail -10; done; done ;;
    gemvsteps) for g in 0 1; do echo "--- SPECSERVE_GEMV=$g"
             SPECSERVE_GEMV=$g timeout 120 python3 -m specserve.cli bench --model random:smollm2-135m --draft random \
             --draft-len 4 --forced-acceptance ${FORCED:-1.55} --ignore-eos --random-input-len 256 --batch-size 1 \
             --max-tokens 128 --num-prompts 4 --repeats 2 --steps 1 --out $OUT/gemvsteps-$g 2>&1 | quiet | tail -12; done ;;
    upload) for u in 0 1; do echo "--- SPECSERVE_GRAPH_UPLOAD=$u"
             SPECSERVE_GRAPH_UPLOAD=$u timeout 150 python3 -m specserve.cli bench --model $M --draft $HEAD --draft-len 4 \
             --batch-size 1 --max-tokens 256 --num-prompts 16 --repeats 3 --out $OUT/upload-$u 2>&1 | quiet | tail -9; done ;;
    uploadr) for u in 0 1; do echo "--- SPECSERVE_GRAPH_UPLOAD=$u (random SmolLM2-shaped weights)"
             SPECSERVE_GRAPH_UPLOAD=$u timeout 100 python3 -m specserve.cli bench --model random:smollm2-135m --draft random \
             --draft-len 4 --forced-acceptance ${FORCED:-2.58} --ignore-eos --random-input-len 256 --batch-size 1 \
             --max-tokens 256 --num-prompts 8 --repeats 3 --out $OUT/uploadr-$u 2>&1 | quiet | tail -9; done ;;
    diag) timeout 150 python3 benchmarks/profile_host.py --model random:smollm2-135m --draft random \
             --forced-acceptance ${FORCED:-2.58} --num-prompts 8 --repeats 3 --events --json $OUT/host-random.json 2>&1 | quiet | tail -22
           for s in "--forced-acceptance ${FORCED:-2.58} --draft random" --no-spec; do
             timeout 90 python3 benchmarks/profile_step.py --model random:smollm2-135m $s --graphs --context 256 --top 45 \
             2>&1 | quiet | tail -48; done ;;
    host2) for o in "off" "on" "on --sync spin" "on --sync block" "off --sync spin"; do echo "--- $o"
             timeout 60 python3 benchmarks/profile_host.py --model random:smollm2-135m --draft random \
             --forced-acceptance ${FORCED:-2.58} --num-prompts 8 --repeats 3 --events --only $o 2>&1 | quiet | tail -20; done
           timeout 100 python3 benchmarks/profile_host.py --model random:smollm2-135m --draft random \
             --forced-acceptance ${FORCED:-2.58} --num-prompts 4 --repeats 1 --cprofile 40 2>&1 | quiet | tail -130 ;;
    programs) for p in 0 1024; do echo "--- SPECSERVE_GEMV_PROGRAMS=$p"
             SPECSERVE_GEMV_PROGRAMS=$p timeout 100 python3 -m specserve.cli bench --model random:smollm2-135m --draft random \
             --draft-len 4 --forced-acceptance ${FORCED:-2.58} --ignore-eos --random-input-len 256 --batch-size 1 \
             --max-tokens 128 --num-prompts 4 --repeats 2 --steps 1 --out $OUT/programs-$p 2>&1 | quiet | tail -10; done ;;
    int8) for q in 0 1; do echo "--- SPECSERVE_DRAFT_INT8=$q"
             SPECSERVE_DRAFT_INT8=$q timeout 100 python3 -m specserve.cli bench --model random:smollm2-135m --draft random \
             --draft-len 4 --forced-acceptance ${FORCED:-2.58} --ignore-eos --random-input-len 256 --batch-size 1 \
             --max-tokens 128 --num-prompts 4 --repeats 2 --steps 1 --out $OUT/int8-$q 2>&1 | quiet | tail -10; done ;;
    lmhead) timeout 240 python3 benchmarks/bench_lm_head.py --json $OUT/lm_head.json 2>&1 | grep -v Warning | tail -8
           timeout 90 python3 benchmarks/profile_step.py --model random:smollm2-135m --draft random --forced-acceptance \
             ${FORCED:-2.58} --graphs --context 256 --top 45 2>&1 | quiet | tail -48 ;;
    tune) timeout 160 python3 benchmarks/bench_lm_head.py --json $OUT/lm_head.json 2>&1 | grep -v Warning | tail -5
          for k in 0 1; do echo "--- SPECSERVE_GEMV_SPLITK=$k"
             SPECSERVE_GEMV_SPLITK=$k timeout 100 python3 -m specserve.cli bench --model random:smollm2-135m --draft random \
             --draft-len 4 --forced-acceptance ${FORCED:-2.58} --ignore-eos --random-input-len 256 --batch-size 1 \
             --max-tokens 128 --num-prompts 4 --repeats 2 --steps 1 --out $OUT/splitk-$k 2>&1 | quiet | tail -10; done
          python3 benchmarks/gpu_tune.py $OUT/lm_head.json $OUT/splitk-0/bench.json $OUT/splitk-1/bench.json \
            | tee /root/choice.env ;;
    graphtests) SPECSERVE_TEST_GGUF=$M vtest ${TEST_S:-240} tests/test_cuda_graph.py ;;
    scale1) timeout ${SCALE_S:-200} python3 -m specserve.cli bench --model random:llama-3.1-8b --draft random \
             --draft-len 4 --forced-acceptance ${FORCED:-1.64} --ignore-eos --random-input-len 512 --batch-size 1 \
             --max-tokens 128 --num-prompts 8 --repeats 2 --kv-cache-memory 24000000000 --steps 1 --out $OUT/scale1 2>&1 \
             | tee $OUT/scale1.log | quiet | tail -30 ;;
    bars) timeout 500 python3 -m specserve.cli bench --model $M --draft $HEAD --draft-len 4 --batch-size 1 \
             --max-tokens 256 --ignore-eos --num-prompts 8 --repeats 3 --compare hf hf-compile --out $OUT/bars 2>&1 \
             | quiet | tail -22 ;;
    scaleall) timeout 300 python3 -m specserve.cli bench --model random:llama-3.1-8b --draft random --draft-len 4 \
             --forced-acceptance ${FORCED:-1.60} --ignore-eos --random-input-len 512 --batch-size 1 8 32 64 \
             --max-tokens 128 --num-prompts 8 --repeats 3 --kv-cache-memory 24000000000 --steps 1 \
             --out $OUT/scaleall 2>&1 | quiet | tail -30 ;;
    scale) timeout 300 python3 -m specserve.cli bench --model random:llama-3.1-8b --draft random --draft-len 4 \
             --forced-acceptance ${FORCED:-1.64} --ignore-eos --random-input-len 512 --batch-size 8 32 64 --max-tokens 128 \
             --repeats 3 --kv-cache-memory 24000000000 --steps 1 --out $OUT/scale 2>&1 | quiet | tail -30 ;;
  esac
done
echo "===== done $(date +%T)"
