#!/usr/bin/env bash
# Runs on the GPU machine (see docs/BENCHMARKS.md): GPU tests, then the benchmarks named by $BENCH.
# usage: bash benchmarks/gpu_run.sh /root/model.gguf [generate] [spec_step]
set -uo pipefail
MODEL=${1:?model gguf}
shift
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp}
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
SPECSERVE_TEST_GGUF=$MODEL python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider 2>&1 | tail -15
for b in "$@"; do
  case $b in
    generate) python3 benchmarks/bench_generate.py --model "$MODEL" --batch 1 16 --max-tokens 128 --repeats 3 \
                --compare-hf --json "$OUT/bench_gpu.json" 2>&1 | grep -v -e Converting -e "Loading weights" ;;
    spec_step) python3 benchmarks/bench_spec_step.py --model "$MODEL" --batch 1 16 --draft-len 1 2 3 4 5 6 \
                --steps 40 --json "$OUT/spec_step_gpu.json" 2>&1 | tail -16 ;;
  esac
done
