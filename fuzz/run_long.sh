#!/usr/bin/env bash
# Long fuzz campaign: every target for RUNS inputs (default 1,000,000), violations recorded
# and the run continued (FUZZ_FINDINGS), two targets at a time. Logs, corpora and findings go
# under fuzz/out/, fuzz/corpus/ and fuzz/findings/ (ignored by git); the numbers are then
# copied into fuzz/RESULTS.md by hand.
#
#   fuzz/run_long.sh                 # all targets, 1M inputs each
#   RUNS=100000 fuzz/run_long.sh header slicing
set -u
cd "$(dirname "$0")"
PY=${PY:-../.venv/bin/python}
RUNS=${RUNS:-1000000}
mkdir -p out corpus findings seeds
"$PY" seeds.py seeds

run() {
  local t=$1 seeds=$2 maxlen=$3
  mkdir -p "corpus/$t"
  local start=$(date +%s)
  FUZZ_FINDINGS="findings/$t" nice -n 10 "$PY" "fuzz_$t.py" -runs="$RUNS" -max_len="$maxlen" \
    -timeout=30 -rss_limit_mb=3072 -print_final_stats=1 "corpus/$t" "seeds/$seeds" \
    > "out/$t.log" 2>&1
  local rc=$?
  echo "$t rc=$rc seconds=$(( $(date +%s) - start ))" | tee -a out/summary.txt
}

targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(header safe_open slicing differential pickle safe_open_torch streaming validate)
seeds_for() { [ "$1" = pickle ] && echo pickle || echo safetensors; }
maxlen_for() { [ "$1" = pickle ] && echo 65536 || echo 16384; }

# Two lanes on a two-core machine.
lane() { for t in "$@"; do run "$t" "$(seeds_for "$t")" "$(maxlen_for "$t")"; done; }
a=(); b=()
for i in "${!targets[@]}"; do
  if (( i % 2 == 0 )); then a+=("${targets[$i]}"); else b+=("${targets[$i]}"); fi
done
lane "${a[@]}" &
[ ${#b[@]} -gt 0 ] && lane "${b[@]}" &
wait
