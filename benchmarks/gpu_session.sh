#!/usr/bin/env bash
# The GPU checks the open performance work needs, as named phases, for a lent machine
# with no package index (docs/benchmarks.md, "A GPU session").
#
# Usage, from the repository root (on the GPU machine):
#   bash benchmarks/gpu_session.sh PHASE [PHASE ...]
#
# Inputs:
#   $OUT            where results go (default ./gpu-out); each phase writes $OUT/PHASE/
#                   and $OUT/PHASE.log as it goes, so a phase cut off keeps what it had.
#   $SVEN_GPU_DATA  a folder with wikipedia.csv.gz (JODIE's Wikipedia) and
#                   CollegeMsg.txt.gz (SNAP), default .device_data; docs/data.md says
#                   where they come from.
#   $SVEN_GPU_WHEELS  wheels to install offline before anything (pymetis, pytest-xdist,
#                   execnet, pooch, platformdirs), default .whl; skipped where absent.
#   $SVEN_GPU_STORES  where the converted stores go (default $TMPDIR/sven-gpu-stores);
#   $SVEN_GPU_SITE  where the wheels are installed (default $TMPDIR/sven-gpu-site), put
#                   on PYTHONPATH.
#   $SVEN_BEFORE    for phase `pair`: a folder holding another tree of the repository
#                   (`git archive REV | tar -x -C DIR`), timed beside this one.
#
# Phases (seconds on one H100/H200 in brackets, Triton's cache empty):
#   setup       wheels, `pip install -e .` offline, the two stores          [40]
#   suite       the whole `pytest -m gpu` on 6 workers, failures rerun alone [400]
#               ($SVEN_SUITE_PATHS: test files or folders to run instead)
#   step        kernels per step and events/s of the captured step: four
#               models on Wikipedia, TGN on CollegeMsg                       [150]
#   candidates  the opt-in kernels (SVEN_KERNELS=auto,NAME=triton) one by one
#               and together, each profiled beside the defaults              [200]
#   pyg         Sven against PyG's TGN, 3 epochs, Wikipedia and CollegeMsg  [300]
#   mrr         100 MRR negatives against one, 2 epochs each ($SVEN_MRR_REPEATS
#               pairs, default 1, and their medians; and $SVEN_MRR_AB:
#               TAG:ENV=VALUE;ENV=VALUE items, a 100-negative run each), and the
#               evaluation profile at 100 (its costliest kernels)           [160]
#   mrrab       the evaluation profile at 100 MRR negatives for each factored-attention
#               launch setting (SVEN_FACTORED_WARPS:SVEN_FACTORED_CHUNK pairs in
#               $SVEN_FACTORED_AB, default "8:256 8:64 4:64 4:32 2:64")          [130]
#   evalab      the evaluation profile at 100 MRR negatives with the defaults and
#               with other kernel choices ($SVEN_EVAL_AB: space-separated
#               TAG:ENV=VALUE;ENV=VALUE items; default: the cosine by polynomial,
#               the scorer's wide tile on 4 warps, the default before 8)     [60]
#   factored    the factored evaluation kernel alone at the MRR batch's shape, with one
#               part left out or one size changed per case (bench_factored.py), for
#               each kernel (SVEN_FACTORED_KERNEL: tiles, dot, split), and Nsight Compute's view of one
#               launch of each on the MRR case (occupancy, stalls, issue)     [90]
#   ttr         start-up against the floor, the 3-epoch preset on an empty
#               and on a warm cache, and on an empty one with
#               SVEN_COMPILE_AHEAD=0                                        [260]
#   b600        batch 600 on the 10^7-event synthetic graph                  [300]
#   scale       the host tier against the GPU tier at 10^7 nodes             [560]
#   tiers       the captured step's kernels with state on the GPU and in pinned
#               host memory (rows read ahead: host, by the copy engine:
#               host-copy, by the SMs: host-sm; read at the step: host-at-step;
#               at most N rows kept in GPU memory: host-hotN, e.g. host-hot0, host-hot1e6),
#               batch 600, 10^6 nodes ($SVEN_TIERS_NODES;
#               $SVEN_TIERS_ARMS picks arms; $SVEN_TIERS_RELABEL=1 also on
#               the ids by activity; $SVEN_TIERS_TAG names a repeat, e.g. one
#               per SVEN_AHEAD_PROGRAMS; $SVEN_TIERS_WARMUP steps before the
#               profile, default 30: more touch more of the table) (profile_step.py) [130]
#   uva         row gathers over pinned host memory, 1.2 against 12 GB tables
#               (bench_uva.py)                                               [60]
#   copyjob     the copy-engine read-ahead's job alone: a host thread's gather
#               of 1,944 / 3,403 / 5,184 random rows of 10^7 and their copy over,
#               by intra-op threads (bench_copy_ahead.py)                    [90]
#   predict     answers from the checkpoint of a 10^8-node run               [560]
#   pair        Wikipedia batch-200 warm events/s, $SVEN_BEFORE against this [200]
#   warmup      where the first step's seconds go on a warm Triton cache: the
#               Wikipedia preset (one epoch) under cProfile, its top functions   [60]
#   pack        last: the key lines of every log in $OUT/summary.txt and the small
#               result files in $OUT/results.tgz, the rest removed (the device
#               tool brings back at most 8 files of at most 16 MiB)             [5]
set -uo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-$PWD/gpu-out}
DATA=${SVEN_GPU_DATA:-.device_data}
WHEELS=${SVEN_GPU_WHEELS:-.whl}
TMP=${TMPDIR:-/tmp}
STORES=${SVEN_GPU_STORES:-$TMP/sven-gpu-stores}
SITE=${SVEN_GPU_SITE:-$TMP/sven-gpu-site}
PY=${PYTHON:-python3}
mkdir -p "$OUT" "$STORES"

