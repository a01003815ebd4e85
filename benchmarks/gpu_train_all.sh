#!/usr/bin/env bash
# Trains both shipped heads for the default model on the GPU machine (model at /root/model.gguf).
#   bash benchmarks/gpu_train_all.sh regen NAME [train-draft args...]  # responses -> /root/regen-NAME/data.pt
#   NOFILES=1 bash benchmarks/gpu_train_all.sh regen syn --synthetic-prompts 24000 --gen-workers 8
#     # prompts the target writes itself, without the prompt files (their held-out split stays in the other files)
#   [METHODS=eagle3] DATA="a.pt b.pt" bash benchmarks/gpu_train_all.sh train [train-draft args...]
#     # EAGLE-3 and MTP-Eagle (or METHODS only) side by side from the regenerated data files;
#     # INIT_eagle3=HEAD / INIT_mtp=HEAD fine-tune that method from an exported head (--init-from)
# Training longer than one call: pass --time-limit TOTAL --stop-after PER_CALL and repeat the same command
# on the warm machine; each call resumes the checkpoint and the last one exports and evaluates.
# SNAP names a copy of the package to run (so the run does not depend on the working tree of the moment).
set -uo pipefail
mode=$1; shift
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:${SNAP:-$PWD} PYTHONUNBUFFERED=1
py="python3 -P"  # -P: the package comes from PYTHONPATH (SNAP), not from the working directory
OUT=${OUT:-/tmp/out}
prompts=(--prompts .traindata/gpteacher-codegen-instruct.json .traindata/gpteacher-roleplay-instruct.json
         .traindata/gpteacher-toolformer-instruct.json
         --eval-prompts .traindata/HumanEval.jsonl.gz .traindata/alpaca-seed-tasks.jsonl)
[ -n "${NOFILES:-}" ] && prompts=("${prompts[@]:4}")  # --eval-prompts only
filter() { tr '\r' '\n' | grep -v -E "(it|step|req)/s\]$" | grep -v -E "^\s*$"; }
if [ "$mode" = regen ]; then
  case ${1:-} in ""|-*) echo "usage: gpu_train_all.sh regen NAME [train-draft args...]" >&2; exit 2 ;; esac
  name=$1; shift
  timeout ${REGEN_LIMIT:-580} $py -m specserve.cli train-draft --target /root/model.gguf --method eagle3 \
    --out /root/regen-$name "${prompts[@]}" --regenerate-only "$@" 2>&1 | filter | tail -5
  # in parts under 15 MB (a device call returns no larger file); locally: cat data.pt.part* > data.pt
  mkdir -p "$OUT/regen-$name" && split -b 15000000 -d /root/regen-$name/data.pt "$OUT/regen-$name/data.pt.part"
  exit 0
fi
for m in ${METHODS:-eagle3 mtp}; do
  touch /tmp/train-$m.log.start  # a head older than this call is not archived again
  init_var=INIT_$m; init=(); [ -n "${!init_var:-}" ] && init=(--init-from "${!init_var}")
  timeout ${TRAIN_LIMIT:-585} $py -m specserve.cli train-draft --target /root/model.gguf --method $m --out /root/$m \
    --data ${DATA:-$(ls /root/regen-*/data.pt)} "${prompts[@]}" "${init[@]}" "$@" > /tmp/train-$m.log 2>&1 &
done
wait
for m in ${METHODS:-eagle3 mtp}; do
  echo "== $m"; filter < /tmp/train-$m.log | tail -25
  # one archive per head: a device call returns at most 8 files (a run with loose files lost a head once)
  # (a run paused by --stop-after has no head yet: the next call resumes it from /root/$m/checkpoint.pt)
  [ /root/$m/head/model.safetensors -nt /tmp/train-$m.log.start ] && (cd /root/$m && tar -cf "$OUT/$m.tar" head $(ls report.json loss.png acceptance.png 2>/dev/null))
done
ls -la "$OUT"
