#!/bin/bash
# two GPUs of one host. Phase 1: tensor parallel (TP=2) against one GPU at the 7B shape (bench.suite=tp).
# Phase 2, side by side: GPU 0 the FP8 GPU tests and the fp8 suite (the transposed decode GEMM and the SiLU-mul
# by blocks, first measured here); GPU 1 camera streams over HTTP against RPyC on one engine.
T0=$(date +%s)
python -m pip install --no-deps --no-index -q .wheels/antlr4*.whl .wheels/hydra*.whl .wheels/omegaconf*.whl .wheels/plumbum*.whl .wheels/rpyc*.whl 2>&1 | tail -2
python -m pip install --no-index --find-links .wheels -q starlette uvicorn httpx 2>&1 | tail -2
R=$OUT/r; mkdir -p $R; cp devscripts/x2.sh $R/run.sh
{ nvidia-smi --query-gpu=index,name,memory.total --format=csv; nvidia-smi topo -m; python -c "import torch, triton, transformers, starlette, uvicorn, httpx; print(torch.__version__, triton.__version__, transformers.__version__, starlette.__version__, uvicorn.__version__, httpx.__version__)"; nproc; date -u; } > $R/machine.txt 2>&1
cd devscripts/B
s=$(date +%s)
timeout 300 python -u -m vlora bench bench.suite=tp 'bench.tp.sizes=[2]' bench.tp.shape=7b 'bench.tp.batches=[1,32,64]' \
    bench.tp.budget_s=275 bench.out_dir=$R/tp > $R/tp.log 2>&1
echo "tp rc=$? $(( $(date +%s) - s )) s"; grep -v "^\s*$" $R/tp.log | tail -30 | cut -c1-250
LEFT=$(( 575 - ($(date +%s) - T0) ))
P2S=$(date +%s); echo "phase 2 from $(( P2S - T0 )) s, $LEFT s left"
(
  export CUDA_VISIBLE_DEVICES=0
  s=$(date +%s)
  timeout 140 python -m pytest -q -m gpu tests/serve/engine/test_fp8_gpu.py tests/serve/engine/test_fp8_fused_gpu.py > $R/fp8_gpu_tests.log 2>&1
  echo "fp8 gpu tests rc=$? $(( $(date +%s) - s )) s"; tail -2 $R/fp8_gpu_tests.log
  s=$(date +%s)
  timeout 50 python -m pytest -q tests/kernels/test_fp8_quant.py tests/kernels/test_fp8_fused_quant.py tests/serve/models/test_fused_kernels.py > $R/fp8_kernel_tests.log 2>&1
  echo "fp8 kernel tests on the GPU rc=$? $(( $(date +%s) - s )) s"; tail -2 $R/fp8_kernel_tests.log
  s=$(date +%s)
  timeout $(( LEFT - 5 - ($(date +%s) - P2S) )) python -m vlora bench bench.suite=fp8 bench.fp8.profile=true bench.out_dir=$R/fp8 > $R/fp8_bench.log 2>&1
  echo "fp8 bench rc=$? $(( $(date +%s) - s )) s"
) > $R/phase2_gpu0.txt 2>&1 &
P0=$!
(
  export CUDA_VISIBLE_DEVICES=1
  s=$(date +%s)
  timeout $(( LEFT - 5 )) python -u -m bench.streams_http --counts 24 28 32 --seconds 8 --out-dir $R/http > $R/http.log 2>&1
  echo "http rc=$? $(( $(date +%s) - s )) s"
) > $R/phase2_gpu1.txt 2>&1 &
P1=$!
wait $P0 $P1
cat $R/phase2_gpu0.txt $R/phase2_gpu1.txt; grep -E "^transport=" $R/http.log
grep -A6 "## Decode step (ms)" $R/fp8_bench.log; grep -A8 "Projection GEMMs alone" $R/fp8_bench.log | cut -c1-200
echo "done at $(( $(date +%s) - T0 )) s"
cd $OUT && tar czf r.tgz r && rm -rf r
