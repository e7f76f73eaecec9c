#!/usr/bin/env bash
# One prepared call on a lent GPU machine: a smoke test, then bench/gpu.py in the time left,
# every result packed into at most 8 files directly under the out folder.
#
#   bash bench/gpu-run.sh                          # there: the out folder is $OUT
#   bench/gpu-run.sh OUT [--stand-in] [--smoke-models M,...] [bench/gpu.py options]
#
# It ends within $FARM_GPU_RUN_LIMIT seconds (540) of its start:
#   1. installs the carried wheels as bench/gpu.sh does (bench/gpu-env.sh);
#   2. bench/gpu_smoke.py (at most $FARM_GPU_SMOKE seconds, 150): the machine, then for
#      each of --smoke-models (lenet, caffenet, googlenet) the GPU in f32, f16 and bf16,
#      auto's choice and a two-worker farm, into OUT/smoke.txt as each model is done;
#      the run stops there (exit 3) if the smoke says the bench would be pointless;
#   3. bench/gpu.py, big nets first, with --budget and its hard limit from the time left;
#      its log goes to a file: stdout shows a line per model and step, then the summary;
#   4. packs OUT: smoke.txt, report.md, log-tail.txt, results.tar.gz (the results folder,
#      the full logs, the smoke's JSON), also on SIGINT or SIGTERM. Exit status: the
#      bench's, but 4 where it reached its hard limit (124 would read as the call's own). report.md is copied
#      into OUT after each step of the bench, so a run killed outright keeps it.
# --stand-in: a CPU worker stands in for the GPU everywhere (a dry run, anywhere).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python3}
started=$(date +%s)
limit=${FARM_GPU_RUN_LIMIT:-540}
smoke_budget=${FARM_GPU_SMOKE:-150}
pack_margin=15 # seconds kept for packing at the end
grace=25       # seconds bench/gpu.py gets past its budget before SIGINT
max_bytes=$((16 * 1024 * 1024))

out=${OUT:-}
if [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; then
    out=$1
    shift
fi
[ -n "$out" ] || { echo "usage: bench/gpu-run.sh OUT [--stand-in] [options], or set \$OUT" >&2; exit 2; }
stand_in=() smoke_models=() bench_args=() budget=
while [ $# -gt 0 ]; do
    case $1 in
        --stand-in) stand_in=(--stand-in) ;;
        --smoke-models) smoke_models=(--models "$2"); shift ;;
        --budget) budget=$2; shift ;;
        *) bench_args+=("$1") ;;
    esac
    shift
done
mkdir -p "$out"
out=$(cd "$out" && pwd)
work=$(mktemp -d /tmp/farm-gpu-run.XXXXXX)
results=$work/results
mkdir -p "$results"
child=
# marks every process this run starts: a local farm's broker and workers run in sessions of
# their own, so a bench killed at its limit can leave them behind (a GPU worker holding the
# GPU); they are found by this mark and ended before packing
export FARM_GPU_RUN=${FARM_GPU_RUN:-gpu-run-$$-$started}

elapsed() { echo $(($(date +%s) - started)); }

say() { # a line to stdout and to the run's own log
    echo "[gpu-run $(elapsed) s] $*" | tee -a "$work/gpu-run.txt"
}

pack() { # every result into at most 8 files directly under $out
    [ -f "$results/report.md" ] && cp "$results/report.md" "$out/report.md"
    [ -f "$results/log.txt" ] && tail -n 200 "$results/log.txt" | cut -c1-400 >"$out/log-tail.txt"
    local files=(results gpu-run.txt) name
    for name in smoke.json smoke-log.txt; do
        [ -f "$work/$name" ] && files+=("$name")
    done
    tar -czf "$out/results.tar.gz" -C "$work" "${files[@]}"
    if [ "$(stat -c %s "$out/results.tar.gz")" -gt "$max_bytes" ]; then
        say "results.tar.gz is over 16 MiB: packed again without traces.jsonl"
        tar -czf "$out/results.tar.gz" -C "$work" --exclude traces.jsonl "${files[@]}"
    fi
}

