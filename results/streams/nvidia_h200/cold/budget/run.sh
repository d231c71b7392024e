#!/bin/bash
# call 1: bf16 heads at the default step budget (8192 tokens): cold at 36 with the host phases, warm 36/38, a ramp at
# 36 on the warmed server; then the same with a 16384-token step budget and warm 36/38/40
T0=$(date +%s)
cd "$(dirname "$0")/.."
python -m pip install --no-deps --no-index -q .wheels/antlr4*.whl .wheels/hydra*.whl .wheels/omegaconf*.whl .wheels/plumbum*.whl .wheels/rpyc*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD
R=$OUT/r; mkdir -p $R; cp devscripts/d.sh $R/run.sh
{ nvidia-smi --query-gpu=name,driver_version,memory.total,power.limit,clocks.max.sm --format=csv; nproc; python -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)"; date -u; } > $R/machine.txt 2>&1
nvidia-smi dmon -s pucvm -d 1 -o T > $R/dmon.txt 2>&1 &
DMON=$!
COMMON="bench.suite=streams bench.streams.modes=[head] bench.streams.refine=0 bench.streams.seconds=8 bench.streams.hf_baseline=false bench.streams.cold_streams=36 bench.streams.ramp_counts=[36] bench.streams.engine_only=false bench.streams.matmul_sustained_s=0"
for B in 8192 16384; do
  s=$(date +%s); date -u +%T > $R/t_$B.txt
  C='[36,38]'; [ $B = 16384 ] && C='[36,38,40]'
  LEFT=$(( 575 - ($(date +%s) - T0) ))
  timeout $LEFT python -m vlora bench $COMMON "bench.streams.stream_counts=$C" bench.streams.max_tokens_per_step=$B bench.out_dir=$R/b$B > $R/b$B.log 2>&1
  echo "budget $B rc=$? $(( $(date +%s) - s )) s"
  grep -v USDT $R/b$B.log | grep -E "^\[streams\] (ready|cold|mode)|^ *(point|cold|warm|ramp)|^cold|ramp\)" | cut -c1-330
done
kill $DMON
cd $OUT && tar czf r.tgz r
