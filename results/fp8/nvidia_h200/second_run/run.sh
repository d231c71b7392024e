#!/bin/bash
# one GPU: (1) the FP8 GPU and kernel tests, (2) the fp8 suite at the Qwen2-VL-7B shape with the per-kernel
# decode profile and the fused-quantization A/B
python -m pip install --no-deps --no-index -q .wheels/antlr4*.whl .wheels/hydra*.whl .wheels/omegaconf*.whl .wheels/plumbum*.whl .wheels/rpyc*.whl 2>&1 | tail -2
R=$OUT/r; mkdir -p $R; cp devscripts/fp8a.sh $R/run.sh
{ nvidia-smi --query-gpu=name,memory.total --format=csv; python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"; date -u; } > $R/machine.txt 2>&1
cd devscripts/B
s=$(date +%s)
timeout 200 python -m pytest -q -m gpu tests/serve/engine/test_fp8_gpu.py tests/serve/engine/test_fp8_fused_gpu.py > $R/fp8_gpu_tests.log 2>&1
echo "fp8 gpu tests rc=$? $(( $(date +%s) - s )) s"; tail -3 $R/fp8_gpu_tests.log
s=$(date +%s)
timeout 120 python -m pytest -q tests/kernels/test_fp8_quant.py tests/kernels/test_fp8_fused_quant.py tests/kernels/test_fp8_merge_kernel.py tests/kernels/test_fp8_fused_ptx.py tests/serve/models/test_fp8_fused_producers.py > $R/fp8_kernel_tests.log 2>&1
echo "fp8 kernel tests rc=$? $(( $(date +%s) - s )) s"; tail -3 $R/fp8_kernel_tests.log
s=$(date +%s)
timeout 300 python -m vlora bench bench.suite=fp8 bench.fp8.profile=true bench.fp8.compare_unfused=true bench.out_dir=$R/fp8 > $R/fp8_bench.log 2>&1
echo "fp8 bench rc=$? $(( $(date +%s) - s )) s"; tail -40 $R/fp8_bench.log | cut -c1-250
