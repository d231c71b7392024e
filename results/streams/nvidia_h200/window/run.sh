#!/bin/bash
# call 1: bf16 heads with a cold point at the warm capacity (38), a 60 s window at 36; FP8 heads with a cold point at 44
set -x
cd "$(dirname "$0")/.."
python -m pip install --no-deps --no-index -q .wheels/antlr4*.whl .wheels/hydra*.whl .wheels/omegaconf*.whl .wheels/plumbum*.whl .wheels/rpyc*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD
mkdir -p $OUT/r
cp devscripts/a.sh $OUT/r/run.sh
nvidia-smi --query-gpu=name,driver_version,memory.total,power.limit,clocks.max.sm --format=csv > $OUT/r/machine.txt; nproc >> $OUT/r/machine.txt
lscpu | grep -E "Model name|^CPU\(s\)" >> $OUT/r/machine.txt
python -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)" >> $OUT/r/machine.txt
git log -1 --format=%H >> $OUT/r/machine.txt 2>/dev/null
date -u > $OUT/r/date.txt
nvidia-smi dmon -s pucvm -d 1 -o T > $OUT/r/dmon.txt 2>&1 &
DMON=$!
date -u +%T > $OUT/r/t_bf16.txt
timeout 320 python -m vlora bench bench.suite=streams 'bench.streams.modes=[head]' 'bench.streams.stream_counts=[36,38,40]' bench.streams.refine=0 bench.streams.seconds=8 bench.streams.hf_baseline=true bench.streams.hf_batches=2 bench.streams.cold_streams=38 bench.streams.engine_only=false 'bench.streams.window_counts=[36]' bench.streams.window_seconds=60 bench.out_dir=$OUT/r/bf16 > $OUT/r/bf16.log 2>&1
grep -v USDT $OUT/r/bf16.log | tail -16
date -u +%T > $OUT/r/t_fp8.txt
timeout 230 python -m vlora bench bench.suite=streams 'bench.streams.modes=[head]' 'bench.streams.stream_counts=[44,48]' bench.streams.refine=0 bench.streams.seconds=8 bench.streams.hf_baseline=false bench.streams.cold_streams=44 bench.streams.engine_only=false bench.streams.quantization=fp8 bench.out_dir=$OUT/r/fp8 > $OUT/r/fp8.log 2>&1
grep -v USDT $OUT/r/fp8.log | tail -10
kill $DMON
cd $OUT && tar czf r.tgz r
