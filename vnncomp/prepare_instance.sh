#!/usr/bin/env bash
# VNN-COMP: prepare_instance.sh v1 CATEGORY ONNX VNNLIB
#
# Called by the competition harness before every instance (untimed; VNN-COMP gives it for
# converting the model). We check the arguments, stop a verifier that an earlier run of ours
# left behind (only the process group recorded in our own pid file; never anything found by
# name, so other users' runs are safe), and start the instance's verifier process ahead
# (compiler/prestart.py): it imports torch and the compiler and compiles the network, then
# waits for run_instance.sh to hand it the property. It reads nothing of the property before
# that. SHARDBOUND_VNNCOMP_PRESTART=0: start nothing (run_instance.sh then starts
# `shardbound verify` itself, compilation counted against the timeout).
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

rm -f -- "$STATE_DIR/ready" "$STATE_DIR/request" "$STATE_DIR/cpu"
if [ "${SHARDBOUND_VNNCOMP_PRESTART:-1}" != "0" ] && mkdir -p -- "$STATE_DIR" 2>/dev/null; then
    # The interpreter that runs the `shardbound` script (its shebang), else python3.
    PY=(python3)
    if exe=$(command -v shardbound 2>/dev/null); then
        read -r -a shebang < <(sed -n '1s/^#!//p' "$exe")
        [ "${#shebang[@]}" -gt 0 ] && PY=("${shebang[@]}")
    fi
    setsid "${PY[@]}" -m shardbound.compiler.prestart "$STATE_DIR" "$ONNX" \
        < /dev/null > "$STATE_DIR/prestart.log" 2>&1 &
    server=$!
    echo "$server" > "$PID_FILE"
    # Ready when it has compiled the network; give up (and run without it) after
    # SHARDBOUND_VNNCOMP_PRESTART_WAIT seconds or if it died.
    wait_s=${SHARDBOUND_VNNCOMP_PRESTART_WAIT:-120}
    end=$(( $(date +%s) + ${wait_s%.*} ))
    while [ ! -f "$STATE_DIR/ready" ] && kill -0 "$server" 2>/dev/null \
            && [ "$(date +%s)" -lt "$end" ]; do
        sleep 0.05
    done
    if [ ! -f "$STATE_DIR/ready" ]; then
        echo "$0: the prestarted verifier is not ready; run_instance.sh will start its own" >&2
        kill -KILL -- "-$server" 2>/dev/null || true
        rm -f -- "$PID_FILE" "$STATE_DIR/ready"
    fi
fi

echo "prepared $CATEGORY: $(basename "$ONNX") $(basename "$VNNLIB")"
exit 0
