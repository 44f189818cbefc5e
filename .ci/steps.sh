# Step timing for the CI scripts, sourced (not run):
#
#   source .ci/steps.sh
#   step clippy
#   cargo clippy ...
#   step docs
#   bash .ci/docs
#
# `step NAME` ends the step before it and starts NAME; each step that ends
# prints `step NAME: N s`. Set as the EXIT trap (or called from it),
# `steps_summary` ends the last step, marked FAILED when the script exits
# with an error, and prints every step's time in one table, so a failed or
# stopped run says where its time went too. Steps are delimited, not
# wrapped: the commands between two `step`s run as they would without
# them, under the script's own `set -e`.

steps_done=()
step_name=
step_started=0

# Ends the running step, if any, as `$1` (ok unless told).
step_end() {
  [ -n "$step_name" ] || return 0
  local took=$((SECONDS - step_started))
  echo "step $step_name: $took s${1:+ ($1)}"
  steps_done+=("$step_name|$took|${1:-ok}")
  step_name=
}

# Starts step `$1`, ending the one before.
step() {
  step_end
  step_name=$1
  step_started=$SECONDS
  echo "::: step $1"
}

# Ends the last step (FAILED when the script's status, or `$1`, is not 0)
# and prints the table of every step's time.
steps_summary() {
  local status=${1:-$?} entry name took result
  [ "$status" -eq 0 ] && step_end || step_end FAILED
  [ ${#steps_done[@]} -gt 0 ] || return 0
  echo "::: steps (${0##*/}, $SECONDS s in all)"
  for entry in "${steps_done[@]}"; do
    IFS='|' read -r name took result <<<"$entry"
    printf ':::   %-22s %5s s  %s\n' "$name" "$took" "$result"
  done
}
