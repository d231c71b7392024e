#!/bin/bash
# FP8 decode GEMM with channel tiles under 64 (few or no split-K sums): GPU tests, the sweep per projection,
# then the 7B step with the sweep's picks against the table's, alternated.
T0=$(date +%s)
python -m pip install --no-deps --no-index -q .wheels/antlr4*.whl .wheels/hydra*.whl .wheels/omegaconf*.whl .wheels/plumbum*.whl .wheels/rpyc*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD
R=$OUT/r; mkdir -p $R; cp devscripts/c8.sh $R/run.sh
{ nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv; python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"; date -u; git log -1 --format=%h; } > $R/machine.txt 2>&1
left() { echo $(( 585 - ($(date +%s) - T0) )); }
timeout 90 python -m pytest -q -m gpu tests/kernels/test_fp8_decode.py -k narrow -p no:cacheprovider > $R/gpu_tests.log 2>&1; echo "gpu tests rc=$? at $(( $(date +%s) - T0 )) s"; tail -2 $R/gpu_tests.log
for p in qkv_proj o_proj down_proj; do
  s=$(date +%s)
  timeout 120 python -m bench.fp8_decode_sweep --projections $p --m 1 32 --block-n 16 32 --out $R/sweep_$p.csv > $R/sweep_$p.log 2>&1
  echo "sweep $p rc=$? $(( $(date +%s) - s )) s"; grep -v "^failed" $R/sweep_$p.log | tail -4; grep -c "^failed" $R/sweep_$p.log
done
PICK=$(python - <<'PY'
import ast, csv, glob, os
from vlora_kernels.fp8_decode import CONFIGS
picks = dict(CONFIGS)
for f in sorted(glob.glob(os.environ["OUT"] + "/r/sweep_*.csv")):
    rows = [r for r in csv.DictReader(open(f)) if r["us"] != "nan"]
    total, count = {}, {}
    for r in rows:
        c = ast.literal_eval(r["config"]); total[c] = total.get(c, 0) + float(r["us"]); count[c] = count.get(c, 0) + 1
    nk = (int(rows[0]["n"]), int(rows[0]["k"]))
    ok = [c for c in total if count[c] == max(count.values()) and (nk != (3584, 3584) or c[1] == 128)]  # o_proj: 128-wide K tiles keep the attention's per-group rows
    picks[nk] = min(ok, key=total.get)
print(picks if picks != CONFIGS else "")
PY
)
echo "picks: $PICK" | tee $R/picks.txt
bench() {  # $1: name, rest: runwith settings
  n=$1; shift; s=$(date +%s)
  timeout 150 python -u devscripts/runwith.py "$@" -- bench bench.suite=fp8 bench.fp8.prompts=2 bench.fp8.gemm=false bench.fp8.switch_repeats=1 \
    'bench.fp8.batch_sizes=[1,32]' bench.out_dir=$R/$n > $R/$n.log 2>&1
  echo "$n rc=$? $(( $(date +%s) - s )) s"; f=$(ls $R/$n/*/fp8.md 2>/dev/null); [ -n "$f" ] && { grep "^| fp8 | none | unmerged | fp32" $f; grep -A4 "^| batch" $f | tail -2; }
}
if [ -n "$PICK" ]; then
  for v in picks table picks table picks table; do
    [ $(left) -lt 95 ] && break
    i=$(( ${i:-0} + 1 ))
    if [ $v = picks ]; then bench ${v}_$i "vlora_kernels.fp8_decode.CONFIGS=$PICK"; else bench ${v}_$i; fi
  done
fi
cd $OUT && tar czf r.tgz r
