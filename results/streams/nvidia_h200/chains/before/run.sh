#!/bin/bash
# call 1: vision tower profile, GPU soak, streams at 32 with the in-process kernel kinds
set -x
cd "$(dirname "$0")/.."
python -m pip install --no-deps --no-index -q .wheels/antlr4*.whl .wheels/hydra*.whl .wheels/omegaconf*.whl .wheels/plumbum*.whl .wheels/rpyc*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD
mkdir -p $OUT/r
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $OUT/r/machine.txt; nproc >> $OUT/r/machine.txt
python -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)" >> $OUT/r/machine.txt
date -u > $OUT/r/date.txt
timeout 200 python -m vlora bench bench.suite=vision 'bench.vision.chunks=[8]' bench.vision.profile=true bench.vision.profile_chunks=8 bench.vision.cpu_repeats=3 bench.out_dir=$OUT/r/vision > $OUT/r/vision.log 2>&1
tail -30 $OUT/r/vision.log
timeout 200 python -m vlora bench bench.suite=soak bench.soak.device=cuda bench.out_dir=$OUT/r/soak > $OUT/r/soak.log 2>&1
tail -40 $OUT/r/soak.log
timeout 230 python -m vlora bench bench.suite=streams 'bench.streams.modes=[head]' 'bench.streams.stream_counts=[32]' bench.streams.refine=0 bench.streams.seconds=8 bench.streams.hf_baseline=false bench.streams.cold_streams=0 'bench.streams.engine_only_rates=[30.0]' bench.out_dir=$OUT/r/streams > $OUT/r/streams.log 2>&1
tail -20 $OUT/r/streams.log
cd $OUT && tar czf r.tgz r
