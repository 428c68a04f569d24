#!/usr/bin/env bash
# Every eviction and retrieval method on SmolLM2-135M-Instruct's real attention: the long-context text
# tasks (eval/longtext.py), question-agnostic (--compress context: the context is prefilled and compressed
# before the question is read), KVP with the agents fitted to SmolLM2 (smollm2-context). Default: the single
# pass key at ~1k tokens, the first 10 contexts of the bundled dev set, 5 / 10 / 25 / 50% of the context KV;
# retrieval at equal bytes read per decode step. KVzip runs twice: with the same budget in every layer
# (mm-oval's default) and with its own allocation over every layer and head (layerwise=false); KVP runs
# with its default and with the division recommended for SmolLM2 (layerwise=false,calibrated=true). Each cell
# resumes; the table and plot land in docs/results/<task>_smollm2.md / .png. KVzip and retrieval cells cost
# the most.
#
#   scripts/sweep_smollm2.sh                       # TASK=passkey_1k LIMIT=10 BUDGETS=0.05,0.1,0.25,0.5
#   TASK=needle_1k BUDGETS=0.05,0.1,0.25,0.5 scripts/sweep_smollm2.sh
#   TASK=duo_1k LIMIT=20 SWEEP_ARGS="--multi-turn 2" COMPRESS=prompt scripts/sweep_smollm2.sh  # two questions in
#       turn over one context (a conversation prefills and compresses the context before its first question)
#   DATA=docs/results/seed2 OUT=runs/smollm2-seed2 LIMIT=20 scripts/sweep_smollm2.sh   # the second seed
# METHODS (space-separated specs) runs those instead of every method. BATCH (default 10) questions per generate call: the predictions do not depend on it (tests/test_eval_runner.py).
set -euo pipefail
BIN=${BIN:-.venv/bin}
TASK=${TASK:-passkey_1k}
OUT=${OUT:-runs/smollm2}
BUDGETS=${BUDGETS:-0.05,0.1,0.25,0.5}
mkdir -p "$OUT" docs/results
EVICTION=(expected_attention kvzip kvzip:layerwise=false snapkv tova h2o streamingllm random knorm keydiff pyramidkv adakv
          adakv:scorer=expected_attention fastv kvp:agents=smollm2-context
          kvp:agents=smollm2-context,layerwise=false,calibrated=true ${EXTRA_EVICTION:-})
# OVAL (compact, rank 8 and rank 2; rank 8 also with a layer's KV heads sharing their bytes), Quest (float
# and compact), and router v2 over compact OVAL rank 2
RETRIEVAL=(oval:read_bytes_budget oval:read_bytes_budget,rank=2 oval:read_bytes_budget,read_head_budget=shared
           quest:read_bytes_budget quest:read_bytes_budget,summary_format=compact
           router2:read_bytes_budget,weights=smollm2-oval2 ${EXTRA_RETRIEVAL:-})
OMP_NUM_THREADS=${THREADS:-1} "$BIN/mm-oval" sweep --model smollm2 --task "$TASK" \
    --compress "${COMPRESS:-context}" --limit "${LIMIT:-10}" --budgets "$BUDGETS" --no-progress --out "$OUT/sweep-$TASK" \
    --batch-size "${BATCH:-10}" --data "${DATA:-bundled}" ${SWEEP_ARGS:-} \
    --methods ${METHODS:-"${EVICTION[@]}" "${RETRIEVAL[@]}"} > "$OUT/sweep-$TASK.log" 2>&1
NAME=${NAME:-${TASK}_smollm2}
cp "$OUT/sweep-$TASK/sweep.md" "docs/results/$NAME.md"
cp "$OUT/sweep-$TASK/sweep.png" "docs/results/$NAME.png"
