#!/bin/bash
# two H200s, side by side. GPU 0: the FP8 GPU tests with the Triton decode GEMM now on by default, the fp8 suite with
# its swept gate_up/down configs, the trained adapters' head answers FP8 against bf16, then the qkv/o sweep.
# GPU 1: camera streams over HTTP against RPyC, each count three times, every other repeat HTTP first.
T0=$(date +%s)
python -m pip install --no-deps --no-index -q .wheels/antlr4*.whl .wheels/hydra*.whl .wheels/omegaconf*.whl .wheels/plumbum*.whl .wheels/rpyc*.whl 2>&1 | tail -2
python -m pip install --no-index --find-links .wheels -q starlette uvicorn httpx 2>&1 | tail -2
R=$OUT/r; mkdir -p $R; cp devscripts/b.sh $R/run.sh
{ nvidia-smi --query-gpu=index,name,memory.total --format=csv; python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"; nproc; date -u; } > $R/machine.txt 2>&1
cd devscripts/B
LEFT=$(( 575 - ($(date +%s) - T0) )); P2S=$(date +%s)
rem() { echo $(( LEFT - 8 - ($(date +%s) - P2S) )); }
(
  export CUDA_VISIBLE_DEVICES=0
  s=$(date +%s)
  timeout 230 python -m pytest -q -m gpu tests/serve/engine/test_fp8_gpu.py tests/serve/engine/test_fp8_fused_gpu.py tests/kernels/test_fp8_decode.py > $R/fp8_gpu_tests.log 2>&1
  echo "fp8 gpu tests rc=$? $(( $(date +%s) - s )) s"; grep -E "passed|failed|FAILED|Error" $R/fp8_gpu_tests.log | tail -8
  s=$(date +%s)
  timeout 120 python -m vlora bench bench.suite=fp8 bench.fp8.profile=true bench.out_dir=$R/fp8 > $R/fp8_bench.log 2>&1
  echo "fp8 bench rc=$? $(( $(date +%s) - s )) s"
  s=$(date +%s)
  timeout $(( $(rem) - 70 )) python -m vlora bench bench.suite=fp8 bench.fp8.heads_only=true bench.out_dir=$R/fp8_heads > $R/fp8_heads.log 2>&1
  echo "fp8 heads rc=$? $(( $(date +%s) - s )) s"
  s=$(date +%s)
  timeout $(rem) python -m bench.fp8_decode_sweep --projections qkv_proj o_proj --m 1 32 64 --out $R/sweep_qkv_o.csv > $R/sweep_qkv_o.log 2>&1
  echo "sweep rc=$? $(( $(date +%s) - s )) s"
) > $R/gpu0.txt 2>&1 &
P0=$!
(
  export CUDA_VISIBLE_DEVICES=1
  s=$(date +%s)
  timeout $(( LEFT - 10 )) python -u -m bench.streams_http --counts 24 28 32 --seconds 8 --repeats 3 --out-dir $R/http > $R/http.log 2>&1
  echo "http rc=$? $(( $(date +%s) - s )) s"
) > $R/gpu1.txt 2>&1 &
P1=$!
wait $P0 $P1
cat $R/gpu0.txt $R/gpu1.txt; grep -E "^transport=" $R/http.log
grep -A6 "## Decode step (ms)" $R/fp8_bench.log; grep -iE "agreement|^\| (exists|count|class|detect)" $R/fp8_heads.log | head -20 | cut -c1-220; tail -4 $R/sweep_qkv_o.log | cut -c1-200
echo "done at $(( $(date +%s) - T0 )) s"
cd $OUT && tar czf r.tgz r && rm -rf r
