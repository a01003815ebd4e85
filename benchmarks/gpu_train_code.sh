#!/usr/bin/env bash
# Run 10 of the shipped EAGLE-3 head (specserve/heads/smollm2-135m-eagle3/TRAINING.md) on the GPU machine, model
# at /root/model.gguf: run 9's head fine-tuned on the target's answers to Python function stubs in HumanEval's
# shape (signature + docstring, from benchmarks/python_stubs.py, carried in .traindata; HumanEval itself stays
# held out), on fresh opener-begun task instructions (as runs 8-9) and on the 2,118 GPTeacher responses. Run 11
# (not shipped): NAME=syn7 SEED=4100000 CODE_COUNT=32000 CODE_LIMIT=300 COUNT=6000 TIME_LIMIT=450, regen 560 then
# train 500, from run 10's head.
#   bash benchmarks/gpu_train_code.sh regen BUDGET   # both regenerations, then train for what is left of BUDGET
#                                                    # s into the call, less 60 s for saving the checkpoint
#   TIME_LIMIT=S bash benchmarks/gpu_train_code.sh train STOP   # resume for at most STOP s of training; the call
#                                                    # that completes S s of training in all exports + evaluates
# CODE_COUNT stubs (default 16000) and COUNT synthesized instructions (default 12000) are answered. The run is
# killed STOP + 150 s after it starts (gpu_train_openers.sh's TRAIN_LIMIT), loading, export and evaluation
# included: keep that inside the device's 600 s a call. EXTRA_DATA (default: the code data, /root/regen-code)
# names the data files trained on besides the instructions and GPTeacher responses; empty, none.
set -uo pipefail
mode=${1:?regen|train}; arg=${2:?seconds}
export NAME=${NAME:-syn6} SEED=${SEED:-3100000} EXTRA_DATA=${EXTRA_DATA-/root/regen-code/data.pt}
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
