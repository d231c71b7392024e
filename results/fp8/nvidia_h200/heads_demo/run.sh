#!/bin/bash
T0=$(date +%s)
python -m pip install --no-deps --no-index -q .wheels/*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD
R=$OUT/r; mkdir -p $R; cp devscripts/c5.sh $R/run.sh; cp devscripts/runwith.py devscripts/*_demo.py $R/
{ nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv; python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"; date -u; } > $R/machine.txt 2>&1
python devscripts/unpack_demo.py .demo_pack > $R/unpack.log 2>&1; echo "unpack rc=$? at $(( $(date +%s) - T0 )) s"
timeout 220 python -u -m vlora bench bench.suite=fp8 bench.fp8.heads_only=true bench.fp8.adapters_dir=/tmp/demo_run/.vlora/adapters/fused bench.fp8.heads_items=224 bench.out_dir=$R/heads_demo > $R/heads_demo.log 2>&1
echo "heads rc=$? at $(( $(date +%s) - T0 )) s"; grep "^| fused" $R/heads_demo/*/fp8.md | cut -c1-200 | head -30
bench() {  # $1: chain, $2: unsplit release, $3: name
  s=$(date +%s)
  VLORA_PDL_CHAIN=$1 timeout 120 python -u devscripts/runwith.py vlora_kernels.fp8_decode.UNSPLIT_RELEASE=$2 -- bench bench.suite=fp8 bench.fp8.prompts=2 bench.fp8.gemm=false bench.fp8.switch_repeats=1 \
    'bench.fp8.batch_sizes=[1,32]' bench.fp8.compare_fp8_lm_head=true bench.out_dir=$R/$3 > $R/$3.log 2>&1
  echo "$3 rc=$? $(( $(date +%s) - s )) s"; grep -A4 "^| batch" $R/$3/*/fp8.md | tail -2
}
left() { echo $(( 585 - ($(date +%s) - T0) )); }
for v in "1 False" "0 True" "1 True" "1 False" "0 True" "1 True"; do
  [ $(left) -lt 70 ] && break
  n=$(( ${n:-0} + 1 )); set -- $v; bench $1 $2 c$1_${2}_$n
done
cd $OUT && tar czf r.tgz r
