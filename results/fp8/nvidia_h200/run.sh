#!/bin/bash
# one H200: (1) the FP8 GPU tests, (2) the fp8 suite at the Qwen2-VL-7B shape, (3) the streams cold point on
# empty kernel caches with the warm-up's heap settled (gc.freeze) and every point's garbage collections recorded
python -m pip install --no-deps --no-index -q .wheels/antlr4*.whl .wheels/hydra*.whl .wheels/omegaconf*.whl .wheels/plumbum*.whl .wheels/rpyc*.whl 2>&1 | tail -2
R=$OUT/r; mkdir -p $R; cp devscripts/final1.sh $R/run.sh
{ nvidia-smi --query-gpu=name,memory.total --format=csv; python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"; date -u; } > $R/machine.txt 2>&1
cd devscripts/B
s=$(date +%s)
timeout 170 python -m pytest -q -m gpu tests/serve/engine/test_fp8_gpu.py tests/kernels/test_fp8_quant.py tests/kernels/test_fp8_merge_kernel.py > $R/fp8_gpu_tests.log 2>&1
echo "fp8 tests rc=$? $(( $(date +%s) - s )) s"; tail -3 $R/fp8_gpu_tests.log
s=$(date +%s)
timeout 200 python -m vlora bench bench.suite=fp8 bench.out_dir=$R/fp8 > $R/fp8_bench.log 2>&1
echo "fp8 bench rc=$? $(( $(date +%s) - s )) s"; tail -25 $R/fp8_bench.log | cut -c1-250
C=/tmp/coldcaches; mkdir -p $C/triton $C/inductor
s=$(date +%s)
TRITON_CACHE_DIR=$C/triton TORCHINDUCTOR_CACHE_DIR=$C/inductor timeout 200 python -u -m vlora bench bench.suite=streams 'bench.streams.modes=[head]' bench.streams.hf_baseline=false \
    'bench.streams.stream_counts=[28]' bench.streams.refine=0 bench.streams.seconds=8 bench.streams.engine_only=false \
    bench.streams.fresh_caches=false bench.streams.cold_streams=28 bench.out_dir=$R/streams_A > $R/run_A.log 2>&1
echo "cold rc=$? $(( $(date +%s) - s )) s"; grep -E "warmed up|cold|mode=head streams=28 offered|compiled .* after" $R/run_A.log | cut -c1-420
cd $OUT && tar czf r.tgz r && rm -rf r
