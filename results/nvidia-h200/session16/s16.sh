#!/bin/bash
# Session 16 device script. usage: bash results/nvidia-h200/session16/s16.sh BUDGET_MIN PART [PART...]
# Each PART runs in the background at once (10 s apart); at the end their logs are bundled into $OUT.
#   B:  bf16 law grid, the cells still missing: 2m x 25M, 50M, 100M and 11m x 100M, seed 0     (#15)
#   Q:  quartet  at 2m, 11m x 25M, 100M tokens, seed 0 (effN, effD)                             (#15)
#   N:  nvfp4    at 2m, 11m x 25M, 100M tokens, seed 0                                          (#15)
#   Q2: quartet2 at 2m, 11m x 25M, 100M tokens, seed 0                                          (#15)
set -u
export PYTHONUNBUFFERED=1
T0=$(date +%s)
BUDGET=$1; shift
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
if [ ! -f data/pycode/train.bin ]; then python3 data/pycode/prepare.py > $OUT/prepare.log 2>&1; fi
tail -1 $OUT/prepare.log 2>/dev/null
left() { python3 -c "print($BUDGET - ($(date +%s) - $T0) / 60)"; }
S="python3 study.py run --seeds=0"
part() {
  case $1 in
    B)  $S --recipes=bf16 --sizes=2m,11m --tokens=25e6,50e6,100e6 --budget_min=$(left) --bundle=$OUT/study_B.tar.gz ;;
    Q)  $S --recipes=quartet --sizes=2m,11m --tokens=25e6,100e6 --budget_min=$(left) --bundle=$OUT/study_Q.tar.gz ;;
    N)  $S --recipes=nvfp4 --sizes=2m,11m --tokens=25e6,100e6 --budget_min=$(left) --bundle=$OUT/study_N.tar.gz ;;
    Q2) $S --recipes=quartet2 --sizes=2m,11m --tokens=25e6,100e6 --budget_min=$(left) --bundle=$OUT/study_Q2.tar.gz ;;
  esac
}
for p in "$@"; do part $p > /tmp/part_$p.log 2>&1 & sleep 10; done
wait
for p in "$@"; do echo "== $p"; grep -v "^step\|^iter" /tmp/part_$p.log | tail -20; done
tar czf $OUT/logs.tar.gz -C out study /tmp/part_*.log 2>/dev/null
ls $OUT; echo "elapsed $(( $(date +%s) - T0 )) s"
