#!/bin/bash
# FP8 producers launched with PDL behind the kernel before them (A/B), and the LM head in FP8 (A/B)
T0=$(date +%s)
python -m pip install --no-deps --no-index -q .wheels/antlr4*.whl .wheels/hydra*.whl .wheels/omegaconf*.whl .wheels/plumbum*.whl .wheels/rpyc*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD
R=$OUT/r; mkdir -p $R; cp devscripts/f3.sh $R/run.sh
{ nvidia-smi --query-gpu=index,name,memory.total --format=csv; python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"; nproc; date -u; } > $R/machine.txt 2>&1
s=$(date +%s)
: # GPU tests left out: the suite's accuracy rows (fp8_producer_pdl against fp8) check the same bits
echo "fp8 gpu tests rc=$? $(( $(date +%s) - s )) s"; grep -E "passed|failed|FAILED|Error" $R/fp8_gpu_tests.log | tail -12 | cut -c1-250
for run in 1; do
s=$(date +%s)
LEFT=$(( 150 - ($(date +%s) - T0) ))
[ $LEFT -lt 80 ] && break
timeout $LEFT python -m vlora bench bench.suite=fp8 bench.fp8.profile=false bench.fp8.prompts=8 bench.fp8.compare_producer_pdl=true bench.fp8.compare_fp8_lm_head=true bench.fp8.gemm=false bench.fp8.switch_repeats=3 bench.out_dir=$R/fp8_$run > $R/fp8_bench_$run.log 2>&1
echo "fp8 bench $run rc=$? $(( $(date +%s) - s )) s"
grep -A8 "## Decode step (ms)" $R/fp8_bench_$run.log
grep -A12 "## Decode step profile" $R/fp8_bench_$run.log | grep "fp8" | cut -c1-200
grep -E "^- (fp8|fp8_producer_pdl|fp8_head) b32" $R/fp8_bench_$run.log | cut -c1-300
grep -E "^\\| (fp8_producer_pdl|fp8_head) \\| (none|a) " $R/fp8_bench_$run.log | cut -c1-200
done
cd $OUT && tar czf r.tgz r
