#!/bin/bash
# call 4: 8 decoded tokens per chunk with the decode lane (engine in its own process)
set -x
cd "$(dirname "$0")/.."
python -m pip install --no-deps --no-index -q .wheels/antlr4*.whl .wheels/hydra*.whl .wheels/omegaconf*.whl .wheels/plumbum*.whl .wheels/rpyc*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD
mkdir -p $OUT/r
nvidia-smi --query-gpu=name,driver_version,memory.total,power.limit,clocks.max.sm --format=csv > $OUT/r/machine.txt; nproc >> $OUT/r/machine.txt
python -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)" >> $OUT/r/machine.txt
date -u > $OUT/r/date.txt
timeout 230 python -m vlora bench bench.suite=streams 'bench.streams.modes=[generate]' 'bench.streams.stream_counts=[24,32]' bench.streams.refine=0 bench.streams.seconds=8 bench.streams.hf_baseline=false bench.streams.cold_streams=0 bench.streams.engine_only=false bench.streams.max_prefill_with_decode=0 bench.out_dir=$OUT/r/lane > $OUT/r/lane.log 2>&1
grep -v USDT $OUT/r/lane.log | tail -12
cd $OUT && tar czf r.tgz r
