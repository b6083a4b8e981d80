#!/usr/bin/env bash
# Two ranks on one machine, on CPU (gloo): the same `sven train` under torchrun.
# Run from the repository root: bash docs/examples/two_ranks.sh
# Each rank owns half of the nodes' memory; the run is exact: it matches one process
# with the same global batch (up to float reduction order). OUT picks the folder.
set -euo pipefail
OUT=${OUT:-$(mktemp -d)}
SVEN=${SVEN:-.venv/bin/sven}
PY=$(dirname "$SVEN")/python

# The figures of step 3 need matplotlib, which the quick start's install leaves out:
# said first, and the step skipped, where it is missing.
PLOTS=1
if ! "$PY" -c "import matplotlib" 2>/dev/null; then
  PLOTS=0
  echo "note: no matplotlib here: step 3's figures are skipped (pip install -e '.[plot]' adds it)"
fi

# 1. A small synthetic store, and a partition that minimises the largest per-rank bytes.
"$SVEN" data synth --events 20000 --nodes 500 --seed 0 --out "$OUT/store"
"$SVEN" partition "$OUT/store" --parts 2 --strategy minmax --out "$OUT/part" --quiet

# 2. Train on two ranks: torchrun sets RANK/WORLD_SIZE/MASTER_*, Sven reads them.
"$PY" -m torch.distributed.run --standalone --nproc-per-node 2 -m sven train \
  data.path="$OUT/store" dist.partition="$OUT/part" dist.backend=gloo train.device=cpu \
  train.epochs="${EPOCHS:-2}" train.max_batches="${MAX_BATCHES:-0}" \
  model.memory_dim=32 model.embed_dim=32 out="$OUT/run"

# 3. Bytes per rank (naive vs redundancy-free) and the partition's balance, as PNGs.
if [ "$PLOTS" = 1 ]; then
  "$SVEN" plot "$OUT/run"
  "$SVEN" plot "$OUT/part"
fi
echo "run folder: $OUT/run"
