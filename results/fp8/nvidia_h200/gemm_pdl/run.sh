#!/bin/bash
# FP8 decode GEMMs launched with PDL behind their producers, their weight prefetched to L2, against launched after
T0=$(date +%s)
python -m pip install --no-deps --no-index -q .wheels/antlr4*.whl .wheels/hydra*.whl .wheels/omegaconf*.whl .wheels/plumbum*.whl .wheels/rpyc*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD
R=$OUT/r; mkdir -p $R; cp devscripts/f2.sh $R/run.sh; git log -1 --format=%H > $R/commit.txt 2>/dev/null
{ nvidia-smi --query-gpu=index,name,memory.total --format=csv; python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"; nproc; date -u; } > $R/machine.txt 2>&1
s=$(date +%s)
timeout 200 python -m pytest -q -m gpu tests/kernels/test_fp8_decode.py tests/serve/engine/test_fp8_gpu.py tests/serve/engine/test_fp8_fused_gpu.py > $R/fp8_gpu_tests.log 2>&1
echo "fp8 gpu tests rc=$? $(( $(date +%s) - s )) s"; grep -E "passed|failed|FAILED|Error" $R/fp8_gpu_tests.log | tail -12 | cut -c1-250
for run in 1 2; do
s=$(date +%s)
LEFT=$(( 590 - ($(date +%s) - T0) ))
[ $LEFT -lt 60 ] && break
timeout $LEFT python -m vlora bench bench.suite=fp8 bench.fp8.profile=true bench.fp8.compare_gemm_pdl=true bench.fp8.gemm=$([ $run = 1 ] && echo true || echo false) bench.out_dir=$R/fp8_$run > $R/fp8_bench_$run.log 2>&1
echo "fp8 bench $run rc=$? $(( $(date +%s) - s )) s"
grep -A8 "## Decode step (ms)" $R/fp8_bench_$run.log
grep -A12 "## Decode step profile" $R/fp8_bench_$run.log | cut -c1-200
grep -E "^- (fp8|fp8_no_gemm_pdl) b32" $R/fp8_bench_$run.log | cut -c1-300
grep -E "^- batch|^\| fp8_no_gemm_pdl" $R/fp8_bench_$run.log | cut -c1-300
done
cd $OUT && tar czf r.tgz r
