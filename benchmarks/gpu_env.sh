# Sourced by the GPU machine scripts (gpu_bench.sh, gpu_vocab.sh): the carried wheels installed, the
# repository importable, $OUT, and `quiet`, a filter that drops finished progress bars and conversion chatter
# (a killed run keeps its last bar).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
quiet() { grep -v -e Converting -e "Loading weights" -e "it/s\]" -e "req/s\]" -e "100%|" ; }
