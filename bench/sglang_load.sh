#!/usr/bin/env bash
# bench.sglang_load on a GPU node, all phases in one go: unpatched SGLang, then two starts of the
# patched one (patches.launch). Run from the repository root where SGLang 0.5.17 is installed under
# $SITE (../shared/notes/sglang-on-h200.md). Everything goes to $RUN (results.jsonl, table.md, logs);
# `touch $RUN/done` marks the end, so a caller can wait for it across calls.
set -uo pipefail
RUN=${RUN:-/root/load}
SITE=${SITE:-/root/site}
MODEL=${MODEL:-/root/load-model}
DUMPS=${DUMPS:-/dev/shm/eagle3}
SHARDS=${SHARDS:-/root/shards}   # SHARDS_<run> for one run's own folder (e.g. SHARDS_2=/dev/shm/shards)
SAMPLES=${SAMPLES:-1000}
UNPATCHED=${UNPATCHED:-1}   # 0: skip the unpatched baseline
UNPATCHED_PHASES=${UNPATCHED_PHASES:-1}  # unpatched prefill phases (the baseline is their mean)
WARM_SHM_GIB=${WARM_SHM_GIB:-0}  # GiB written to and deleted from $DUMPS's file system before any server starts, so
                                 # that no phase is the first to use the machine's memory (a fresh VM's first ~50 GB
                                 # came slow: results file, runs H and I)
RUNS=${RUNS:-1 2}           # patched server starts
CONSUME=${CONSUME:-1}       # 0: no consume-only phase
CHECK_EVERY=${CHECK_EVERY:-1}
FP32_EVERY=${FP32_EVERY:-4}             # of the checked samples, every n-th also against the fp32 reference
IN_FLIGHT=${IN_FLIGHT:-64}              # requests in flight (extract; consume unless CONSUME_IN_FLIGHT)
CONSUME_IN_FLIGHT=${CONSUME_IN_FLIGHT:-$IN_FLIGHT}  # one consume phase per value
READERS=${READERS:-8}                   # reader processes (0: the request threads read); 12 was best without a server
CONSUME_READERS=${CONSUME_READERS:-$READERS}      # one consume phase per value (and per in-flight value)
BYTES_IN_FLIGHT=${BYTES_IN_FLIGHT:-3221225472}     # client's dump bytes in flight, under the writer's budget
PATCH_FLAGS=${PATCH_FLAGS:-}            # e.g. --dump-writer-threads 12 --dump-max-pending-bytes 12884901888
DUMP_READ=${DUMP_READ:-}                # reader counts for bench.dump_read first, with no server (e.g. "8 12 16")
HOOKS_IDLE=${HOOKS_IDLE:-0}   # 1: first start, a prefill phase whose rids lack the dump prefix (hooks on, nothing dumped)
MORE_READERS=${MORE_READERS:-}  # first start, after the checked extract: one unchecked extract per reader count
NICE_CLIENT=${NICE_CLIENT:-}    # first start, also an unchecked extract with the client at this niceness (e.g. 10)
PROFILE=${PROFILE:-0}   # 1: one more unpatched prefill and one more consume, each with py-spy sampling the scheduler
                        # (it stops the process per sample, so the timed phases run without it; py-spy==0.4.3 in $SITE)
mkdir -p "$RUN" "$DUMPS"
RESULTS=$RUN/results.jsonl
log() { echo "[$(date +%T)] $*" | tee -a "$RUN/progress.log"; }

# Built with the node's own transformers, before $SITE shadows it; once per machine (bench/device_call.sh
# builds it in the call that installs the first wheel part, so that the timed call has that ~80 s more).
if [ -f "$MODEL/.built" ]; then
    log "model already built in $MODEL"
else
    log "building the model"
    python3 -m bench.sglang_load build-model "$MODEL" > "$RUN/model.log" 2>&1 || { log "model build failed"; touch "$RUN/done"; exit 1; }
    touch "$MODEL/.built"
fi
[ "${BUILD_ONLY:-0}" = 1 ] && exit 0
export PYTHONPATH=$SITE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ -n "$DUMP_READ" ]; then
    log "dump_read, reader processes $DUMP_READ"
    # shellcheck disable=SC2086  # DUMP_READ is a list of counts
    python3 -m bench.dump_read --samples 400 --reader-processes $DUMP_READ > "$RUN/dump_read.md" 2>&1 \
        || log "dump_read reported a problem"
fi
SERVER_FLAGS=(--model-path "$MODEL" --port 30000 --attention-backend triton --sampling-backend pytorch
              --chunked-prefill-size 4096 --mem-fraction-static 0.6 --dtype bfloat16
              --sleep-on-idle)  # both servers alike; patches.launch would add it to the patched one
COMMON=(--model-path "$MODEL" --dump-dir "$DUMPS" --samples "$SAMPLES" --results "$RESULTS"
        --check-every "$CHECK_EVERY" --fp32-every "$FP32_EVERY" --max-dump-bytes-in-flight "$BYTES_IN_FLIGHT")

