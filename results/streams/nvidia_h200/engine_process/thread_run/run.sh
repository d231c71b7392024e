#!/bin/bash
# call 1: bf16 streams (heads + 8 decoded tokens, cold, transformers, in process) and FP8 at 44/48 with GPU clocks logged
set -x
cd "$(dirname "$0")/.."
python -m pip install --no-deps --no-index -q .wheels/antlr4*.whl .wheels/hydra*.whl .wheels/omegaconf*.whl .wheels/plumbum*.whl .wheels/rpyc*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD
mkdir -p $OUT/r
nvidia-smi --query-gpu=name,driver_version,memory.total,power.limit,clocks.max.sm --format=csv > $OUT/r/machine.txt; nproc >> $OUT/r/machine.txt
python -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)" >> $OUT/r/machine.txt
date -u > $OUT/r/date.txt
nvidia-smi dmon -s pucvm -d 1 -o T > $OUT/r/dmon.txt 2>&1 &
DMON=$!
date -u +%T > $OUT/r/t_bf16_start.txt
timeout 340 python -m vlora bench bench.suite=streams 'bench.streams.modes=[head,generate]' 'bench.streams.stream_counts=[16,24,32,36,40]' bench.streams.refine=1 bench.streams.seconds=8 bench.streams.hf_baseline=true bench.streams.hf_batches=2 bench.streams.cold_streams=36 'bench.streams.engine_only_rates=[36.0]' bench.out_dir=$OUT/r/bf16 > $OUT/r/bf16.log 2>&1
date -u +%T > $OUT/r/t_fp8_start.txt
tail -25 $OUT/r/bf16.log
timeout 200 python -m vlora bench bench.suite=streams 'bench.streams.modes=[head]' 'bench.streams.stream_counts=[44,48]' bench.streams.refine=0 bench.streams.seconds=8 bench.streams.hf_baseline=false bench.streams.cold_streams=44 bench.streams.engine_only=false bench.streams.quantization=fp8 bench.out_dir=$OUT/r/fp8 > $OUT/r/fp8.log 2>&1
date -u +%T > $OUT/r/t_end.txt
tail -15 $OUT/r/fp8.log
kill $DMON
cd $OUT && tar czf r.tgz r
