#!/bin/bash
# call 2: bf16 streams with the engine in its own process (heads + 8 decoded tokens, cold, transformers, in process),
# then the loop on a thread (the old way) at 32/36/40 on the same machine
set -x
cd "$(dirname "$0")/.."
python -m pip install --no-deps --no-index -q .wheels/antlr4*.whl .wheels/hydra*.whl .wheels/omegaconf*.whl .wheels/plumbum*.whl .wheels/rpyc*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD
mkdir -p $OUT/r
nvidia-smi --query-gpu=name,driver_version,memory.total,power.limit,clocks.max.sm --format=csv > $OUT/r/machine.txt; nproc >> $OUT/r/machine.txt
lscpu | grep -E "Model name|^CPU\(s\)" >> $OUT/r/machine.txt
python -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)" >> $OUT/r/machine.txt
date -u > $OUT/r/date.txt
nvidia-smi dmon -s pucvm -d 1 -o T > $OUT/r/dmon.txt 2>&1 &
DMON=$!
timeout 360 python -m vlora bench bench.suite=streams 'bench.streams.modes=[head,generate]' 'bench.streams.stream_counts=[24,32,36,40,44]' bench.streams.refine=1 bench.streams.seconds=8 bench.streams.hf_baseline=true bench.streams.hf_batches=2 bench.streams.cold_streams=36 'bench.streams.engine_only_rates=[36.0]' bench.out_dir=$OUT/r/process > $OUT/r/process.log 2>&1
date -u +%T > $OUT/r/t_thread_start.txt
grep -v USDT $OUT/r/process.log | tail -22
timeout 170 python -m vlora bench bench.suite=streams 'bench.streams.modes=[head]' 'bench.streams.stream_counts=[32,36,40]' bench.streams.refine=0 bench.streams.seconds=8 bench.streams.hf_baseline=false bench.streams.cold_streams=0 bench.streams.engine_only=false bench.streams.engine_process=false bench.out_dir=$OUT/r/thread > $OUT/r/thread.log 2>&1
grep -v USDT $OUT/r/thread.log | tail -8
kill $DMON
cd $OUT && tar czf r.tgz r
