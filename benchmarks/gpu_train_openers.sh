#!/usr/bin/env bash
# Fine-tunes the shipped EAGLE-3 head (specserve/heads/smollm2-135m-eagle3/TRAINING.md, runs 8 and 9) on the
# GPU machine, model at /root/model.gguf, on task instructions the target writes itself:
#   bash benchmarks/gpu_train_openers.sh regen STOP   # new opener-begun task data, then train for STOP seconds
#   bash benchmarks/gpu_train_openers.sh regenonly 0  # the new data only
#   bash benchmarks/gpu_train_openers.sh train STOP   # resume; the call that reaches TIME_LIMIT exports + evaluates
# The data: responses to COUNT task instructions (seed SEED), message i begun with opener i mod 80, written to
# /root/regen-NAME, plus 2,118 greedy responses to GPTeacher training prompts (a regeneration kept in
# benchmarks/results, which also carries the held-out split). It fine-tunes the head in INIT (default: the
# shipped one). Run 8: NAME=syn4 COUNT=56000 SEED=1300000 TIME_LIMIT=520, from run 7's head (commit 5f30669);
# run 9: NAME=syn5 COUNT=60000 SEED=2000000 TIME_LIMIT=600 REGEN_LIMIT=320 (regen 180, then train 440),
# from run 8's. EXTRA_DATA names more data.pt files to train on (run 10: gpu_train_code.sh).
set -uo pipefail
mode=${1:?regen|train}; stop=${2:?seconds of training in this call}
name=${NAME:-syn4}
openers=(Write Explain Describe Summarize Rewrite Classify Translate Generate List Give Suggest Create Compose
  Identify Find Convert Compare Edit Correct "Tell me" What How Why Provide Name Brainstorm Solve Calculate Extract
  Answer Paraphrase Design Plan Recommend Choose Make Given Is "Can you" "Come up with"
  "Write a Python function" "Write a program" Implement Fix Debug Sort Analyze Determine Evaluate Outline Draft
  Predict Categorize Rank Estimate Select Construct Count Transform Format Define Rephrase Simplify Expand Shorten
  Continue "Fill in" Imagine "Pretend you are" "You are" Please "I need" "Help me" "Here is" "Read the"
  "Based on" Using Which Who "Write a short")
if [ "$mode" = regen ] || [ "$mode" = regenonly ]; then
  NOFILES=1 OUT=/tmp/regen-out REGEN_LIMIT=${REGEN_LIMIT:-330} bash benchmarks/gpu_train_all.sh regen "$name" \
    --synthetic-prompts "${COUNT:-56000}" --gen-seed "${SEED:-1300000}" --gen-workers 8 --gen-max-tokens 256 \
    --synthetic-openers "${openers[@]}"
fi
[ -f "/root/regen-$name/data.pt" ] || { echo "no /root/regen-$name/data.pt" >&2; exit 1; }
[ "$mode" = regenonly ] && exit 0
METHODS=eagle3 INIT_eagle3=${INIT:-specserve/heads/smollm2-135m-eagle3} TRAIN_LIMIT=$((stop + 150)) \
  DATA="benchmarks/results/gpu-2026-12-02b/call6/data.pt /root/regen-$name/data.pt ${EXTRA_DATA:-}" \
  bash benchmarks/gpu_train_all.sh train --steps 40000 --batch-size 32 --max-seq-len 640 --lr 4e-4 --warmup 50 \
  --time-limit ${TIME_LIMIT:-1000} --stop-after "$stop" --target-dtype bfloat16 --eval-max-prompts 0 \
  --eval-max-tokens 256
