#!/bin/bash
# Nsight Compute profile of one call of an sm90 kernel (GPU machine only).
#   bash tools/ncu_profile.sh OUT_DIR NAME forward|backward "CASE" [CONFIG] [EXTRA...]
# Writes OUT_DIR/NAME-details.txt (every section of `--set full`, with the
# run's log) and OUT_DIR/NAME-sass.csv (per-instruction counters and stall
# samples of the kernels' SASS). CASE is a case name of bench_forward.py or
# bench_backward.py, CONFIG optional `key=value,...` overrides, EXTRA more
# arguments of profile_kernel.py (e.g. --soft-cap 50). The warm-up
# call's kernels are skipped: one Mosaic GPU kernel per forward call, two per
# backward call (dK/dV, then dQ), all of the second call
# are profiled.
# Clocks are left as the card has them.
set -u
out=$1; name=$2; pass=$3; case_name=$4; config=${5:-}; shift 5 2>/dev/null || shift $#
case $pass in
  forward) kernels=1 ;;
  backward) kernels=2 ;;
  *) echo "pass must be forward or backward; got $pass" >&2; exit 2 ;;
esac
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
rep=/tmp/ncu-$name
timeout 300 ncu --clock-control none --kernel-name regex:mosaic --launch-skip $kernels \
  --launch-count $kernels --set full --import-source no -f -o "$rep" \
  python3 tools/profile_kernel.py "$pass" --case "$case_name" --config "$config" "$@" \
  > "$out/$name-details.txt" 2>&1
echo "ncu rc $?" >> "$out/$name-details.txt"
ncu -i "$rep.ncu-rep" --page details >> "$out/$name-details.txt" 2>&1
ncu -i "$rep.ncu-rep" --page source --csv --print-source sass > "$out/$name-sass.csv" 2>&1