log() { echo "[$(date +%H:%M:%S)] $*"; }

# Runs "$@" with its output in $OUT/$phase.log (and on stdout), never stopping the
# script: a failed step is named in the log and the next one runs.
step() {
  local limit=$1
  shift
  log "+ $*"
  timeout "$limit" "$@" 2>&1 | tee -a "$OUT/$phase.log"
  local rc=${PIPESTATUS[0]}
  [ "$rc" = 0 ] || log "exit $rc: $*" | tee -a "$OUT/$phase.log"
  return 0
}

# step, under the settings of a TAG:ENV=VALUE;ENV=VALUE item (TAG: for none):
# ab_step LIMIT ITEM CMD...
ab_step() {
  local limit=$1 envs=${2#*:}
  shift 2
  # shellcheck disable=SC2086  # the ;-separated settings become env's arguments
  step "$limit" env ${envs//;/ } "$@"
}

need_stores() {
  [ -f "$STORES/wiki/meta.json" ] || phase_setup
}

phase_setup() {
  if [ -d "$WHEELS" ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    step 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" \
      "$WHEELS"/*.whl
  fi
  step 120 "$PY" -m pip install -q --no-deps --no-build-isolation -e .
  for pair in "wiki wikipedia.csv.gz jodie" "cm CollegeMsg.txt.gz snap"; do
    set -- $pair
    [ -f "$STORES/$1/meta.json" ] && continue
    [ -f "$DATA/$2" ] || { log "missing $DATA/$2"; continue; }
    "$PY" -m sven data convert "$DATA/$2" --format "$3" --out "$STORES/$1"
  done
}

phase_suite() {
  local xdist=()
  "$PY" -c "import xdist" 2>/dev/null && xdist=(-n 6)
  step 560 "$PY" -m pytest -m gpu -q -rf -p no:cacheprovider "${xdist[@]}" \
    --durations=25 --junitxml="$OUT/suite/junit.xml" ${SVEN_SUITE_PATHS:-}
  # Failures alone: a failure under load that passes alone is named as such.
  grep -o 'FAILED [^ ]*' "$OUT/suite.log" | sed 's/^FAILED //' | sort -u | head -20 \
    > "$OUT/suite/failed.txt"
  if [ -s "$OUT/suite/failed.txt" ]; then
    step 300 "$PY" -m pytest -q -rf -p no:cacheprovider $(cat "$OUT/suite/failed.txt")
  fi
}

phase_step() {
  need_stores
  for m in tgn jodie dyrep apan; do
    step 120 "$PY" benchmarks/profile_step.py --data "$STORES/wiki" --out "$OUT/step/wiki-$m" \
      train.cuda_graph=on model.name=$m
  done
  step 120 "$PY" benchmarks/profile_step.py --data "$STORES/cm" --out "$OUT/step/cm-tgn" \
    train.cuda_graph=on
}

phase_tiers() {
  # The host tier's step beside the GPU tier's, batch 600, on 10^6 nodes (a 1.2 GB
  # pinned table is already far from every cache) or $SVEN_TIERS_NODES (1e7: the
  # 12 GB table of `scale`, to see which kernels grow with the table).
  local nodes=${SVEN_TIERS_NODES:-1e6}
  local g="$STORES/synth-$nodes" n
  n=$("$PY" -c "print(int(float('$nodes')))")
  [ -f "$g/meta.json" ] || step 240 "$PY" -m sven data synth --events 10000000 \
    --nodes "$n" --seed 0 --out "$g"
  local stores=("$g") tag=${SVEN_TIERS_TAG:+-$SVEN_TIERS_TAG}
  # $SVEN_TIERS_RELABEL=1: the same arms on a copy with the ids by activity (the hot
  # rows on few pages), to see whether the host tier pays for where its rows lie.
  if [ "${SVEN_TIERS_RELABEL:-0}" = 1 ]; then
    [ -f "$g-act/meta.json" ] || step 240 "$PY" benchmarks/relabel_store.py "$g" "$g-act"
    stores+=("$g-act")
  fi
  # The host tier with its rows read ahead (the default) and read at the step.
  for store in "${stores[@]}"; do
    for arm in ${SVEN_TIERS_ARMS:-gpu host host-copy host-at-step}; do
      local tier=${arm%%-*} ahead=1
      [ "$arm" = host-at-step ] && ahead=0
      # host-sm, host-copy: rows read ahead by the SM gather or the copy engine
      # (host: the default of the two).
      [ "$arm" = host-sm ] && ahead=sm
      [ "$arm" = host-copy ] && ahead=copy
      # host-hotN: at most N rows kept in GPU memory (state.hot_rows; host-hot0: none);
      # the other host arms keep the default (every node with an event, budget allowing).
      local hot=-1
      case $arm in host-hot*) hot=$("$PY" -c "print(int(float('${arm#host-hot}')))") ;; esac
      local dir="$OUT/tiers/$(basename "$store")-$arm$tag"
      SVEN_READ_AHEAD=$ahead step 200 "$PY" benchmarks/profile_step.py --data "$store" \
        --out "$dir" --warmup "${SVEN_TIERS_WARMUP:-30}" --trace train.batch_size=600 \
        state.device=$tier state.hot_rows=$hot
      # The timeline is too large to bring back: its per-stream view goes to the log.
      for tr in "$dir"/trace_*.json.gz; do
        [ -f "$tr" ] && step 60 "$PY" benchmarks/trace_streams.py "$tr" --steps 20
      done
    done
  done
}

phase_uva() {
  # Row gathers and scatters over pinned host memory, 10^6 against 10^7 rows of a
  # state row's size, new rows each repetition, pinned as the host tier pins and by
  # cudaHostAlloc: whether the host tier's loss at 10^7 nodes is the table's size.
  step 150 "$PY" benchmarks/bench_uva.py --sizes 1e6 1e7 --out "$OUT/uva.json"
}

phase_copyjob() {
  # What the ring's step must hide with rows read by the copy engine: request to rows
  # on the device, and the host gather alone, at the row counts of a batch of 600
  # early and late in the 10^7-node run (benchmarks/batch_rows.py).
  step 150 "$PY" benchmarks/bench_copy_ahead.py --nodes 1e7 --rows 1944 3403 5184 \
    --out "$OUT/copyjob.json"
}

phase_candidates() {
  need_stores
  step 120 "$PY" benchmarks/profile_step.py --data "$STORES/wiki" --out "$OUT/candidates/auto" \
    train.cuda_graph=on
  local all=""
  for k in dedupe_sort param_grads adam_step; do
    all="$all,$k=triton"
    SVEN_KERNELS=auto,$k=triton step 120 "$PY" benchmarks/profile_step.py \
      --data "$STORES/wiki" --out "$OUT/candidates/$k" train.cuda_graph=on
  done
  SVEN_KERNELS=auto$all step 120 "$PY" benchmarks/profile_step.py --data "$STORES/wiki" \
    --out "$OUT/candidates/all" train.cuda_graph=on
  # The time encoding's cosine as libdevice's cosf alone (the default reduces it first).
  SVEN_TRITON_COS=libdevice step 120 "$PY" benchmarks/profile_step.py \
    --data "$STORES/wiki" --out "$OUT/candidates/cos-libdevice" train.cuda_graph=on
  # ... and as a polynomial without cosf (an opt-in).
  SVEN_TRITON_COS=poly step 120 "$PY" benchmarks/profile_step.py \
    --data "$STORES/wiki" --out "$OUT/candidates/cos-poly" train.cuda_graph=on
  SVEN_KERNELS=auto$all step 300 "$PY" -m pytest -q -rf -p no:cacheprovider \
    tests/kernels/test_dedupe_kernel.py tests/kernels/test_adam_kernel.py \
    tests/integration/test_cuda_step.py
}

phase_pyg() {
  need_stores
  for s in wiki cm; do
    step 300 "$PY" benchmarks/bench_vs_pyg.py --data "$STORES/$s" --device cuda --epochs 3 \
      --repeats 1 --out "$OUT/pyg/$s.json"
  done
}

phase_mrr() {
  # The one-negative rate swings by a fifth between runs of the same code (its metrics
  # are host-bound): $SVEN_MRR_REPEATS pairs (default 1), each pair's ratio and the
  # ratio of the medians. Folders are replaced, so the phase may run again.
  need_stores
  local common=(--config configs/tgn.yaml "data.path=$STORES/wiki" train.epochs=2
    train.patience=0 train.overwrite=true --quiet)
  local r
  for r in $(seq 1 "${SVEN_MRR_REPEATS:-1}"); do
    step 150 "$PY" -m sven train "${common[@]}" "out=$OUT/mrr/r$r/one"
    step 200 "$PY" -m sven train "${common[@]}" "out=$OUT/mrr/r$r/mrr100" \
      eval.mrr_negatives=100
  done
  # $SVEN_MRR_AB: TAG:ENV=VALUE;ENV=VALUE items, each a 100-negative run of its own
  # against the first pair's one-negative run (the ratio a candidate default would give).
  local ab
  [ -n "${SVEN_MRR_AB:-}" ] && for ab in $SVEN_MRR_AB; do
    ab_step 200 "$ab" "$PY" -m sven train "${common[@]}" \
      "out=$OUT/mrr/r1/mrr100-${ab%%:*}" eval.mrr_negatives=100
  done
  "$PY" - "$OUT/mrr" <<'EOF' 2>&1 | tee -a "$OUT/$phase.log"
import json, statistics, sys
from pathlib import Path

def val_rate(run):
    if not (run / "summary.json").exists():
        return None
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    rates = [r["val_events_per_s"] for r in rows if "val_events_per_s" in r]
    return rates[-1] if rates else None

d = Path(sys.argv[1])
ones, mrrs = [], []
for pair in sorted(d.glob("r[0-9]*"), key=lambda p: int(p.name[1:])):
    one = val_rate(pair / "one")
    for run in sorted(p.name for p in pair.glob("mrr100*")):
        mrr = val_rate(pair / run)
        if one is None or mrr is None:
            continue
        if run == "mrr100":
            ones.append(one)
            mrrs.append(mrr)
        test = json.loads((pair / run / "summary.json").read_text()).get("test_mrr")
        print(f"{pair.name} {run}: val events/s one negative {one:,.0f}, 100 MRR negatives "
              f"{mrr:,.0f}, ratio {mrr / one:.3f}; test MRR {test}")
if len(ones) > 1:
    one, mrr = statistics.median(ones), statistics.median(mrrs)
    print(f"medians of {len(ones)} pairs: one negative {one:,.0f}, 100 MRR negatives "
          f"{mrr:,.0f}, ratio {mrr / one:.3f}")
EOF
  step 150 "$PY" benchmarks/profile_eval.py --data "$STORES/wiki" --out "$OUT/mrr/profile" \
    eval.mrr_negatives=100
}

# The warm MRR batch's profile (profile_eval.py, 100 negatives) under each setting into
# $OUT/$phase, then a line per setting and split: the factored kernel's time, the
# batch's, and its costliest kernels. Arguments: TAG:ENV=VALUE;ENV=VALUE items ("TAG:"
# for the defaults).
eval_profiles() {
  need_stores
  local ab
  for ab in "$@"; do
    ab_step 150 "$ab" "$PY" benchmarks/profile_eval.py --data "$STORES/wiki" \
      --out "$OUT/$phase" --tag "${ab%%:*}" --train-batches 20 --profile-batches 5 \
      eval.mrr_negatives=100 > /dev/null
  done
  "$PY" - "$OUT/$phase" <<'EOF' 2>&1 | tee -a "$OUT/$phase.log"
import json, sys
from pathlib import Path

for f in sorted(Path(sys.argv[1]).glob("profile_eval_*.json")):
    d = json.loads(f.read_text())
    for split in ("val", "test"):
        r = d[split]
        fac = sum(k["us_per_batch"] for k in r["top_kernels"] if "factored" in k["name"])
        top = ", ".join(f"{k['name'][:40]} {k['us_per_batch']:.1f}" for k in r["top_kernels"][:8])
        print(f"{d['tag']} {split}: factored kernel {fac:.1f} us/batch, GPU "
              f"{r['step']['gpu_us']:.1f} us/batch, warm {r['ms_per_batch_warm']:.3f} "
              f"ms/batch, {r['events_per_s_warm']:,.0f} events/s; metrics warm "
              f"{r.get('metrics2_s', float('nan')) * 1e3:.1f} ms, with them "
              f"{r.get('events_per_s_warm_with_metrics', float('nan')):,.0f} events/s; {top}")
EOF
}
phase_evalab() {
  local abs=("defaults:" "cos-poly:SVEN_TRITON_COS=poly"
    "decoder-w4:SVEN_DECODER_TILE=64x32x128:4")
  [ -n "${SVEN_EVAL_AB:-}" ] && read -r -a abs <<< "$SVEN_EVAL_AB"
  eval_profiles "${abs[@]}"
}
phase_mrrab() {
  local ab items=()
  for ab in ${SVEN_FACTORED_AB:-8:256 8:64 4:64 4:32 2:64}; do
    items+=("w${ab%%:*}-c${ab##*:}:SVEN_FACTORED_WARPS=${ab%%:*};SVEN_FACTORED_CHUNK=${ab##*:}")
  done
  eval_profiles "${items[@]}"
}

phase_factored() {
  step 200 "$PY" benchmarks/bench_factored.py --out "$OUT/factored"
  local kernel
  for kernel in dot split; do
    SVEN_FACTORED_KERNEL=$kernel step 200 "$PY" benchmarks/bench_factored.py \
      --out "$OUT/factored/$kernel"
  done
  if command -v ncu >/dev/null; then
    # The MRR store's case (no edges, queries per node) under each kernel
    # (SVEN_FACTORED_KERNEL): the pipes, the schedulers' issue, the stalls, the
    # instructions by opcode (benchmarks/count_sass.py counts them without a GPU).
    for kernel in tiles dot split; do
      SVEN_FACTORED_KERNEL=$kernel step 200 ncu --clock-control none \
        --kernel-name regex:_factored_ --launch-skip 1 --launch-count 1 --section SpeedOfLight \
        --section Occupancy --section LaunchStats --section WarpStateStats \
        --section ComputeWorkloadAnalysis --section InstructionStats --section SchedulerStats \
        "$PY" benchmarks/bench_factored.py --once --case "no edges, per-node queries"
    done
  fi
}

phase_ttr() {
  step 200 "$PY" benchmarks/bench_ttr.py --startup 5 --wiki "$DATA/wikipedia.csv.gz" \
    --out "$OUT/ttr/startup"
  step 300 "$PY" benchmarks/bench_ttr.py --skip-syn7 --wiki "$DATA/wikipedia.csv.gz" \
    --out "$OUT/ttr/preset" --deadline-s 280
  # The empty cache again with the kernels compiled one by one at their first launch.
  SVEN_COMPILE_AHEAD=0 step 300 "$PY" benchmarks/bench_ttr.py --skip-syn7 \
    --wiki "$DATA/wikipedia.csv.gz" --out "$OUT/ttr/preset-one-by-one" --deadline-s 280
}

phase_b600() {
  # Two epochs: the first pays the capture's warm-up at batch 600 (new shapes).
  step 560 "$PY" benchmarks/bench_ttr.py --skip-small --large 1e7 --large-epochs 2 \
    --out "$OUT/b600" --deadline-s 540
}

phase_scale() {
  step 580 "$PY" benchmarks/bench_scale.py --graph 1e7 --out "$OUT/scale" --deadline-s 560
}

phase_predict() {
  step 580 "$PY" benchmarks/bench_scale.py --graph 1e8 --skip-replay --out "$OUT/predict" \
    --deadline-s 560
}

phase_pair() {
  need_stores
  [ -d "${SVEN_BEFORE:-}" ] || { log "phase pair needs SVEN_BEFORE=DIR"; return 0; }
  local here=$PWD
  # Alternating trees, two rounds, so that a drift of the machine shows in both; each
  # tree installed in turn (its packages map sven.partition and the rest to its own
  # folders), and this tree's install put back at the end.
  for round in 1 2; do
    for tree in before after; do
      local dir=$here
      [ "$tree" = before ] && dir=$(cd "$SVEN_BEFORE" && pwd)
      "$PY" -m pip install -q --no-deps --no-build-isolation -e "$dir"
      (cd "$dir" && step 300 "$PY" benchmarks/bench_vs_pyg.py --data "$STORES/wiki" \
        --device cuda --epochs 2 --repeats 1 --sides sven --out "$OUT/pair/$tree-$round.json")
    done
  done
  "$PY" -m pip install -q --no-deps --no-build-isolation -e "$here"
}

phase_warmup() {
  need_stores
  local common=(--config configs/tgn.yaml "data.path=$STORES/wiki" train.epochs=1 --quiet)
  # The first run fills Triton's cache for these shapes; the second is the one profiled.
  step 200 "$PY" -m sven train "${common[@]}" "out=$OUT/warmup/fill"
  step 200 "$PY" -m cProfile -o "$OUT/warmup/run.prof" -m sven train "${common[@]}" \
    "out=$OUT/warmup/run"
  "$PY" - "$OUT/warmup" <<'EOF' 2>&1 | tee -a "$OUT/$phase.log"
import json, pstats, sys
from pathlib import Path

d = Path(sys.argv[1])
s = json.loads((d / "run" / "summary.json").read_text())
print({k: v for k, v in s.items() if k.startswith("startup_") or k.endswith("warmup_s")})
st = pstats.Stats(str(d / "run.prof"))
st.sort_stats("cumulative").print_stats(45)
st.sort_stats("tottime").print_stats(25)
EOF
  rm -rf "$OUT/warmup/fill" "$OUT/warmup/run"
}

phase_pack() {
  # The device tool returns at most 8 files: one summary, one archive of the small
  # results (logs, JSON, text; no checkpoints or stores), and nothing else.
  local pattern='kernels per step|"events_per_s"|paired by repeat|ratio|passed|failed|'
  pattern+='phase [a-z0-9]+: [0-9]+ s|warm_train_events_per_s|beyond_floor|events/s|exit [0-9]|'
  pattern+='job_ms|triton_compiles_total|train_graph_warmup_s|startup_first_step_s|_ahead_|GB/s|gather_ms|'
  pattern+='Achieved Occupancy|Registers Per Thread|Memory Throughput|DRAM Throughput|Duration'
  for f in "$OUT"/*.log; do
    [ -f "$f" ] || continue
    echo "== $(basename "$f")"
    grep -E "$pattern" "$f" | cut -c1-400
  done > "$OUT/summary.tmp"
  (cd "$OUT" && find . -type f -size -4M \( -name '*.log' -o -name '*.json' -o -name '*.txt' \
    -o -name '*.jsonl' -o -name '*.md' -o -name '*.prof' \) ! -name summary.tmp -print0 \
    | tar --null -czf "$TMP/sven-results.tgz" -T -)
  find "$OUT" -mindepth 1 -maxdepth 1 ! -name summary.tmp -exec rm -rf {} +
  mv "$TMP/sven-results.tgz" "$OUT/results.tgz"
  mv "$OUT/summary.tmp" "$OUT/summary.txt"
  cat "$OUT/summary.txt"
}

[ $# -gt 0 ] || { sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 2; }
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
for phase in "$@"; do
  if [ "$phase" = pack ]; then
    phase_pack
    continue
  fi
  mkdir -p "$OUT/$phase"
  log "phase $phase" | tee -a "$OUT/$phase.log"
  start=$(date +%s)
  if declare -F "phase_$phase" >/dev/null; then
    "phase_$phase"
  else
    log "no phase $phase"
    exit 2
  fi
  log "phase $phase: $(($(date +%s) - start)) s" | tee -a "$OUT/$phase.log"
done
