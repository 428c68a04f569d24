#!/usr/bin/env bash
# Every eviction and retrieval method against the image-KV budget on the 576-token bundled benchmark
# (LLaVA-1.5's image geometry), in four settings: the image compressed before the question is read
# (VQAv2 and MMBench, single turn), conversations of 4 questions about one compressed image (VQAv2), and
# the long-answer object list (every answer token decoded from the compressed cache). 3 sinks and no
# recent window, so all 576 image tokens are a real choice. Each cell resumes; tables and plots land in
# docs/results/ as *_576.md / *_576.png. To fit in about 35 minutes on 2 cores, every setting runs on the
# first questions of its dev set: VQAv2 80 (10 images, all 8 types), MMBench 24 base questions (with
# their circular rotations), lists 30, conversations 40 (10 conversations of 4); LIMIT_VQA, LIMIT_MMB,
# LIMIT_LIST and LIMIT_MT change that. KVP runs its agents fitted to this model (bundled576-image); the
# router is not swept here (router v2 is in scripts/frontier_bundled576.sh). MODEL=bundled-smol runs the same
# grid on the LLaVA on SmolLM2 (with its KVP agents, bundled-smol-image, or those in KVP_AGENTS; tables named
# *_smol.md unless SUFFIX says); SETTINGS="vqav2_compress_image" runs one setting of the four.
#
#   scripts/sweep_bundled576.sh
#   MODEL=bundled-smol SETTINGS=vqav2_compress_image scripts/sweep_bundled576.sh
set -euo pipefail
BIN=${BIN:-.venv/bin}
MODEL=${MODEL:-bundled576}
if [ "$MODEL" = bundled576 ]; then SUFFIX=${SUFFIX:-_576}; OUT=${OUT:-runs/bundled576}; AGENTS=bundled576-image
else SUFFIX=${SUFFIX:-_smol}; OUT=${OUT:-runs/sweep_smol}; AGENTS=bundled-smol-image; fi
SETTINGS=" ${SETTINGS:-vqav2_compress_image mmbench_compress_image objlist_compress_image vqav2_multi_turn4} "
BUDGETS=${BUDGETS:-0.05,0.1,0.25,0.5}
mkdir -p "$OUT" docs/results
O=sink_tokens=3,recent_tokens=0
EVICTION=(expected_attention:$O adakv:$O,scorer=expected_attention kvzip:$O pyramidkv:$O adakv:$O
          keydiff:$O fastv:$O h2o:$O tova:$O snapkv:$O streamingllm:$O random:$O knorm:$O)
EVICTION+=(kvp:$O,agents=${KVP_AGENTS:-$AGENTS} ${EXTRA_EVICTION:-})
RETRIEVAL=(oval:$O quest:$O ${EXTRA_RETRIEVAL:-})
run() {  # name, then the sweep's arguments; only the settings named in SETTINGS run
    local name=$1; shift
    [[ "$SETTINGS" == *" $name "* ]] || return 0
    OMP_NUM_THREADS=${THREADS:-1} "$BIN/mm-oval" sweep --model "$MODEL" --data bundled576 \
        --budgets "$BUDGETS" --no-progress --out "$OUT/sweep-$name" "$@" > "$OUT/sweep-$name.log" 2>&1
    cp "$OUT/sweep-$name/sweep.md" "docs/results/${name}$SUFFIX.md"
    cp "$OUT/sweep-$name/sweep.png" "docs/results/${name}$SUFFIX.png"
}
run vqav2_compress_image --task vqav2 --compress image --limit "${LIMIT_VQA:-80}" --batch-size 20 --methods "${EVICTION[@]}" "${RETRIEVAL[@]}" &
run mmbench_compress_image --task mmbench --compress image --limit "${LIMIT_MMB:-24}" --batch-size 20 --methods "${EVICTION[@]}" "${RETRIEVAL[@]}" &
run objlist_compress_image --task objlist --compress image --limit "${LIMIT_LIST:-30}" --batch-size 10 --methods "${EVICTION[@]}" "${RETRIEVAL[@]}" &
run vqav2_multi_turn4 --task vqav2 --multi-turn 4 --limit "${LIMIT_MT:-40}" --methods "${EVICTION[@]}" &
wait
