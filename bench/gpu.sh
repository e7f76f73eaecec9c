#!/usr/bin/env bash
# CPU cores and a GPU in one farm: every GPU measurement in one go, in under 10 minutes.
#
#   bench/gpu.sh RESULTS_DIR [--stand-in] [bench/gpu.py options]
#   bench/gpu.sh --download          # here, with PyPI: fetch bench/gpu-wheels.txt's wheels
#
# On the GPU machine (no package registry) it first installs what farm lacks there from
# bench/wheels/, then runs bench/gpu.py with this repository on the path, stopped with
# SIGINT after $FARM_GPU_LIMIT seconds (565) if its own budget (--budget, 520) overruns.
# --stand-in runs the same measurements with a CPU worker in the GPU worker's place.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python3}
wheels=$root/bench/wheels

if [ "${1:-}" = "--download" ]; then
    platforms=()
    for tag in manylinux_2_28 manylinux_2_27 manylinux_2_26 manylinux_2_17 manylinux2014 \
               manylinux1; do
        platforms+=(--platform "${tag}_x86_64")
    done
    "$python" -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp "${platforms[@]}" -d "$wheels" -r "$root/bench/gpu-wheels.txt"
    exit 0
fi

out=${1:?usage: bench/gpu.sh RESULTS_DIR [--stand-in] [options], or bench/gpu.sh --download}
shift
mkdir -p "$out"
# shellcheck source=bench/gpu-env.sh
source "$root/bench/gpu-env.sh"
farm_gpu_env "$root" || exit 2
# a hard stop short of 10 minutes: SIGINT, on which bench/gpu.py writes what it has
limit=${FARM_GPU_LIMIT:-565}
: >"$out/log.txt"
timeout -s INT -k 30 "$limit" "$python" "$root/bench/gpu.py" "$out" "$@" >>"$out/log.txt" 2>&1 &
bench=$!
# the log followed until the bench is gone, not until every writer closes it: a farm
# process left behind in a session of its own, still holding the output, cannot keep
# this script (or whoever reads its output) waiting
tail -n +1 -f --pid="$bench" "$out/log.txt"
wait "$bench"