reap() { # end the processes of this run still running, but this script
    local pid ended=0
    for pid in $(grep -lsz "^FARM_GPU_RUN=$FARM_GPU_RUN\$" /proc/[0-9]*/environ | cut -d/ -f3); do
        if [ "$pid" != $$ ] && kill -KILL "$pid" 2>/dev/null; then
            ended=$((ended + 1))
        fi
    done
    [ "$ended" -eq 0 ] || say "ended $ended process(es) this run left behind"
}

finish() { # pack, list what comes back, exit with $1
    trap '' INT TERM
    reap
    pack
    say "done with exit status $1; in $out:"
    (cd "$out" && ls -l --time-style=+ | tail -n +2 | awk '{print "  " $5 "  " $NF}')
    rm -rf "$work" # all of it is in results.tar.gz
    exit "$1"
}

on_signal() { # stop the step running (it writes what it has), then pack
    trap '' INT TERM
    say "stopped by SIG$1: packing what there is"
    if [ -n "$child" ]; then
        kill -INT "$child" 2>/dev/null
        (sleep 20 && kill -KILL "$child") >/dev/null 2>&1 &
        local watchdog=$!
        wait "$child" 2>/dev/null
        kill "$watchdog" 2>/dev/null
    fi
    finish 130
}
trap 'on_signal INT' INT
trap 'on_signal TERM' TERM

run() { # a step in the background, so that a signal reaches on_signal at once
    "$@" &
    child=$!
    wait "$child"
    local status=$?
    child=
    return $status
}

# 1. what farm needs
# shellcheck source=bench/gpu-env.sh
source "$root/bench/gpu-env.sh"
farm_gpu_env "$root" || { say "cannot install farm's wheels"; finish 2; }
say "farm's wheels in place; smoke test (at most $smoke_budget s)"

# 2. the smoke test, into $out/smoke.txt as it goes
: >"$out/smoke.txt"
run timeout -s INT -k 10 $((smoke_budget + 20)) "$python" "$root/bench/gpu_smoke.py" \
    "$out/smoke.txt" "$work/smoke.json" "${stand_in[@]}" "${smoke_models[@]}" \
    --budget "$smoke_budget" 2>"$work/smoke-log.txt"
smoke=$?
if [ "$smoke" -eq 3 ]; then
    say "the smoke test says the bench would be pointless: stopping"
    finish 3
elif [ "$smoke" -ne 0 ] && ! grep -qs '"worked": [1-9]' "$work/smoke.json"; then
    say "the smoke test ended with status $smoke before any GPU run worked: stopping"
    tail -n 5 "$work/smoke-log.txt" | cut -c1-300
    finish 3
elif [ "$smoke" -ne 0 ]; then
    say "the smoke test ended with status $smoke (a GPU run had worked): the bench goes on"
fi

# 3. the bench, in the time left
left=$((limit - $(elapsed) - pack_margin - grace))
if [ -n "$budget" ] && [ "${budget%.*}" -lt "$left" ]; then
    left=${budget%.*}
fi
if [ "$left" -lt 30 ]; then
    say "$left s left for the bench: not run"
    finish 0
fi
say "bench/gpu.py --budget $left (log in results.tar.gz, its tail in log-tail.txt)"
timeout -s INT -k 10 $((left + grace)) "$python" "$root/bench/gpu.py" "$results" \
    "${stand_in[@]}" --budget "$left" --copy-report "$out/report.md" "${bench_args[@]}" \
    >"$results/log.txt" 2>&1 &
bench=$!
# a line per model and step on stdout, from the log
tail -n +1 -F --pid "$bench" "$results/log.txt" 2>/dev/null |
    grep --line-buffered '^\[[0-9:]*\] -- ' &
child=$bench
wait "$bench"
status=$?
child=
wait
if [ -f "$results/report.md" ]; then
    # the summary and what was not measured, without the models' own tables
    awk '/^## /{show = ($0 == "## Summary" || $0 == "## Not measured")} /^# /{show = 1}
        show && !/^Waste: /' \
        "$results/report.md" | cut -c1-400 | head -c 4000
fi
if [ "$status" -eq 124 ]; then
    # not 124 itself: a lent machine reads a command's 124 as its own time limit reached
    say "bench/gpu.py reached its hard limit (timeout's status 124): what it measured is packed"
    finish 4
fi
say "bench/gpu.py ended with status $status"
finish "$status"
