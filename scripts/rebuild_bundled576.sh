#!/usr/bin/env bash
# Build the 576-token tiny LLaVA, install it as the bundled one and remeasure what depends on it.
#
#   scripts/rebuild_bundled576.sh RUN_DIR          (RUN_DIR: where `mm-oval zoo train576` works; resumes)
#
# 1. `mm-oval zoo train576 --out RUN_DIR` (vision tower trained, projector and language model in closed
#    form) and its export RUN_DIR/model copied to mm_oval/zoo/tiny_llava576;
# 2. the KVP agents fitted to it (per head, image compressed before the question, with the redundancy-aware
#    selection recorded beside them) copied to mm_oval/zoo/tiny_llava576_kvp_image (`agents=bundled576-image`),
#    and the joint-heads ones to mm_oval/zoo/tiny_llava576_kvp_image_joint (`agents=bundled576-image-joint`);
# 3. full-cache scores (VQAv2, MMBench, POPE, object lists) and the grounding check under runs/bundled576/;
# 4. scripts/sweep_bundled576.sh: every method at 5-50 % of the image KV in the four settings.
set -euo pipefail
RUN=${1:?usage: scripts/rebuild_bundled576.sh RUN_DIR}
BIN=${BIN:-.venv/bin}
OUT=runs/bundled576
mkdir -p "$OUT"
"$BIN/mm-oval" zoo train576 --out "$RUN" ${TRAIN_ARGS:-}
mkdir -p mm_oval/zoo/tiny_llava576
cp "$RUN"/model/* mm_oval/zoo/tiny_llava576/
cp "$RUN"/vision_log.jsonl "$RUN"/build_report.json mm_oval/zoo/tiny_llava576/
rm -rf "$OUT/kvp"
"$BIN/mm-oval" train-kvp --model bundled576 --data zoo576:train:600 --heldout-samples 100 --out "$OUT/kvp" \
    --steps 600 --proj 32 --hidden 32 --compress image --sinks 3 --recent 0 --redundancy 4 --sigma 3
mkdir -p mm_oval/zoo/tiny_llava576_kvp_image
cp "$OUT"/kvp/kvp_agents.safetensors "$OUT"/kvp/kvp_config.json "$OUT"/kvp/heldout.json mm_oval/zoo/tiny_llava576_kvp_image/
rm -rf "$OUT/kvp_joint"  # the joint-heads agents (`agents=bundled576-image-joint`, with head_budget=shared)
"$BIN/mm-oval" train-kvp --model bundled576 --data zoo576:train:600 --heldout-samples 100 --out "$OUT/kvp_joint" \
    --steps 600 --proj 32 --hidden 32 --compress image --sinks 3 --recent 0 --redundancy 4 --sigma 3 --joint-heads
mkdir -p mm_oval/zoo/tiny_llava576_kvp_image_joint
cp "$OUT"/kvp_joint/kvp_agents.safetensors "$OUT"/kvp_joint/kvp_config.json "$OUT"/kvp_joint/heldout.json \
    mm_oval/zoo/tiny_llava576_kvp_image_joint/
for task in vqav2 mmbench pope objlist; do
    "$BIN/mm-oval" eval --model bundled576 --task "$task" --data bundled576 --out "$OUT/full-$task" \
        --batch-size 20 --no-progress
done
"$BIN/mm-oval" zoo check --model bundled576 --data bundled576 --json "$OUT/grounding.json" > /dev/null
BIN="$BIN" OUT="$OUT" scripts/sweep_bundled576.sh
