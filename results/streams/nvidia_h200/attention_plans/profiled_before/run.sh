#!/bin/bash
# next: bf16 heads with the heap frozen: cold at 36 with its first 4 steps profiled (and the first ramp's), warm
# 36/38/40/42, three ramps at 36; then FP8 at 48/52/56 with the heap frozen
cd "$(dirname "$0")/.."
python -m pip install --no-deps --no-index -q .wheels/antlr4*.whl .wheels/hydra*.whl .wheels/omegaconf*.whl .wheels/plumbum*.whl .wheels/rpyc*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD
R=$OUT/r; mkdir -p $R; cp devscripts/h.sh $R/run.sh
{ nvidia-smi --query-gpu=name,driver_version,memory.total,power.limit,clocks.max.sm --format=csv; nproc; date -u; } > $R/machine.txt 2>&1
nvidia-smi dmon -s pucvm -d 1 -o T > $R/dmon.txt 2>&1 &
DMON=$!
COMMON="bench.suite=streams bench.streams.modes=[head] bench.streams.refine=0 bench.streams.seconds=8 bench.streams.hf_baseline=false bench.streams.engine_only=false bench.streams.matmul_sustained_s=0"
timeout 300 python -m vlora bench $COMMON bench.streams.cold_streams=36 'bench.streams.stream_counts=[36,38,40,42]' 'bench.streams.ramp_counts=[36,36,36]' bench.streams.profile_first_steps=4 bench.out_dir=$R/bf16 > $R/bf16.log 2>&1
echo "bf16 rc=$?"; grep -E "^ *(point|cold|warm|ramp) |^cold|ramp\)" $R/bf16.log | cut -c1-200
timeout 250 python -m vlora bench $COMMON bench.streams.quantization=fp8 'bench.streams.stream_counts=[48,52,56]' bench.streams.cold_streams=0 bench.out_dir=$R/fp8 > $R/fp8.log 2>&1
echo "fp8 rc=$?"; grep -E "^ *(point|warm) " $R/fp8.log | cut -c1-200
kill $DMON
cd $OUT && tar czf r.tgz r
