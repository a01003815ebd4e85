#!/usr/bin/env bash
# Run 10 of the shipped EAGLE-3 head (specserve/heads/smollm2-135m-eagle3/TRAINING.md) on the GPU machine, model
# at /root/model.gguf: run 9's head fine-tuned on the target's answers to Python function stubs in HumanEval's
# shape (signature + docstring, from benchmarks/python_stubs.py, carried in .traindata; HumanEval itself stays
# held out), on fresh opener-begun task instructions (as runs 8-9) and on the 2,118 GPTeacher responses.
#   bash benchmarks/gpu_train_code.sh regen BUDGET   # both regenerations, then train until BUDGET s into the call
#   TIME_LIMIT=S bash benchmarks/gpu_train_code.sh train STOP   # resume; reaching S seconds exports + evaluates
# CODE_COUNT stubs (default 16000) and COUNT synthesized instructions (default 12000) are answered. A call's
# training stops STOP s (plus gpu_train_all.sh's 150 s margin) into the call; keep STOP so that the call, export
# and evaluation included, ends inside the device's 600 s a call.
set -uo pipefail
mode=${1:?regen|train}; arg=${2:?seconds}
export NAME=${NAME:-syn6} SEED=${SEED:-3100000} EXTRA_DATA=${EXTRA_DATA:-/root/regen-code/data.pt}
if [ "$mode" = regen ]; then
  NOFILES=1 OUT=/tmp/regen-out REGEN_LIMIT=${CODE_LIMIT:-240} bash benchmarks/gpu_train_all.sh regen code \
    --prompts .traindata/python-stubs.jsonl.gz --holdout 0 --max-prompts "${CODE_COUNT:-16000}" \
    --gen-seed 3000000 --gen-workers 8 --gen-max-tokens 256
  [ -f /root/regen-code/data.pt ] || { echo "no /root/regen-code/data.pt" >&2; exit 1; }
  echo "code regeneration done at ${SECONDS} s"
  COUNT=${COUNT:-12000} REGEN_LIMIT=${REGEN_LIMIT:-200} bash benchmarks/gpu_train_openers.sh regenonly 0 || exit 1
  echo "opener regeneration done at ${SECONDS} s"
  arg=$((arg - SECONDS - 60)); [ "$arg" -lt 30 ] && { echo "no time left to train in this call"; exit 0; }
  mode=train
fi
for f in $EXTRA_DATA; do [ -f "$f" ] || { echo "no $f: run the regen mode first (on this machine)" >&2; exit 1; }; done
echo "training for $arg s in this call"
TIME_LIMIT=${TIME_LIMIT:-600} bash benchmarks/gpu_train_openers.sh train "$arg"
