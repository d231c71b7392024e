#!/bin/bash
# decode attention split over the context (A/B by VLORA_DECODE_SPLITS=1), FP8 and bf16 decode steps, GPU tests
T0=$(date +%s)
python -m pip install --no-deps --no-index -q .wheels/antlr4*.whl .wheels/hydra*.whl .wheels/omegaconf*.whl .wheels/plumbum*.whl .wheels/rpyc*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD
R=$OUT/r; mkdir -p $R; cp devscripts/f5.sh $R/run.sh
{ nvidia-smi --query-gpu=index,name,memory.total --format=csv; python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"; nproc; date -u; } > $R/machine.txt 2>&1
bench() {  # $1 name, $2 profile, $3 splits env
s=$(date +%s)
LEFT=$(( 480 - ($(date +%s) - T0) ))
[ $LEFT -lt 100 ] && { echo "bench $1 skipped: $LEFT s left"; return; }
VLORA_DECODE_SPLITS=$3 timeout $LEFT python -m vlora bench bench.suite=fp8 bench.fp8.profile=$2 bench.fp8.prompts=8 bench.fp8.compare_fp8_lm_head=true bench.fp8.gemm=false bench.fp8.switch_repeats=3 bench.out_dir=$R/$1 > $R/$1.log 2>&1
echo "bench $1 (VLORA_DECODE_SPLITS=$3) rc=$? $(( $(date +%s) - s )) s"
grep -A8 "## Decode step (ms)" $R/$1.log
grep -A12 "## Decode step profile" $R/$1.log | grep -E "\| (bf16|fp8|fp8_head) \| (1|32) " | cut -c1-200
grep -E "^\\| (bf16|fp8|fp8_head) \\| none \\| unmerged \\| fp32" $R/$1.log | cut -c1-160
}
bench split_1 true ""
bench nosplit_1 false 1
s=$(date +%s)
timeout 150 python -m pytest -q -m gpu tests/serve/forward/test_paged_attention.py tests/serve/engine/test_fp8_fused_gpu.py tests/serve/engine/test_engine_gpu.py > $R/gpu_tests.log 2>&1
echo "gpu tests rc=$? $(( $(date +%s) - s )) s"; grep -E "passed|failed|FAILED|Error" $R/gpu_tests.log | tail -14 | cut -c1-250
bench split_2 false ""
cd $OUT && tar czf r.tgz r
