#!/usr/bin/env bash
# After retraining the bundled tiny LLaVA: install the new checkpoint and rebuild everything fingerprinted
# against it (KVP agents, router), then remeasure (full-cache scores, grounding, method sweeps, KVP tables).
#
#   scripts/rebuild_bundled.sh RUN_DIR [PREVIOUS_RUN_DIR ...]
#
# RUN_DIR is a finished `mm-oval zoo train --out RUN_DIR` run; PREVIOUS_RUN_DIRs are runs it was initialised
# from (--init-from), oldest first, whose logs are prepended to the committed train_log.jsonl. Every step
# writes under runs/bundled/ and resumes: rerunning the script skips finished evaluation cells.
set -euo pipefail
RUN=${1:?usage: scripts/rebuild_bundled.sh RUN_DIR [PREVIOUS_RUN_DIR ...]}
shift
BIN=${BIN:-.venv/bin}
OUT=runs/bundled
mkdir -p "$OUT"
test -f "$RUN/model/model.safetensors" || { echo "$RUN/model is not an exported checkpoint" >&2; exit 2; }

# 1. the checkpoint and its full training log
cp "$RUN"/model/* mm_oval/zoo/tiny_llava/
: > mm_oval/zoo/tiny_llava/train_log.jsonl
for prev in "$@" "$RUN"; do cat "$prev/train_log.jsonl" >> mm_oval/zoo/tiny_llava/train_log.jsonl; done

# 2. what is fingerprinted against it
rm -rf "$OUT/kvp"
"$BIN/mm-oval" train-kvp --model bundled --data zoo:train:1500 --heldout-samples 200 --out "$OUT/kvp" \
    --steps 600 --proj 32 --hidden 32
cp "$OUT"/kvp/kvp_agents.safetensors "$OUT"/kvp/kvp_config.json mm_oval/zoo/tiny_llava_kvp/
# agents trained on one ranking over a layer's heads, for the budget shared by the heads (same traces)
rm -rf "$OUT/kvp_joint" && mkdir -p "$OUT/kvp_joint" && cp -r "$OUT/kvp/traces" "$OUT/kvp_joint/"
"$BIN/mm-oval" train-kvp --model bundled --data zoo:train:1500 --heldout-samples 200 --out "$OUT/kvp_joint" \
    --steps 600 --proj 32 --hidden 32 --joint-heads
mkdir -p mm_oval/zoo/tiny_llava_kvp_joint
cp "$OUT"/kvp_joint/kvp_agents.safetensors "$OUT"/kvp_joint/kvp_config.json mm_oval/zoo/tiny_llava_kvp_joint/
"$BIN/mm-oval" train-router --out mm_oval/policies/router_tiny --image-tile 2 --threads 1 --data zoo:256 --val zoo:64 --epochs 20

# 3. full-cache scores and grounding
for task in vqav2 mmbench pope; do
    "$BIN/mm-oval" eval --model bundled --task "$task" --data bundled --out "$OUT/full-$task" --batch-size 32 \
        --no-progress
done
"$BIN/mm-oval" zoo check --json "$OUT/grounding.json" > /dev/null

# 4. every method against the image-KV budget, question-agnostic settings (scripts/sweep_bundled.sh)
BIN="$BIN" OUT="$OUT" scripts/sweep_bundled.sh

# 5. KVP tables: held-out cost of every method, ablations, head budgets, scoring cost
"$BIN/python" benchmarks/bench_kvp.py --model bundled --agents "$OUT/kvp" --heldout-traces "$OUT/kvp/traces/heldout" \
    --train-traces "$OUT/kvp/traces/train" --timing-samples 8 --work "$OUT/kvp_bench" --out "$OUT/kvp/bench.json" > "$OUT/bench_kvp.txt"
