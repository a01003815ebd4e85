#!/usr/bin/env bash
# Trains a draft head for the default model on the GPU machine (commands recorded in specserve/heads/*/TRAINING.md).
# usage: bash benchmarks/gpu_train.sh METHOD NAME [train-draft args...]   (model at /root/model.gguf)
set -uo pipefail
method=$1; name=$2; shift 2
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
timeout 560 python3 -m specserve.cli train-draft --target /root/model.gguf --method "$method" --out "/root/$name" \
  --prompts .traindata/gpteacher-codegen-instruct.json .traindata/gpteacher-roleplay-instruct.json \
            .traindata/gpteacher-toolformer-instruct.json \
  --eval-prompts .traindata/HumanEval.jsonl.gz .traindata/alpaca-seed-tasks.jsonl "$@" 2>&1 \
  | tr '\r' '\n' | grep -v -E "(it|step|req)/s\]$" | grep -v -E "^\s*$" | tail -40
mkdir -p "$OUT/$name"
cp /root/$name/head/* /root/$name/report.json /root/$name/*.png "$OUT/$name/" 2>/dev/null
ls -la "$OUT/$name"
