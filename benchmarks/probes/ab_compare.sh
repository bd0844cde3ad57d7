#!/usr/bin/env bash
# A/B on a GPU: fuser at an older commit (.bench/old) against this checkout (.), each in
# its own processes, interleaved. Make the old tree with
#   mkdir -p .bench/old && git archive 95b87c5 | tar -x -C .bench/old
# and put the anchor wheels (pytorch-optimizer for LAMB) under .whl/. Where the tree travels
# without its git state, write the commit to .bench/HEAD (`git rev-parse HEAD > .bench/HEAD`).
#
#   bash benchmarks/probes/ab_compare.sh PART...    (results under $OUT, default /tmp/out)
#     1: optim_bench llama1b small1000 lamb, old/new/old/new
#     2: loss_bench gist llama8b --no-compile, old/new
#     3: first_step (fuser-cold fuser-warm torch-fused, --repeats 2), old/new
#     4: pytest -m gpu on this checkout
set -uo pipefail
ROOT=$PWD
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python -m pip install -q --no-deps .whl/*.whl 2>&1 | tail -1
{ nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
  python -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)"
  echo "new: $(cat .bench/HEAD 2>/dev/null || git rev-parse HEAD)"; echo "old: 95b87c5"; } | tee "$OUT/versions.txt"
run() {  # name tree command...
  local name=$1 tree=$2; shift 2
  echo "=== $name $(date +%T)"
  (cd "$tree" && PYTHONPATH="$tree" FUSER_CACHE_DIR=/tmp/fc-$(basename "$tree") "$@") 2>&1 | tail -40
}
for part in "$@"; do
  case $part in
  1) for i in 1 2; do for t in old new; do
       tree=$ROOT; [ $t = old ] && tree=$ROOT/.bench/old
       run "optim $t $i" "$tree" python benchmarks/optim_bench.py llama1b small1000 lamb --out "$OUT" --tag "_ab_${t}$i"
     done; done ;;
  2) for t in old new; do
       tree=$ROOT; [ $t = old ] && tree=$ROOT/.bench/old
       run "loss $t" "$tree" python benchmarks/loss_bench.py gist llama8b --no-compile --out "$OUT" --tag "_ab_$t"
     done ;;
  3) for t in old new; do
       tree=$ROOT; [ $t = old ] && tree=$ROOT/.bench/old
       run "first_step $t" "$tree" python benchmarks/first_step.py --modes fuser-cold fuser-warm torch-fused --repeats 2 --out "$OUT/fs_$t"
     done ;;
  4) run "pytest gpu" "$ROOT" python -m pytest -q -m gpu tests/optim tests/cache tests/losses tests/test_cli.py -p no:cacheprovider 2>&1 | tail -30 ;;
  esac
done
echo "=== end $(date +%T)"
