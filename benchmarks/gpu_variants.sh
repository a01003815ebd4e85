# step replays (random SmolLM2-shaped weights, context CTX, default 512) under each setting given as
# "VAR=V VAR=V"; a setting that begins with @DIR runs the copy of the repository in DIR (another commit's code:
# "@.old", "@.old SPECSERVE_PDL=0"); each process gets VARIANT_S seconds (default 120: the first one on a fresh
# machine compiles every kernel, and 60 s cut it off once)
source benchmarks/gpu_env.sh
for v in "$@"; do echo "--- $v"
  dir=.; case $v in @*) dir=${v%% *}; dir=${dir#@}; v=${v#@$dir}; esac
  (cd "$dir" && env $v timeout ${VARIANT_S:-120} python3 -m specserve.cli bench --model random:smollm2-135m \
    --draft random --draft-len 4 --forced-acceptance 2.58 --ignore-eos --random-input-len 256 --batch-size 1 \
    --max-tokens 32 --num-prompts 1 --repeats 1 --steps 1 --steps-context ${CTX:-512} 2>&1 \
    | grep -E "^\| (decode|verify|draft|whole)") ; done
