#!/bin/bash
# The main job with the PDL chain now on by default: bf16 heads, a cold point at 36 then warm 36/38/40; the same
# with VLORA_PDL_CHAIN=0 if time is left.
T0=$(date +%s)
python -m pip install --no-deps --no-index -q .wheels/antlr4*.whl .wheels/hydra*.whl .wheels/omegaconf*.whl .wheels/plumbum*.whl .wheels/rpyc*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD
R=$OUT/r; mkdir -p $R; cp devscripts/c10.sh $R/run.sh
{ nvidia-smi --query-gpu=name,driver_version,memory.total,power.limit,clocks.max.sm --format=csv; nproc; python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"; date -u; } > $R/machine.txt 2>&1
COMMON="bench.suite=streams bench.streams.modes=[head] bench.streams.refine=0 bench.streams.seconds=8 bench.streams.hf_baseline=false bench.streams.engine_only=false bench.streams.matmul_sustained_s=0 bench.streams.cold_streams=36 bench.streams.stream_counts=[36,38,40]"
for c in 1 0; do
  left=$(( 585 - ($(date +%s) - T0) )); [ $left -lt 200 ] && break
  s=$(date +%s)
  VLORA_PDL_CHAIN=$c timeout $(( left - 10 < 290 ? left - 10 : 290 )) python -m vlora bench $COMMON bench.out_dir=$R/chain$c > $R/chain$c.log 2>&1
  echo "chain$c rc=$? $(( $(date +%s) - s )) s"; grep -E "^ *(point|cold|warm) |^cold" $R/chain$c.log | cut -c1-220
done
cd $OUT && tar czf r.tgz r
