#!/bin/bash
T0=$(date +%s)
python -m pip install --no-deps --no-index -q .wheels/antlr4*.whl .wheels/hydra*.whl .wheels/omegaconf*.whl .wheels/plumbum*.whl .wheels/rpyc*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD
R=$OUT/r; mkdir -p $R; cp devscripts/c2.sh $R/run.sh
{ nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv; python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"; date -u; } > $R/machine.txt 2>&1
setv() {  # A: neither change, B: rope_store, C: rope_store + FMA division
  if [ $1 = A ]; then cp devscripts/old/decoder.py serve/models/decoder.py; cp devscripts/old/attention.py serve/forward/attention.py;
  else cp devscripts/new_decoder.py serve/models/decoder.py; cp devscripts/new_attention.py serve/forward/attention.py; fi
  if [ $1 = C ]; then cp devscripts/newk/*.py vlora_kernels/; else cp devscripts/oldk/*.py vlora_kernels/; fi
}
bench() {
  setv $1; s=$(date +%s)
  timeout 150 python -u -m vlora bench bench.suite=fp8 bench.fp8.prompts=2 bench.fp8.gemm=false bench.fp8.switch_repeats=1 \
    'bench.fp8.batch_sizes=[1,32]' bench.fp8.compare_fp8_lm_head=true bench.out_dir=$R/$2 > $R/$2.log 2>&1
  echo "$2 rc=$? $(( $(date +%s) - s )) s"; grep -A4 "^| batch" $R/$2/*/fp8.md | tail -2
}
left() { echo $(( 575 - ($(date +%s) - T0) )); }
setv C
timeout 200 python -m pytest -q -m gpu tests/kernels/test_quotient_rn.py tests/kernels/test_fp8_quant.py tests/kernels/test_fp8_fused_quant.py tests/serve/engine/test_fp8_fused_gpu.py -p no:cacheprovider > $R/gpu_tests.log 2>&1; echo "gpu tests rc=$? at $(( $(date +%s) - T0 )) s"; tail -3 $R/gpu_tests.log
timeout 60 python -m pytest -q tests/kernels/test_fp8_quant.py tests/kernels/test_fp8_fused_quant.py -p no:cacheprovider > $R/cuda_tests.log 2>&1; echo "fp8 quant tests on cuda rc=$?"; tail -2 $R/cuda_tests.log
timeout 60 python devscripts/normbench.py > $R/normbench.log 2>&1; grep "t=32 \(bf16\|fp8\|quant\)" $R/normbench.log
for v in A B C C B A; do
  [ $(left) -lt 75 ] && break
  n=$(( ${n:-0} + 1 )); bench $v ${v}_$n
done
setv C
cd $OUT && tar czf r.tgz r
