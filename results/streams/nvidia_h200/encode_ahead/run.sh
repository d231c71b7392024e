#!/bin/bash
# encode_ahead on one GPU: GPU tests, then the streams suite (cold 28, warm search, the A/B of
# encode_ahead at two counts, the in-process full batch A/B), on an export of the named commit
python -m pip install --no-deps --no-index -q .wheels/antlr4*.whl .wheels/hydra*.whl .wheels/omegaconf*.whl .wheels/plumbum*.whl .wheels/rpyc*.whl 2>&1 | tail -2
R=$OUT/r; mkdir -p $R
{ nvidia-smi --query-gpu=name,memory.total --format=csv; nproc; python -c "import torch, triton, transformers, torchvision; print(torch.__version__, triton.__version__, transformers.__version__, torchvision.__version__)"; date -u; } > $R/machine.txt 2>&1
cp devscripts/ahead.sh $R/run.sh
cd devscripts/B
start=$(date +%s)
[ -n "$TESTS" ] && timeout 120 python -m pytest -q -m gpu tests/serve/models/test_vision_gpu.py tests/serve/engine/test_engine_gpu.py > $R/gpu_tests.log 2>&1
[ -n "$TESTS" ] && timeout 90 python -m pytest -q tests/serve/engine/test_encode_ahead.py >> $R/gpu_tests.log 2>&1
echo "tests $(( $(date +%s) - start )) s" | tee -a $R/gpu_tests.log; tail -2 $R/gpu_tests.log
start=$(date +%s)
timeout ${BENCH_S:-420} python -m vlora bench bench.suite=streams 'bench.streams.modes=[head]' bench.streams.hf_baseline=true \
  "bench.streams.stream_counts=${COUNTS:-[28,32,36,40,44]}" bench.streams.refine=1 bench.streams.seconds=8 \
  bench.streams.cold_streams=28 "bench.streams.ahead_off_counts=${OFF:-[28,32]}" 'bench.streams.engine_only_rates=[32.0]' \
  bench.out_dir=$R/streams > $R/run.log 2>&1
echo "bench exit $? after $(( $(date +%s) - start )) s" | tee -a $R/run.log
grep -E "warmed up|ready in|cold mode|^\[streams\] (mode|engine|  )|encode_ahead=|paced|transformers:|illegal|Error" $R/run.log | cut -c1-300 | tail -40
cd $OUT && tar czf r.tgz r && rm -rf r
