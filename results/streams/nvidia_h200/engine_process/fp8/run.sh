#!/bin/bash
# call 3: FP8 streams with the engine in its own process, then the GPU soak (vlora serve, the batched engine pipe)
set -x
cd "$(dirname "$0")/.."
python -m pip install --no-deps --no-index -q .wheels/antlr4*.whl .wheels/hydra*.whl .wheels/omegaconf*.whl .wheels/plumbum*.whl .wheels/rpyc*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD
mkdir -p $OUT/r
nvidia-smi --query-gpu=name,driver_version,memory.total,power.limit,clocks.max.sm --format=csv > $OUT/r/machine.txt; nproc >> $OUT/r/machine.txt
lscpu | grep -E "Model name|^CPU\(s\)" >> $OUT/r/machine.txt
python -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)" >> $OUT/r/machine.txt
date -u > $OUT/r/date.txt
timeout 230 python -m vlora bench bench.suite=streams 'bench.streams.modes=[head]' 'bench.streams.stream_counts=[44,48,52,56]' bench.streams.refine=0 bench.streams.seconds=8 bench.streams.hf_baseline=false bench.streams.cold_streams=44 bench.streams.engine_only=false bench.streams.quantization=fp8 bench.out_dir=$OUT/r/fp8 > $OUT/r/fp8.log 2>&1
grep -v USDT $OUT/r/fp8.log | tail -10
timeout 300 python -m vlora bench bench.suite=soak bench.soak.device=cuda bench.out_dir=$OUT/r/soak > $OUT/r/soak.log 2>&1
tail -40 $OUT/r/soak.log
cd $OUT && tar czf r.tgz r
