#!/usr/bin/env bash
# Soak the pool model checker (crates/tessera-pool/tests/pool/model_check.rs): run batches of
# seeds on every layout until the time is up, JOBS batches at once, then print how many
# seeds and operations ran per layout and every failing seed (each failure prints its
# minimal replayable sequence in the log).
#
#   scripts/soak-model-check.sh [SECONDS] [BATCH]     # defaults: 1800 s, 20 seeds a batch
#   ALL=1 scripts/soak-model-check.sh                 # also the gated-off (known open) ops
#   LAYOUTS="raid5 ec" scripts/soak-model-check.sh    # only these layouts
#   BASE=2000000 scripts/soak-model-check.sh          # seeds from here (default 1000000)
#   JOBS=8 scripts/soak-model-check.sh                # batches at once (default 3 per core)
#
# A seed spends about two thirds of its wall time waiting (the per-device latency that
# makes I/Os overlap, the commit thread's interval), so batches run several per core.
#
# Replay one failure: TESSERA_MC_SEED=N cargo test --release -p tessera-pool \
#   --test pool model_check::model_check_LAYOUT -- --nocapture
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# One batch: `soak-model-check.sh --batch LAYOUT FIRST` (run by xargs below).
if [[ ${1:-} == --batch ]]; then
  l=$2 first=$3
  ((EPOCHSECONDS < SOAK_END)) || exit 0
  TESSERA_MC_FIRST_SEED=$first TESSERA_MC_SEEDS=$BATCH TESSERA_MC_ALL=${ALL:-0} \
    "$SOAK_BIN" "model_check::model_check_${l}" --exact --nocapture >"$SOAK_DIR/$l-$first.out" 2>&1 || true
  exit 0
fi

DURATION=${1:-1800}
BATCH=${2:-20}
# First seed of round 0 (a new soak can start past the seeds an earlier one ran).
BASE=${BASE:-1000000}
LAYOUTS=${LAYOUTS:-"concat raid0 raid1 raid10 raid5 raid6 ec dedup_concat dedup_raid1"}
LOG=${LOG:-target/soak-model-check.log}
JOBS=${JOBS:-$(($(nproc) * 3))}
mkdir -p "$(dirname "$LOG")"
: >"$LOG"

cargo test --release -p tessera-pool --test pool --no-run >/dev/null 2>&1 ||
  cargo test --release -p tessera-pool --test pool --no-run
SOAK_BIN=$(cargo test --release -p tessera-pool --test pool --no-run 2>&1 |
  grep -o 'target/release/deps/pool-[0-9a-f]*' | tail -1)
SOAK_DIR=$(mktemp -d)
trap 'rm -rf "$SOAK_DIR"' EXIT
SOAK_END=$((EPOCHSECONDS + DURATION))
export SOAK_BIN SOAK_DIR SOAK_END BATCH ALL

# Seeds of a soak start far above the CI ones (which start at 1000 per layout) and move
# on each round, so every round runs new sequences. The generator stops at the deadline;
# a batch that xargs starts after it exits at once.
(
  round=0
  while ((EPOCHSECONDS < SOAK_END)); do
    for l in $LAYOUTS; do echo "$l $((BASE + round * BATCH))"; done
    round=$((round + 1))
  done
) | xargs -P "$JOBS" -n 2 "$0" --batch

declare -A seeds ops fails
for l in $LAYOUTS; do seeds[$l]=0; ops[$l]=0; fails[$l]=""; done
for f in "$SOAK_DIR"/*.out; do
  [[ -e $f ]] || continue
  name=$(basename "$f" .out)
  l=${name%-*} first=${name##*-}
  out=$(cat "$f")
  printf '%s\n' "$out" >>"$LOG"
  if done_line=$(grep -E "^model check $l: [0-9]+ seeds" <<<"$out"); then
    seeds[$l]=$((seeds[$l] + $(awk '{print $4}' <<<"$done_line")))
    ops[$l]=$((ops[$l] + $(awk '{print $6}' <<<"$done_line")))
  elif fail_line=$(grep -E "^model check $l: seed [0-9]+ failed" <<<"$out" | head -1); then
    seed=$(awk '{print $5}' <<<"$fail_line")
    # The seeds before the failing one passed.
    seeds[$l]=$((seeds[$l] + seed - first + 1))
    fails[$l]+=" $seed"
  else
    echo "layout $l seeds $first+: the test neither passed nor reported a seed (see $LOG)" >&2
  fi
done

echo "model check soak: ${DURATION}s, ALL=${ALL:-0}, JOBS=$JOBS, log $LOG"
for l in $LAYOUTS; do
  printf '  %-7s %6d seeds %8d ops  failing seeds:%s\n' "$l" "${seeds[$l]}" "${ops[$l]}" "${fails[$l]:- none}"
done
