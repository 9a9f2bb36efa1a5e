#!/bin/bash
# Session 15 device script. usage: bash .devrun/s15.sh BUDGET_MIN PART [PART...]
# Each PART runs in the background at once (15 s apart); at the end their logs are bundled into $OUT.
#   E: fullstack 30m 13M, BF16 ends, the default refits (0, 50, 100, 200, ...), seeds 0-2   (#14)
#   R: the same with --lora_rank=96 (the default at 30m is 48), seeds 0-2                  (#14)
#   L: bf16 law grid 5m, 11m, 20m, 30m x 25M, 50M, 100M tokens, seed 0                     (#15)
#   F: quartet and nvfp4 at 5m, 20m x 25M, 100M tokens, seed 0 (effN, effD)               (#15)
set -u
export PYTHONUNBUFFERED=1
T0=$(date +%s)
BUDGET=$1; shift
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
if [ ! -f data/pycode/train.bin ]; then python3 data/pycode/prepare.py > $OUT/prepare.log 2>&1; fi
tail -1 $OUT/prepare.log 2>/dev/null
left() { python3 -c "print($BUDGET - ($(date +%s) - $T0) / 60)"; }
S="python3 study.py run"
FS="-- --attention=nvfp4 --optimizer=root_fp4 --end_blocks=bf16"
part() {
  case $1 in
    E) $S --recipes=fullstack --seeds=0,1,2 --sizes=30m --tokens=13e6 --variant=ends_bf16_early --jobs=2 --budget_min=$(left) --bundle=$OUT/study_E.tar.gz $FS ;;
    R) $S --recipes=fullstack --seeds=0,1,2 --sizes=30m --tokens=13e6 --variant=ends_bf16_r96 --jobs=2 --budget_min=$(left) --bundle=$OUT/study_R.tar.gz $FS --lora_rank=96 ;;
    L) $S --recipes=bf16 --seeds=0 --sizes=5m,11m,20m,30m --tokens=25e6,50e6,100e6 --budget_min=$(left) --bundle=$OUT/study_L.tar.gz ;;
    L3) $S --recipes=bf16 --seeds=0 --sizes=5m,11m,20m,30m --tokens=25e6,50e6,100e6 --jobs=3 --budget_min=$(left) --bundle=$OUT/study_L.tar.gz ;;
    F) $S --recipes=quartet,nvfp4 --seeds=0 --sizes=5m,20m --tokens=25e6,100e6 --jobs=2 --budget_min=$(left) --bundle=$OUT/study_F.tar.gz ;;
  esac
}
for p in "$@"; do part $p > /tmp/part_$p.log 2>&1 & sleep 15; done
wait
for p in "$@"; do echo "== $p"; grep -v "^step\|^iter" /tmp/part_$p.log | tail -25; done
tar czf $OUT/logs.tar.gz -C out study /tmp/part_*.log 2>/dev/null
ls $OUT; echo "elapsed $(( $(date +%s) - T0 )) s"
