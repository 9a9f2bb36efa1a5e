#!/bin/bash
# Session 14 device script. usage: bash .devrun/s14.sh BUDGET_MIN PART [PART...]
# Each PART runs in the background at once; at the end their logs are bundled into $OUT.
#   LR01 / LR2: fullstack refit50 and ends_bf16_refit50, seeds 0 1 / seed 2   (#14)
#   L3A: bf16 30m 100M; L3B: bf16 50m 100M; L3C: bf16 100m 100M          (#15)
#   Q50: quartet 50m 13M + 50M seed 0                                      (#15)
#   L25: bf16 30m, 50m, 100m at 25M tokens                                (#15)
#   VP: fullstack 30m step_profile; VT: GPU tests of optim, newton_schulz, train (checks)
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
FS="-- --attention=nvfp4 --optimizer=root_fp4 --lora_refit_interval=50"
part() {
  case $1 in
    LR01) $S --recipes=fullstack --seeds=0,1 --sizes=30m --tokens=13e6 --variant=refit50 --jobs=2 --budget_min=$(left) --bundle=$OUT/study_LR01a.tar.gz $FS
          ;;
    LR01b) $S --recipes=fullstack --seeds=0,1 --sizes=30m --tokens=13e6 --variant=ends_bf16_refit50 --jobs=2 --budget_min=$(left) --bundle=$OUT/study_LR01b.tar.gz $FS --end_blocks=bf16 ;;
    LR2) $S --recipes=fullstack --seeds=2 --sizes=30m --tokens=13e6 --variant=refit50 --budget_min=$(left) --bundle=$OUT/study_LR2a.tar.gz $FS
         ;;
    LR2b) $S --recipes=fullstack --seeds=2 --sizes=30m --tokens=13e6 --variant=ends_bf16_refit50 --budget_min=$(left) --bundle=$OUT/study_LR2b.tar.gz $FS --end_blocks=bf16 ;;
    L3A) $S --recipes=bf16 --seeds=0 --sizes=30m --tokens=100e6 --budget_min=$(left) --bundle=$OUT/study_L3A.tar.gz ;;
    L3B) $S --recipes=bf16 --seeds=0 --sizes=50m --tokens=100e6 --budget_min=$(left) --bundle=$OUT/study_L3B.tar.gz ;;
    L3C) $S --recipes=bf16 --seeds=0 --sizes=100m --tokens=100e6 --budget_min=$(left) --bundle=$OUT/study_L3C.tar.gz ;;
    Q50) $S --recipes=quartet --seeds=0 --sizes=50m --tokens=13e6,50e6 --budget_min=$(left) --bundle=$OUT/study_Q50.tar.gz ;;
    L25) $S --recipes=bf16 --seeds=0 --sizes=30m,50m,100m --tokens=25e6 --budget_min=$(left) --bundle=$OUT/study_L25.tar.gz ;;
    VP) python3 bench.py --sections step_profile --model 30m --seq 512 --batch 64 --step-loss-chunk 8192 \
         --step-variants fullstack+attn-nvfp4:root_fp4 --out $OUT ;;
    VT) timeout 200 python3 -m pytest -q test_optim.py test_newton_schulz.py 2>&1 | tee $OUT/pytest_optim_ns.log
        timeout 200 python3 -m pytest -q test_train.py -k "not float8" 2>&1 | tee $OUT/pytest_train.log ;;
  esac
}
for p in "$@"; do part $p > /tmp/part_$p.log 2>&1 & sleep 15; done
wait
for p in "$@"; do echo "== $p"; grep -v "^step\|^iter" /tmp/part_$p.log | tail -25; done
tar czf $OUT/logs.tar.gz -C out study /tmp/part_*.log 2>/dev/null
ls $OUT; echo "elapsed $(( $(date +%s) - T0 )) s"
