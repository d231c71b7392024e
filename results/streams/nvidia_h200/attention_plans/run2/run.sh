#!/bin/bash
# replicate: bf16 cold 36, warm 36/38/39/40, two ramps; FP8 cold 48, warm 48/52/56/60 (attention plans warmed)
cd "$(dirname "$0")/.."
python -m pip install --no-deps --no-index -q .wheels/antlr4*.whl .wheels/hydra*.whl .wheels/omegaconf*.whl .wheels/plumbum*.whl .wheels/rpyc*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD
R=$OUT/r; mkdir -p $R; cp devscripts/j.sh $R/run.sh
{ nvidia-smi --query-gpu=name,driver_version,memory.total,power.limit,clocks.max.sm --format=csv; nproc; date -u; } > $R/machine.txt 2>&1
nvidia-smi dmon -s pucvm -d 1 -o T > $R/dmon.txt 2>&1 &
DMON=$!
COMMON="bench.suite=streams bench.streams.modes=[head] bench.streams.refine=0 bench.streams.seconds=8 bench.streams.hf_baseline=false bench.streams.engine_only=false bench.streams.matmul_sustained_s=0"
timeout 270 python -m vlora bench $COMMON bench.streams.cold_streams=36 'bench.streams.stream_counts=[36,38,39,40]' 'bench.streams.ramp_counts=[36,36]' bench.out_dir=$R/bf16 > $R/bf16.log 2>&1
echo "bf16 rc=$?"; grep -E "^ *(point|cold|warm|ramp) |^cold|ramp\)|warmed up" $R/bf16.log | cut -c1-250
timeout 270 python -m vlora bench $COMMON bench.streams.quantization=fp8 bench.streams.cold_streams=48 'bench.streams.stream_counts=[48,52,56,60]' bench.out_dir=$R/fp8 > $R/fp8.log 2>&1
echo "fp8 rc=$?"; grep -E "^ *(point|cold|warm) |^cold|warmed up" $R/fp8.log | cut -c1-250
kill $DMON
cd $OUT && tar czf r.tgz r
