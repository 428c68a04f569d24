#!/usr/bin/env bash
# Quality against the bytes a decode step reads, on the 576-token bundled benchmark: each retrieval method
# at 5 / 10 / 25 / 50% of dense attention's bytes per step (read_bytes_budget: summaries scanned + KV of
# the pages selected + always-read pages, against every resident slot), in four settings: single
# questions with the image compressed before the question (VQAv2 and MMBench), the long-answer object
# list, and conversations of 4 questions about one image. 3 sinks, no recent window, text pages always read.
# Methods: Quest, LOCKS and OVAL (rank 8; OVAL rank 2 too) with fixed pages (2x2 and 4x4 tiles) and dynamic
# ones (OVAL's sizing), float and compact summaries, and router v2 (its bundled weights: over Quest on 2x2 tiles, over compact
# Quest on 4x4 tiles, and over compact OVAL rank 8 and rank 2 on 4x4 tiles). Each cell resumes; tables
# and plots land in docs/results/frontier_*_576.md / .png. First questions of each dev set only (VQAv2
# 80 = 10 per type, MMBench 24 base questions with their rotations, lists 20, conversations 40 = 10 of 4);
# LIMIT_VQA, LIMIT_MMB, LIMIT_LIST, LIMIT_MT change that.
# Then retrieval on top of KVP eviction (SKIP_KVP=1 leaves it out; ONLY_KVP=1 runs it alone).
#
#   scripts/frontier_bundled576.sh
set -euo pipefail
BIN=${BIN:-.venv/bin}
OUT=${OUT:-runs/frontier576}
BUDGETS=${BUDGETS:-0.05,0.1,0.25,0.5}
mkdir -p "$OUT" docs/results
O=sink_tokens=3,recent_tokens=0,read_bytes_budget
D=page_sizing=dynamic
C=summary_format=compact
F=summary_format=float
if [ -z "${METHODS:-}" ]; then
    # every row names its page size and summary format (the defaults are 4x4 tiles, compact LOCKS / OVAL and
    # float Quest; before run format 3 they were 2x2 tiles and float records, and these rows were run then)
    METHODS=(quest:$O,image_tile=2 quest:$O,image_tile=4 quest:$O,image_tile=4,$C quest:$O,$D quest:$O,$D,$C
             oval:$O,image_tile=4,$F oval:$O,$D,$F oval:$O,image_tile=4,$C oval:$O,image_tile=4,$C,rank=2 oval:$O,$D,$C
             locks:$O,$D,$C
             router2:$O,image_tile=2,weights=bundled576 router2:$O,image_tile=4,weights=bundled576-quest4c
             router2:$O,image_tile=4,weights=bundled576-oval4c router2:$O,image_tile=4,weights=bundled576-oval4c-r2
             ${EXTRA_METHODS:-})
else
    read -r -a METHODS <<< "$METHODS"
fi
run() {  # name, then the sweep's arguments
    local name=$1; shift
    OMP_NUM_THREADS=${THREADS:-1} "$BIN/mm-oval" sweep --model bundled576 --data bundled576 \
        --budgets "$BUDGETS" --no-progress --out "$OUT/$name" --methods "${METHODS[@]}" "$@" \
        > "$OUT/$name.log" 2>&1
    cp "$OUT/$name/sweep.md" "docs/results/frontier_${name}_576.md"
    cp "$OUT/$name/sweep.png" "docs/results/frontier_${name}_576.png"
}
if [ -z "${ONLY_KVP:-}" ]; then
run vqav2_compress_image --task vqav2 --compress image --limit "${LIMIT_VQA:-80}" --batch-size 20 &
run objlist_compress_image --task objlist --compress image --limit "${LIMIT_LIST:-20}" --batch-size 10 &
run vqav2_multi_turn4 --task vqav2 --multi-turn 4 --limit "${LIMIT_MT:-40}" &
run mmbench_compress_image --task mmbench --compress image --limit "${LIMIT_MMB:-24}" --batch-size 20 &
wait
fi
# Retrieval on top of KVP eviction: the eviction budget (10%, 25% of the image KV kept) on the budget axis,
# the retrieval method reading a share of the kept cache's bytes per step.
K=kvp:sink_tokens=3,recent_tokens=0,agents=bundled576-image
R=retrieval=oval,page_sizing=dynamic,retrieval.summary_format=compact
# pages over the kept tokens (page_sizing=kept: runs of 16 kept patches in Z-order) with compact OVAL rank 2
# and compact Quest: a small kept cache's tiles hold 1-3 tokens each, whose summaries would take the budget
RK=page_sizing=kept,image_tile=4,retrieval.summary_format=compact
KVP_METHODS=($K "$K,$R,read_bytes_budget=0.5" "$K,$R,read_bytes_budget=0.25" "$K,retrieval=quest,image_tile=2,read_bytes_budget=0.5"
             "$K,retrieval=oval,$RK,retrieval.rank=2,read_bytes_budget=0.5"
             "$K,retrieval=oval,$RK,retrieval.rank=2,read_bytes_budget=0.25"
             "$K,retrieval=quest,$RK,read_bytes_budget=0.5" "$K,retrieval=quest,$RK,read_bytes_budget=0.25")
if [ -z "${SKIP_KVP:-}" ]; then
    METHODS=("${KVP_METHODS[@]}")
    BUDGETS=${KVP_BUDGETS:-0.1,0.25}
    run kvp_vqav2_compress_image --task vqav2 --compress image --limit "${LIMIT_VQA:-80}" --batch-size 20 &
    run kvp_objlist_compress_image --task objlist --compress image --limit "${LIMIT_LIST:-20}" --batch-size 10 &
    wait
fi
