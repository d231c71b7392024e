#!/bin/bash
# call 2: bf16 heads, two fresh processes (seeds 1, 2): each a cold point at 36, warm 36, three ramps at 36
T0=$(date +%s)
cd "$(dirname "$0")/.."
python -m pip install --no-deps --no-index -q .wheels/antlr4*.whl .wheels/hydra*.whl .wheels/omegaconf*.whl .wheels/plumbum*.whl .wheels/rpyc*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD
R=$OUT/r; mkdir -p $R; cp devscripts/e.sh $R/run.sh
{ nvidia-smi --query-gpu=name,driver_version,memory.total,power.limit,clocks.max.sm --format=csv; nproc; python -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)"; date -u; } > $R/machine.txt 2>&1
nvidia-smi dmon -s pucvm -d 1 -o T > $R/dmon.txt 2>&1 &
DMON=$!
for S in 1 2; do
  s=$(date +%s); date -u +%T > $R/t_seed$S.txt
  LEFT=$(( 585 - ($(date +%s) - T0) ))
  timeout $LEFT python -m vlora bench bench.suite=streams bench.streams.modes=[head] bench.streams.refine=0 bench.streams.seconds=8 bench.streams.hf_baseline=false bench.streams.cold_streams=36 'bench.streams.stream_counts=[36]' 'bench.streams.ramp_counts=[36,36,36]' bench.streams.engine_only=false bench.streams.matmul_sustained_s=0 bench.streams.seed=$S bench.out_dir=$R/seed$S > $R/seed$S.log 2>&1
  echo "seed $S rc=$? $(( $(date +%s) - s )) s"
  grep -v USDT $R/seed$S.log | grep -E "^\[streams [0-9:]+\] (ready|cold mode|engine warm)|^ *(point|cold|warm|ramp) |^cold|ramp\)" | cut -c1-330
done
kill $DMON
cd $OUT && tar czf r.tgz r
