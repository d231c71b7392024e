#!/bin/bash
# call 2: vision GPU tests, vision profile (rotary/gelu A/B), streams search with the Triton chains
set -x
cd "$(dirname "$0")/.."
python -m pip install --no-deps --no-index -q .wheels/antlr4*.whl .wheels/hydra*.whl .wheels/omegaconf*.whl .wheels/plumbum*.whl .wheels/rpyc*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD
mkdir -p $OUT/r
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $OUT/r/machine.txt; nproc >> $OUT/r/machine.txt
python -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)" >> $OUT/r/machine.txt
git log --oneline -1 > $OUT/r/commit.txt 2>/dev/null; date -u > $OUT/r/date.txt
timeout 120 python -m pytest -q -p no:cacheprovider tests/serve/models/test_vision_fused.py tests/serve/models/test_vision_gpu.py > $OUT/r/gpu_tests.log 2>&1
tail -5 $OUT/r/gpu_tests.log
timeout 150 python -m vlora bench bench.suite=vision 'bench.vision.chunks=[8]' bench.vision.profile=true bench.vision.profile_chunks=8 bench.vision.cpu_repeats=3 bench.out_dir=$OUT/r/vision > $OUT/r/vision.log 2>&1
grep "^\[vision" $OUT/r/vision.log; tail -3 $OUT/r/vision.log
timeout 300 python -m vlora bench bench.suite=streams 'bench.streams.modes=[head]' 'bench.streams.stream_counts=[32,36,40]' bench.streams.refine=1 bench.streams.seconds=8 bench.streams.hf_baseline=true bench.streams.hf_batches=2 bench.streams.cold_streams=32 'bench.streams.engine_only_rates=[36.0]' bench.out_dir=$OUT/r/streams > $OUT/r/streams.log 2>&1
grep -v "^\[20" $OUT/r/streams.log | tail -22 | cut -c1-600
cd $OUT && tar czf r.tgz r
