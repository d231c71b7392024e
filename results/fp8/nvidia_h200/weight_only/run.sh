#!/bin/bash
# call 2: FP8 decode GEMMs on bf16 activations (weight-only) against per-token FP8 ones: GPU tests, the fp8 suite
# with its profile and fp8_a8 beside fp8, then a sweep of the weight-only launches for gate_up and down
T0=$(date +%s)
cd "$(dirname "$0")/.."
python -m pip install --no-deps --no-index -q .wheels/antlr4*.whl .wheels/hydra*.whl .wheels/omegaconf*.whl .wheels/plumbum*.whl .wheels/rpyc*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD
R=$OUT/r; mkdir -p $R; cp devscripts/b.sh $R/run.sh
{ nvidia-smi --query-gpu=index,name,memory.total --format=csv; python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"; nproc; date -u; } > $R/machine.txt 2>&1
s=$(date +%s)
timeout 200 python -m pytest -q -m gpu tests/kernels/test_fp8_decode.py tests/serve/engine/test_fp8_gpu.py tests/serve/engine/test_fp8_fused_gpu.py > $R/fp8_gpu_tests.log 2>&1
echo "fp8 gpu tests rc=$? $(( $(date +%s) - s )) s"; grep -E "passed|failed|FAILED|Error" $R/fp8_gpu_tests.log | tail -12 | cut -c1-250
s=$(date +%s)
timeout 200 python -m vlora bench bench.suite=fp8 bench.fp8.profile=true bench.fp8.compare_a8=true bench.out_dir=$R/fp8 > $R/fp8_bench.log 2>&1
echo "fp8 bench rc=$? $(( $(date +%s) - s )) s"
grep -A8 "## Decode step (ms)" $R/fp8_bench.log
grep -E "^- batch" $R/fp8_bench.log | cut -c1-300
s=$(date +%s)
LEFT=$(( 585 - ($(date +%s) - T0) ))
timeout $LEFT python -m bench.fp8_decode_sweep --activations bf16 --projections gate_up_proj down_proj --m 1 32 64 --out $R/sweep_w.csv > $R/sweep_w.log 2>&1
echo "sweep rc=$? $(( $(date +%s) - s )) s"; tail -18 $R/sweep_w.log | cut -c1-220
cd $OUT && tar czf r.tgz r
