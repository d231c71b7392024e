#!/bin/bash
# HEAD with nvJPEG on its own stream: the cold and warm 28-stream points twice, then the GPU decode test
python -m pip install --no-deps --no-index -q .wheels/antlr4*.whl .wheels/hydra*.whl .wheels/omegaconf*.whl .wheels/plumbum*.whl .wheels/rpyc*.whl 2>&1 | tail -2
mkdir -p $OUT/r
{ nvidia-smi --query-gpu=name,memory.total --format=csv; nproc; python -c "import torch, triton, transformers, torchvision; print(torch.__version__, triton.__version__, transformers.__version__, torchvision.__version__)"; date -u; } > $OUT/r/machine.txt 2>&1
(cd devscripts/B && timeout 60 python -m pytest -q -m gpu tests/serve/models/test_vision_gpu.py -k nvjpeg > $OUT/r/gpu_test.log 2>&1; tail -3 $OUT/r/gpu_test.log)
for i in 1 2; do
  start=$(date +%s)
  (cd devscripts/B && timeout 200 python -m vlora bench bench.suite=streams 'bench.streams.modes=[head]' bench.streams.hf_baseline=false \
    'bench.streams.stream_counts=[28]' bench.streams.refine=0 bench.streams.seconds=8 bench.streams.engine_only=false \
    bench.streams.cold_streams=28 bench.out_dir=$OUT/r/d$i > $OUT/r/d$i.log 2>&1)
  echo "d$i exit $? after $(( $(date +%s) - start )) s" | tee -a $OUT/r/d$i.log
  grep -E "warmed up|cold mode|^\[streams\] mode|cold \(|illegal" $OUT/r/d$i.log | cut -c1-420
done
cd $OUT && tar czf r.tgz r && rm -rf r
