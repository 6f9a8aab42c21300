#!/usr/bin/env bash
# Soak the pool model checker (crates/tessera-pool/tests/model_check.rs): run batches of
# seeds on every layout until the time is up, then print how many seeds and operations
# ran per layout and every failing seed (each failure prints its minimal replayable
# sequence in the log).
#
#   scripts/soak-model-check.sh [SECONDS] [BATCH]     # defaults: 1800 s, 20 seeds a batch
#   ALL=1 scripts/soak-model-check.sh                 # also the gated-off (known open) ops
#   LAYOUTS="raid5 ec" scripts/soak-model-check.sh    # only these layouts
#   BASE=2000000 scripts/soak-model-check.sh          # seeds from here (default 1000000)
#
# Replay one failure: TESSERA_MC_SEED=N cargo test --release -p tessera-pool \
#   --test model_check model_check_LAYOUT -- --nocapture
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

DURATION=${1:-1800}
BATCH=${2:-20}
# First seed of round 0 (a new soak can start past the seeds an earlier one ran).
BASE=${BASE:-1000000}
LAYOUTS=${LAYOUTS:-"concat raid0 raid1 raid10 raid5 raid6 ec"}
LOG=${LOG:-target/soak-model-check.log}
mkdir -p "$(dirname "$LOG")"
: >"$LOG"

cargo test --release -p tessera-pool --test model_check --no-run >/dev/null 2>&1 ||
  cargo test --release -p tessera-pool --test model_check --no-run

declare -A seeds ops fails
for l in $LAYOUTS; do seeds[$l]=0; ops[$l]=0; fails[$l]=""; done

# Seeds of a soak start far above the CI ones (which start at 1000 per layout) and move
# on each round, so every round runs new sequences.
round=0
end=$((SECONDS + DURATION))
while ((SECONDS < end)); do
  for l in $LAYOUTS; do
    ((SECONDS < end)) || break
    first=$((BASE + round * BATCH))
    out=$(TESSERA_MC_FIRST_SEED=$first TESSERA_MC_SEEDS=$BATCH TESSERA_MC_ALL=${ALL:-0} \
      cargo test --release -q -p tessera-pool --test model_check "model_check_${l}" \
      -- --exact --nocapture 2>&1) || true
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
      echo "layout $l: the test neither passed nor reported a seed (see $LOG)" >&2
    fi
  done
  round=$((round + 1))
done

echo "model check soak: ${DURATION}s, ALL=${ALL:-0}, log $LOG"
for l in $LAYOUTS; do
  printf '  %-7s %6d seeds %8d ops  failing seeds:%s\n' "$l" "${seeds[$l]}" "${ops[$l]}" "${fails[$l]:- none}"
done
