#!/usr/bin/env bash
# One call of the lent GPU machine (../shared/notes/sglang-on-h200.md), from the repository root there:
#   bash bench/device_call.sh install WHEEL_DIR      install a wheel part into $SITE (first part: the model is built too)
#   bash bench/device_call.sh bench WAIT_S           bench/sglang_load.sh started detached (its settings from the
#                                                    environment), its results copied to $OUT every 10 s for WAIT_S s
#   bash bench/device_call.sh collect WAIT_S         the same wait and copy, for a bench an earlier call started
# The copy runs while the bench does because a machine is given back 30 s after a call: results left on it
# for a later call are lost whenever that call comes late (run J, results file), and a call cut at its
# limit still brings back what it had put under $OUT.
set -uo pipefail
SITE=${SITE:-/root/site}
RUN=${RUN:-/root/load}
OUT=${OUT:?OUT is set by the run tool}
save() {
    for f in results.jsonl progress.log vmstat.log table.md writer.log; do [ -f "$RUN/$f" ] && cp "$RUN/$f" "$OUT/"; done
    [ -f "$RUN/phases.log" ] && tail -n 200 "$RUN/phases.log" > "$OUT/phases-tail.log"
    [ -f /root/bench.out ] && tail -n 50 /root/bench.out > "$OUT/bench-out.log"
    return 0
}
wait_and_save() {
    local until=$((SECONDS + $1))
    while [ ! -f "$RUN/done" ] && [ "$SECONDS" -lt "$until" ]; do sleep 10; save; done
    save
    cat "$RUN/progress.log" 2> /dev/null
    [ -f "$RUN/done" ] && cat "$RUN/table.md"
    [ -f "$RUN/done" ] || echo "the bench is still running: collect it in the next call, within 30 s"
}
case ${1:-} in
    install)
        mkdir -p "$SITE"
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
            "$2"/*.whl || exit 4
        if [ -d "$SITE/sgl_kernel" ] && [ ! -d "$SITE/sglang" ]; then  # the first part: build the model meanwhile
            BUILD_ONLY=1 RUN=$RUN bash bench/sglang_load.sh; cat "$RUN/progress.log"
        fi
        ;;
    bench)
        [ -d "$SITE/sgl_kernel" ] && [ -d "$SITE/sglang" ] || { echo "SGLang is not installed in $SITE: the machine was replaced"; exit 3; }
        rm -f "$RUN/done"
        # a copy outside the working tree, which the next call may replace under a running bench
        rm -rf /root/repo && mkdir /root/repo && tar --exclude=./.wheels -cf - . | tar -C /root/repo -xf - || exit 5
        (cd /root/repo && setsid nohup bash bench/sglang_load.sh > /root/bench.out 2>&1 < /dev/null &)
        wait_and_save "$2"
        ;;
    collect) wait_and_save "$2" ;;
    *) echo "usage: bash bench/device_call.sh install WHEEL_DIR | bench WAIT_S | collect WAIT_S" >&2; exit 2 ;;
esac
