#!/bin/bash
# the GPU tests of the towers (CLIP through the segment attention); bf16 at 38 cameras over a 40 s window
cd "$(dirname "$0")/.."
python -m pip install --no-deps --no-index -q .wheels/antlr4*.whl .wheels/hydra*.whl .wheels/omegaconf*.whl .wheels/plumbum*.whl .wheels/rpyc*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD
R=$OUT/r; mkdir -p $R; cp devscripts/l.sh $R/run.sh
{ nvidia-smi --query-gpu=name,driver_version,memory.total,power.limit,clocks.max.sm --format=csv; nproc; date -u; } > $R/machine.txt 2>&1
timeout 200 python -m pytest -q -s -m gpu tests/serve/models/test_vision_gpu.py > $R/gpu_tests.log 2>&1
echo "gpu tests rc=$?"; grep -E "clip|swept|passed|failed|Error|assert" $R/gpu_tests.log | tail -12
nvidia-smi dmon -s pucvm -d 1 -o T > $R/dmon.txt 2>&1 &
DMON=$!
COMMON="bench.suite=streams bench.streams.modes=[head] bench.streams.refine=0 bench.streams.seconds=8 bench.streams.hf_baseline=false bench.streams.engine_only=false bench.streams.matmul_sustained_s=0"
timeout 230 python -m vlora bench $COMMON bench.streams.cold_streams=0 'bench.streams.stream_counts=[38]' 'bench.streams.window_counts=[38]' bench.streams.window_seconds=40 bench.out_dir=$R/bf16 > $R/bf16.log 2>&1
echo "bf16 rc=$?"; grep -E "^ *(point|warm|window) |warmed up" $R/bf16.log | cut -c1-250
kill $DMON
cd $OUT && tar czf r.tgz r
