#!/bin/bash
# Nsight Compute profile of one forward kernel launch (GPU machine only).
#   bash benchmarks/ncu_forward.sh OUT_DIR NAME "CASE" [CONFIG]
# Writes OUT_DIR/NAME-details.txt (every section of `--set full`, with the
# run's log) and OUT_DIR/NAME-sass.csv (per-instruction counters and stall
# samples of the kernel's SASS). CASE is a bench_forward case name, CONFIG
# optional `key=value,...` overrides. Clocks are left as the card has them.
set -u
out=$1; name=$2; case_name=$3; config=${4:-}
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
rep=/tmp/ncu-$name
timeout 240 ncu --clock-control none --kernel-name regex:mosaic --launch-skip 1 --launch-count 1 \
  --set full --import-source no -f -o "$rep" \
  python3 benchmarks/profile_forward.py --case "$case_name" --config "$config" \
  > "$out/$name-details.txt" 2>&1
echo "ncu rc $?" >> "$out/$name-details.txt"
ncu -i "$rep.ncu-rep" --page details >> "$out/$name-details.txt" 2>&1
ncu -i "$rep.ncu-rep" --page source --csv --print-source sass > "$out/$name-sass.csv" 2>&1
