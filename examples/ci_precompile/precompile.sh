#!/usr/bin/env bash
# Precompile a project's fuser kernels on a CPU-only CI runner (Triton ships ptxas, so no
# GPU or CUDA toolkit is needed) and leave the cache folder ready to publish.
#
#   FUSER_CACHE_DIR=out/fuser-cache examples/ci_precompile/precompile.sh
#
# The GPU job then points FUSER_CACHE_DIR at a copy of that folder: its processes load
# the binaries and compile nothing (fuser.stats()["compiles"] == 0).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
export FUSER_CACHE_DIR="${FUSER_CACHE_DIR:-$PWD/fuser-cache}"
PYTHON="${PYTHON:-python}"

# One entry per rule and kernel variant, one binary per GPU target. Add --target cuda:89
# and so on for other GPUs; keep the dtypes your parameters are stored in. The training
# code's keywords choose the kernels too, so PRECOMPILE_FLAGS adds what it uses:
#   bf16 parameters, fp32 main_grad      --dtype bf16:fp32
#   state_dtype=torch.bfloat16, "param"  --state-dtype bf16, --state-dtype param
#   stochastic_rounding=True             --stochastic-rounding (run once more for both)
# shellcheck disable=SC2206 # PRECOMPILE_FLAGS is a list of flags
flags=(--builtins --target cuda:80 --target cuda:90 --dtype fp32 --dtype bf16 ${PRECOMPILE_FLAGS:-})
"$PYTHON" -m fuser precompile "$here/my_rules.py" "${flags[@]}"

# A second run must be all hits: proof that the cache is complete and stable.
"$PYTHON" -m fuser precompile "$here/my_rules.py" "${flags[@]}" | tail -n 1

"$PYTHON" -m fuser cache ls
echo "cache ready in $FUSER_CACHE_DIR"