start() {  # start NAME CMD...: in its own process group, healthy within 400 s
    local name=$1; shift
    setsid "$@" > "$RUN/server-$name.log" 2>&1 < /dev/null &
    SERVER=$!
    for _ in $(seq 400); do
        curl -sf http://127.0.0.1:30000/health > /dev/null && { log "$name healthy"; return 0; }
        kill -0 "$SERVER" 2> /dev/null || { log "$name died"; tail -n 40 "$RUN/server-$name.log"; return 1; }
        sleep 1
    done
    log "$name not healthy after 400 s"; return 1
}
stop() {
    kill -TERM -- "-$SERVER" 2> /dev/null
    for _ in $(seq 30); do kill -0 "$SERVER" 2> /dev/null || return 0; sleep 1; done
    kill -KILL -- "-$SERVER" 2> /dev/null
}
vmstat() {  # the kernel's page-allocation counters, to see whether a slow phase waited on memory
    echo "$(date +%T) $1 $(grep -E '^(nr_free_pages|nr_shmem|nr_file_pages|pgfault|pgmajfault|pgscan_kswapd|pgscan_direct|allocstall_normal|compact_stall|thp_fault_alloc) ' /proc/vmstat | tr '\n' ' ')" >> "$RUN/vmstat.log"
}
phase() {  # NICENESS=N phase ...: the client at that niceness (0: as the script)
    log "phase $*${NICENESS:+ (client under nice -n $NICENESS)}"
    vmstat "before $1 $3"
    nice -n "${NICENESS:-0}" python3 -m bench.sglang_load "$@" >> "$RUN/phases.log" 2>&1 || log "phase $1 $3 reported a problem"
    vmstat "after $1 $3"
}
profile() {  # profile NAME DELAY: 8 s of the scheduler's stacks (native frames too), from DELAY s into the phase
            # about to start (past its set-up: samples made, readers started; run E's took ~10 s)
    local pid
    pid=$(pgrep -f '^sglang::scheduler' | head -n 1)
    [ -n "$pid" ] || { log "profile $1: no scheduler process"; return 0; }
    (sleep "$2" && "$SITE/bin/py-spy" record --native --format raw --rate 200 --duration 8 --pid "$pid" \
        --output "$RUN/profile-$1.txt" > "$RUN/profile-$1.log" 2>&1) &
}

if [ "$WARM_SHM_GIB" -gt 0 ]; then
    # no more than the file system holds (tmpfs defaults to half the memory), less 1 GiB
    avail_gib=$(( $(df --output=avail -B1G "$DUMPS" | tail -n 1) - 1 ))
    warm_gib=$(( WARM_SHM_GIB < avail_gib ? WARM_SHM_GIB : avail_gib ))
    t0=$(date +%s%N)
    dd if=/dev/zero of="$DUMPS/warm-up" bs=64M count=$((warm_gib * 16)) status=none || log "warm-up write failed"
    log "wrote $(( $(stat -c %s "$DUMPS/warm-up") >> 30 )) GiB of $WARM_SHM_GIB asked ($avail_gib free) to $DUMPS" \
        "in $((($(date +%s%N) - t0) / 1000000)) ms"
    rm -f "$DUMPS/warm-up"
fi
if [ "$UNPATCHED" = 1 ]; then
    if start unpatched python3 -m sglang.launch_server "${SERVER_FLAGS[@]}"; then
        for i in $(seq 0 $((UNPATCHED_PHASES - 1))); do
            phase prefill --label unpatched --seed $((i ? 30 + i : 0)) --in-flight 64 "${COMMON[@]}"
        done
        if [ "$PROFILE" = 1 ]; then
            profile unpatched 3
            phase prefill --label "unpatched profiled" --seed 6 --in-flight 64 "${COMMON[@]}"
        fi
    fi
    stop
fi
for run in $RUNS; do
    # shellcheck disable=SC2086  # PATCH_FLAGS is a list of flags
    if start "patched-$run" python3 -m patches.launch --dump-dir "$DUMPS" $PATCH_FLAGS -- "${SERVER_FLAGS[@]}"; then
        if [ "$HOOKS_IDLE" = 1 ] && [ "$run" = 1 ]; then
            phase prefill --label "patched-$run hooks idle" --seed 5 --in-flight 64 --rid-prefix plain- "${COMMON[@]}"
        fi
        if [ "$CONSUME" = 1 ] && [ "$run" = 1 ]; then
            for k in $CONSUME_IN_FLIGHT; do
                for r in $CONSUME_READERS; do
                    phase consume --label "patched-$run" --seed 1 --in-flight "$k" --reader-processes "$r" "${COMMON[@]}"
                done
            done
            if [ "$PROFILE" = 1 ]; then
                profile consume 10
                phase consume --label "patched-$run profiled" --seed 7 --in-flight "$IN_FLIGHT" \
                    --reader-processes "$READERS" "${COMMON[@]}"
            fi
        fi
        shards_var=SHARDS_$run
        phase extract --label "patched-$run" --seed $((run + 1)) --shards "${!shards_var:-$SHARDS}" \
            --in-flight "$IN_FLIGHT" --reader-processes "$READERS" "${COMMON[@]}"
        if [ "$run" = 1 ]; then
            for r in $MORE_READERS; do
                phase extract --label "patched-$run" --seed $((10 + r)) --shards "${!shards_var:-$SHARDS}" \
                    --in-flight "$IN_FLIGHT" --reader-processes "$r" "${COMMON[@]}" --check-every 0
            done
            if [ -n "$NICE_CLIENT" ]; then
                NICENESS=$NICE_CLIENT phase extract --label "patched-$run client nice $NICE_CLIENT" --seed 9 \
                    --shards "${!shards_var:-$SHARDS}" --in-flight "$IN_FLIGHT" --reader-processes "$READERS" \
                    "${COMMON[@]}" --check-every 0
            fi
        fi
        log "leftover dump files: $(ls "$DUMPS" | wc -l)"
        # the writer's own lines (late pieces, refusals) and long collections, for the caller to bring back
        grep -h -e 'dump writer' -e 'garbage collection' "$RUN/server-patched-$run.log" | sed "s/^/patched-$run: /" | tail -n 200 >> "$RUN/writer.log"
    fi
    stop
done
python3 -m bench.sglang_load report "$RESULTS" > "$RUN/table.md" 2>&1
log "done"
touch "$RUN/done"
