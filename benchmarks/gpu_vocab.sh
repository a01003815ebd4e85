#!/usr/bin/env bash
# The shipped EAGLE-3 head restricted to a draft vocabulary of the target's lm_head rows, on the GPU machine
# (model at /root/model.gguf, prompt files carried in .traindata): regenerate the target's responses to
# 2,118 training prompts (the first 706 of the shuffled prompt files stay held out, as for the shipped head),
# then export and evaluate the head over the N most frequent tokens of those responses for each N in VOCABS.
#   OUT=... VOCABS="4096 8192 16384" bash benchmarks/gpu_vocab.sh
# Back in $OUT: data.pt (the regenerated responses: the heads are rebuilt from it anywhere with the same
# command and --steps 0) and report-<N>.json (acceptance on held-out, HumanEval and alpaca prompts).
source "$(dirname "$0")/gpu_env.sh"
D=.traindata
P="--prompts $D/gpteacher-codegen-instruct.json $D/gpteacher-roleplay-instruct.json $D/gpteacher-toolformer-instruct.json
   --eval-prompts $D/HumanEval.jsonl.gz $D/alpaca-seed-tasks.jsonl"
T=/root/model.gguf
H=specserve/heads/smollm2-135m-eagle3
W=/root/vocab
echo "===== regenerate $(date +%T)"
timeout 200 python3 -m specserve.cli train-draft --target $T --method eagle3 --out $W/regen $P --regenerate-only \
  --max-prompts 2824 --holdout 0.25 --gen-workers 4 --gen-max-tokens 256 2>&1 | quiet | tail -5
cp $W/regen/data.pt $OUT/
for n in ${VOCABS:-4096 8192 16384}; do
  echo "===== draft vocabulary $n $(date +%T)"
  timeout 200 python3 -m specserve.cli train-draft --target $T --method eagle3 --out $W/v$n $P --data $W/regen/data.pt \
    --init-from $H --draft-vocab $n --draft-vocab-shared --steps 0 2>&1 | quiet | tail -3
  cp $W/v$n/report.json $OUT/report-$n.json
  python3 -c "import json,sys; e=json.load(open(sys.argv[1]))['eval']
print({k: (round(v['acceptance_length'], 3), [round(p, 3) for p in v['per_position_acceptance']]) for k, v in e.items()})" \
    $W/v$n/report.json
done
python3 -c "import json; e=json.load(open('$H/report.json'))['eval']
print('shipped head (report.json):', {k: round(v['acceptance_length'], 3) for k, v in e.items()})"
echo "===== done $(date +%T)"
