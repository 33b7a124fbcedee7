#!/usr/bin/env bash
# The GPU measurements of docs/gpu.md, in two parts that each fit a short lease of a GPU machine.
#
#   bash bench/gpu_suite.sh defaults OUTDIR   # the shipped defaults: mlp and wide, c=1 and 256;
#                                             # where the worker's time goes; pinned copies
#   bash bench/gpu_suite.sh settings OUTDIR   # the GPU settings tried at c=256: more caller
#                                             # processes, the model thread, workers per device
#   bash bench/gpu_suite.sh repeat OUTDIR     # the settings that met the targets, again
#   bash bench/gpu_suite.sh pending OUTDIR    # outputs returned pending (the examples' MLP and
#                                             # the wide model) against predict that waits
#   bash bench/gpu_suite.sh pending_ab OUTDIR # the same at the defaults, each pair both ways
#   bash bench/gpu_suite.sh recheck OUTDIR    # a later revision: both models at the defaults, and
#                                             # the MLP's GPU setting twice
#   bash bench/gpu_suite.sh auto OUTDIR       # --workers-per-device auto (the default): both
#                                             # models, then the MLP at 1 worker and auto again
#
# GPU=<index> picks the device (default 0); GPU=none runs the same on the CPU (a dry run of the
# script). DURATION (default 2) is the seconds of each measured window, three windows an arm.
# Each harness run writes OUTDIR/<name>/harness.json; everything it prints goes to stderr.
set -euo pipefail

part=${1:?defaults, settings, repeat, pending, pending_ab, recheck or auto}
out=${2:?an output folder}
gpu=${GPU:-0}
python=${PYTHON:-python3}
device=()
[ "$gpu" = none ] || device=(--cuda "$gpu")
common=(--no-alternatives --no-report --duration "${DURATION:-2}" --repeats 3 --warmup 1)

harness() {
    local name=$1
    shift
    echo "=== $name: python -m bench ${device[*]} $*" >&2
    "$python" -m bench "${device[@]}" "${common[@]}" --output-dir "$out/$name" "$@" ||
        echo "=== $name failed: exit $?" >&2
}

case $part in
defaults)
    harness defaults --models mlp,wide --concurrency 1,256 --scenarios direct,asyncio
    echo "=== model_share mlp" >&2
    "$python" -m bench.model_share --model mlp "${device[@]}" --concurrency 256 --duration 5 \
        >"$out/model_share_mlp.txt" || true
    if [ "$gpu" != none ]; then
        "$python" -m bench.gpu_check --transfers-only --output "$out/transfers.json" || true
    fi
    ;;
settings)
    at256=(--concurrency 256 --scenarios batched,asyncio)
    harness workers2 --models mlp,wide "${at256[@]}" --load-processes 4 --workers 2
    harness thread_on --models mlp,wide "${at256[@]}" --load-processes 4 --model-thread on
    harness callers4 --models mlp,wide "${at256[@]}" --load-processes 4
    harness workers3 --models mlp "${at256[@]}" --load-processes 6 --workers 3
    ;;
repeat)
    # the one setting that met both GPU targets in "settings", run again, and the wide model's
    # two-worker run once more
    at256=(--concurrency 256 --scenarios batched,asyncio)
    harness wide_workers3 --models wide "${at256[@]}" --load-processes 6 --workers 3
    harness mlp_workers3 --models mlp "${at256[@]}" --load-processes 6 --workers 3
    harness wide_workers2 --models wide "${at256[@]}" --load-processes 4 --workers 2
    ;;
pending)
    # the same weights, predict returning its outputs pending (mlp, wide) or waiting for them
    # (mlp_sync, wide_sync: as before pending outputs), one worker each, then with settings
    harness pending --models wide,wide_sync,mlp,mlp_sync --concurrency 1,256 \
        --scenarios batched,asyncio
    at256=(--concurrency 256 --scenarios batched,asyncio)
    harness pending_callers4 --models wide,wide_sync,mlp "${at256[@]}" --load-processes 4
    harness pending_workers2 --models wide,mlp "${at256[@]}" --load-processes 4 --workers 2
    ;;
pending_ab)
    at256=(--concurrency 256 --scenarios batched,asyncio)
    harness pending_ab1 --models mlp,mlp_sync "${at256[@]}"
    harness pending_ab2 --models mlp_sync,mlp "${at256[@]}"
    harness pending_ab3 --models wide_sync,wide "${at256[@]}"
    ;;
auto)
    # six caller processes: enough to feed three workers (one asyncio process drives ~50k items/s)
    at256=(--concurrency 256 --scenarios batched,asyncio --load-processes 6)
    harness auto --models mlp,wide "${at256[@]}"
    harness auto_mlp_workers1 --models mlp "${at256[@]}" --workers 1
    harness auto_mlp_again --models mlp "${at256[@]}"
    ;;
recheck)
    at256=(--concurrency 256 --scenarios batched,asyncio)
    harness recheck_defaults --models ${MODELS:-mlp,wide} "${at256[@]}"
    harness recheck_mlp_workers2_a --models mlp "${at256[@]}" --load-processes 4 --workers 2
    harness recheck_mlp_workers2_b --models mlp "${at256[@]}" --load-processes 4 --workers 2
    ;;
*)
    echo "unknown part $part: defaults, settings, repeat, pending, pending_ab, recheck or auto" >&2
    exit 2
    ;;
esac
