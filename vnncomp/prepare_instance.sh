#!/usr/bin/env bash
# VNN-COMP: prepare_instance.sh v1 CATEGORY ONNX VNNLIB
#
# Called by the competition harness before every instance. shardbound compiles the network
# inside run_instance.sh (the compile time counts against the timeout, as the rules want),
# so there is nothing to convert here: we check the arguments and stop a verifier that an
# earlier run_instance.sh of ours left behind (only the process group recorded in our own
# pid file; never anything found by name, so other users' runs are safe).
set -u

if [ "$#" -ne 4 ]; then
    echo "usage: $0 v1 CATEGORY ONNX VNNLIB (got $# arguments)" >&2
    exit 1
fi
VERSION=$1
CATEGORY=$2
ONNX=$3
VNNLIB=$4

if [ "$VERSION" != "v1" ]; then
    echo "$0: expected version string 'v1', got '$VERSION'" >&2
    exit 1
fi

STATE_DIR=${SHARDBOUND_VNNCOMP_STATE:-${TMPDIR:-/tmp}/shardbound-vnncomp-$(id -u)}
PID_FILE=$STATE_DIR/run.pid
if [ -f "$PID_FILE" ]; then
    pgid=$(cat "$PID_FILE" 2>/dev/null || true)
    # Only a live process group whose leader is still our verifier (the pid may be reused).
    if [[ "$pgid" =~ ^[0-9]+$ ]] && [ -r "/proc/$pgid/cmdline" ] \
            && tr '\0' ' ' < "/proc/$pgid/cmdline" | grep -q "shardbound"; then
        echo "$0: stopping stale verifier (process group $pgid)" >&2
        kill -TERM -- "-$pgid" 2>/dev/null || true
        sleep 1
        kill -KILL -- "-$pgid" 2>/dev/null || true
    fi
    rm -f "$PID_FILE"
fi

for f in "$ONNX" "$VNNLIB"; do
    if [ ! -r "$f" ]; then
        echo "$0: cannot read '$f'" >&2
        exit 1
    fi
done

echo "prepared $CATEGORY: $(basename "$ONNX") $(basename "$VNNLIB")"
exit 0
