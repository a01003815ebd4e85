# step replays (random SmolLM2-shaped weights) under each setting given as "VAR=V VAR=V"
source benchmarks/gpu_env.sh
for v in "$@"; do echo "--- $v"
  env $v timeout 60 python3 -m specserve.cli bench --model random:smollm2-135m --draft random --draft-len 4 \
    --forced-acceptance 2.58 --ignore-eos --random-input-len 256 --batch-size 1 --max-tokens 32 --num-prompts 1 \
    --repeats 1 --steps 1 2>&1 | grep -E "^\| (decode|verify|draft|whole)" ; done
