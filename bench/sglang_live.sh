#!/usr/bin/env bash
# The dump patch inside a live SGLang, checked against transformers: run from the repository
# root on a GPU node where SGLang 0.5.17 is installed under $SITE (the offline recipe in
# ../shared/notes/sglang-on-h200.md). For each dtype: start SGLang through patches.launch
# (chunked prefill 64, radix cache on, warmup on), run bench.sglang_live_check, stop it.
# Reports and server logs go to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/sglang-live}
SITE=${SITE:-/root/site}
MODEL=${MODEL:-/root/live-model}
mkdir -p "$OUT"
# Built with the node's own transformers, before $SITE shadows it.
python3 -m infra.tiny_model "$MODEL" --hidden 256 > "$OUT/model.log" 2>&1 || { cat "$OUT/model.log"; exit 1; }
export PYTHONPATH=$SITE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
status=0
for dtype in ${DTYPES:-bfloat16}; do
    dumps=/root/dumps-$dtype
    mkdir -p "$dumps"
    # setsid: the server and its scheduler processes form one group, stopped together below.
    setsid python3 -m patches.launch --dump-dir "$dumps" -- --model-path "$MODEL" --port 30000 \
        --attention-backend triton --sampling-backend pytorch --chunked-prefill-size 64 \
        --dtype "$dtype" --mem-fraction-static 0.3 > "$OUT/server-$dtype.log" 2>&1 < /dev/null &
    pid=$!
    python3 -m bench.sglang_live_check --model-path "$MODEL" --dump-dir "$dumps" --dtype "$dtype" \
        --health-timeout-s 240 --report "$OUT/report-$dtype.json" || status=1
    kill -TERM -- "-$pid" 2> /dev/null
    wait "$pid"
    tail -n 30 "$OUT/server-$dtype.log"
done
exit $status
