#!/bin/bash
# call 3: bf16 heads, cold at 36, in process (GPU ms per chunk), the matmul rate sustained 20 s at the end, clocks
# sampled each second; then the GPU tests not yet run on a GPU
T0=$(date +%s)
cd "$(dirname "$0")/.."
python -m pip install --no-deps --no-index -q .wheels/antlr4*.whl .wheels/hydra*.whl .wheels/omegaconf*.whl .wheels/plumbum*.whl .wheels/rpyc*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD
R=$OUT/r; mkdir -p $R; cp devscripts/c.sh $R/run.sh
{ nvidia-smi --query-gpu=name,driver_version,memory.total,power.limit,clocks.max.sm --format=csv; nproc; python -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)"; date -u; } > $R/machine.txt 2>&1
nvidia-smi dmon -s pucvm -d 1 -o T > $R/dmon.txt 2>&1 &
DMON=$!
s=$(date +%s)
timeout 340 python -m vlora bench bench.suite=streams 'bench.streams.modes=[head]' 'bench.streams.stream_counts=[34,36,38]' bench.streams.refine=0 bench.streams.seconds=8 bench.streams.hf_baseline=false bench.streams.cold_streams=36 bench.streams.engine_only=true 'bench.streams.engine_only_rates=[36.0]' bench.streams.matmul_sustained_s=20 bench.out_dir=$R/bf16 > $R/bf16.log 2>&1
echo "streams rc=$? $(( $(date +%s) - s )) s"
grep -v USDT $R/bf16.log | grep -E "^\[streams\] (engine in|  |ready|matmul)|^ *(point|cold|warm)|compute floor|^cold|GPU ms" | cut -c1-400
kill $DMON
s=$(date +%s)
LEFT=$(( 560 - ($(date +%s) - T0) ))
timeout $LEFT python -m pytest -q -m gpu tests/kernels/test_sustained_matmul.py tests/serve/engine/test_fp8_fused_gpu.py > $R/gpu_tests.log 2>&1
echo "gpu tests rc=$? $(( $(date +%s) - s )) s"; tail -5 $R/gpu_tests.log | cut -c1-300
cd $OUT && tar czf r.tgz r
