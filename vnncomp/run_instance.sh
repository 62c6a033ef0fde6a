#!/usr/bin/env bash
# VNN-COMP: run_instance.sh v1 CATEGORY ONNX VNNLIB RESULT_FILE TIMEOUT
#
# Runs `shardbound verify ONNX VNNLIB --timeout TIMEOUT --result RESULT_FILE --quiet` (or
# `python3 -m shardbound.compiler.cli verify ...` when the `shardbound` script is not on PATH).
# Prints the verifier's verdict line. A result file is always written: `timeout` when the
# verifier had to be killed past TIMEOUT + grace, `error` when it failed without one.
# Exit 0 whenever a result file was written; 1 on bad arguments or an unwritable result file.
#
# When prepare_instance.sh left a verifier process ready for this model (compiler/prestart.py:
# torch imported, network compiled), the same command runs in that process instead: the
# property and paths go to it through the FIFO STATE_DIR/request, its budget counts from this
# script's start, and we wait for its exit code (a FIFO) under the same hard limit.
START=$(date +%s.%N)
set -u

if [ "$#" -ne 6 ]; then
    echo "usage: $0 v1 CATEGORY ONNX VNNLIB RESULT_FILE TIMEOUT (got $# arguments)" >&2
    exit 1
fi
VERSION=$1
CATEGORY=$2
ONNX=$3
VNNLIB=$4
RESULT=$5
TIMEOUT=$6

if [ "$VERSION" != "v1" ]; then
    echo "$0: expected version string 'v1', got '$VERSION'" >&2
    exit 1
fi
if ! [[ "$TIMEOUT" =~ ^[0-9]+([.][0-9]*)?$ ]]; then
    echo "$0: TIMEOUT must be a number of seconds, got '$TIMEOUT'" >&2
    exit 1
fi

write_result() {   # write_result VERDICT
    mkdir -p -- "$(dirname -- "$RESULT")" 2>/dev/null
    if ! printf '%s\n' "$1" > "$RESULT"; then
        echo "$0: cannot write the result file '$RESULT'" >&2
        exit 1
    fi
}

# Start from no result so a stale file from an earlier run can never be taken for this one.
rm -f -- "$RESULT"
mkdir -p -- "$(dirname -- "$RESULT")" 2>/dev/null

if command -v shardbound >/dev/null 2>&1; then
    VERIFY=(shardbound verify)
else
    VERIFY=(python3 -m shardbound.compiler.cli verify)
fi
# --summation fast: the competition scores answers within the timeout, not bits that repeat
# across rank counts (shardbound's default, blocked, costs ~1.2-2x in branch and bound).
ARGS=("$ONNX" "$VNNLIB" --timeout "$TIMEOUT" --result "$RESULT" --quiet --summation fast)
if [ -n "${SHARDBOUND_THREADS:-}" ]; then
    ARGS+=(--threads "$SHARDBOUND_THREADS")
fi

# The verifier keeps its own deadline (compilation included); the hard limit only catches a
# stage that overruns it. It runs in its own process group, recorded for prepare_instance.sh.
GRACE=${SHARDBOUND_VNNCOMP_GRACE:-10}
HARD_LIMIT=$(awk -v t="$TIMEOUT" -v g="$GRACE" 'BEGIN { printf "%.3f", t + g }')
STATE_DIR=${SHARDBOUND_VNNCOMP_STATE:-${TMPDIR:-/tmp}/shardbound-vnncomp-$(id -u)}
mkdir -p -- "$STATE_DIR" 2>/dev/null

server=""
PID_FILE=$STATE_DIR/run.pid
if [ -f "$STATE_DIR/ready" ] && [ -p "$STATE_DIR/request" ] \
        && [ "$(cat -- "$STATE_DIR/ready" 2>/dev/null)" = "$ONNX" ]; then
    pid=$(cat "$PID_FILE" 2>/dev/null || true)
    OUT=$STATE_DIR/out.$$ ERR=$STATE_DIR/err.$$ RC=$STATE_DIR/rc.$$
    rm -f -- "$OUT" "$OUT.code" "$ERR" "$RC"
    if [[ "$pid" =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null && mkfifo -- "$RC" \
            && timeout 5 bash -c 'printf "%s\0" "${@:2}" > "$1"' _ "$STATE_DIR/request" \
                "$START" "$ONNX" "$VNNLIB" "$RESULT" "$TIMEOUT" "${SHARDBOUND_THREADS:-}" \
                "$OUT" "$ERR" "$RC"; then
        server=$pid
    fi
fi
rm -f -- "$STATE_DIR/ready"

if [ -n "$server" ]; then
    trap 'kill -TERM -- "-$server" 2>/dev/null; write_result error; exit 1' INT TERM
    # Its exit code comes through the FIFO $RC (end of file, no code, if it died); not
    # waiting for the process itself, which lingers until init reaps it.
    # (In the background with `wait`, so that a signal's trap runs at once.)
    timeout "$HARD_LIMIT" bash -c 'IFS= read -r code < "$1"; printf "%s" "$code" > "$2"' \
        _ "$RC" "$OUT.code" &
    wait "$!"
    waited=$?
    rc=$(cat -- "$OUT.code" 2>/dev/null || true)
    if [ "$waited" -eq 124 ]; then
        kill -TERM -- "-$server" 2>/dev/null
        timeout 5 tail --pid="$server" -s 0.05 -f /dev/null || kill -KILL -- "-$server" 2>/dev/null
        rc=124
    fi
    [[ "$rc" =~ ^[0-9]+$ ]] || rc=1
    trap - INT TERM
    cat -- "$OUT" 2>/dev/null
    cat -- "$ERR" >&2 2>/dev/null
    rm -f -- "$OUT" "$OUT.code" "$ERR" "$RC" "$PID_FILE"
else
    pid=$(cat "$PID_FILE" 2>/dev/null || true)     # a prestarted verifier left unused
    if [[ "$pid" =~ ^[0-9]+$ ]] && [ -r "/proc/$pid/cmdline" ] \
            && tr '\0' ' ' < "/proc/$pid/cmdline" | grep -q "shardbound.compiler.prestart"; then
        kill -KILL -- "-$pid" 2>/dev/null || true
    fi
    setsid timeout --kill-after=5 "$HARD_LIMIT" "${VERIFY[@]}" "${ARGS[@]}" &
    child=$!
    echo "$child" > "$PID_FILE" 2>/dev/null
    trap 'kill -TERM -- "-$child" 2>/dev/null; write_result error; exit 1' INT TERM
    wait "$child"
    rc=$?
    trap - INT TERM
    rm -f -- "$PID_FILE"
fi

first_line=""
if [ -s "$RESULT" ]; then
    IFS= read -r first_line < "$RESULT" || true
fi
case "$first_line" in
    sat|unsat|unknown|timeout|error)
        if [ "$rc" -ne 0 ]; then
            echo "$0: verifier exited with code $rc after writing '$first_line'" >&2
        fi
        ;;
    *)
        if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
            echo "$0: verifier killed after ${HARD_LIMIT} s; result: timeout" >&2
            echo "timeout"
            write_result timeout
        else
            echo "$0: verifier exited with code $rc without a result; result: error" >&2
            echo "error"
            write_result error
        fi
        ;;
esac
exit 0
