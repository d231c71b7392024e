#!/bin/bash
# FP8 decode: o_proj's rows written by the decode attention (per kv head group) and the bias in the GEMM; A/B
T0=$(date +%s)
python -m pip install --no-deps --no-index -q .wheels/antlr4*.whl .wheels/hydra*.whl .wheels/omegaconf*.whl .wheels/plumbum*.whl .wheels/rpyc*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD
R=$OUT/r; mkdir -p $R; cp devscripts/f4.sh $R/run.sh
{ nvidia-smi --query-gpu=index,name,memory.total --format=csv; python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"; nproc; date -u; } > $R/machine.txt 2>&1
bench() {  # $1 run, $2 profile
s=$(date +%s)
LEFT=$(( 590 - ($(date +%s) - T0) ))
[ $LEFT -lt 100 ] && { echo "bench $1 skipped: $LEFT s left"; return; }
timeout $LEFT python -m vlora bench bench.suite=fp8 bench.fp8.profile=$2 bench.fp8.prompts=8 bench.fp8.compare_attention_rows=true bench.fp8.compare_fp8_lm_head=true bench.fp8.gemm=false bench.fp8.switch_repeats=3 bench.out_dir=$R/fp8_$1 > $R/fp8_bench_$1.log 2>&1
echo "fp8 bench $1 rc=$? $(( $(date +%s) - s )) s"
grep -A8 "## Decode step (ms)" $R/fp8_bench_$1.log
grep -A14 "## Decode step profile" $R/fp8_bench_$1.log | cut -c1-220
grep -E "^\\| (fp8_no_attn_rows|fp8_head|fp8) \\| (none|a) " $R/fp8_bench_$1.log | cut -c1-200
}
bench 1 true
s=$(date +%s)
timeout 200 python -m pytest -q -m gpu tests/kernels/test_fp8_decode.py tests/serve/engine/test_fp8_fused_gpu.py > $R/fp8_gpu_tests.log 2>&1
timeout 60 python -m pytest -q tests/serve/forward/test_paged_attention.py tests/serve/models/test_fp8_fused_producers.py >> $R/fp8_gpu_tests.log 2>&1
echo "fp8 gpu tests rc=$? $(( $(date +%s) - s )) s"; grep -E "passed|failed|FAILED|Error" $R/fp8_gpu_tests.log | tail -14 | cut -c1-250
bench 2 false
cd $OUT && tar czf r.tgz r
