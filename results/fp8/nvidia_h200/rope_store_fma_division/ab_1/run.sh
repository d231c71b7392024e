#!/bin/bash
T0=$(date +%s)
python -m pip install --no-deps --no-index -q .wheels/antlr4*.whl .wheels/hydra*.whl .wheels/omegaconf*.whl .wheels/plumbum*.whl .wheels/rpyc*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD
R=$OUT/r; mkdir -p $R; cp devscripts/c1.sh $R/run.sh
{ nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv; python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"; date -u; } > $R/machine.txt 2>&1
timeout 100 python devscripts/normbench.py > $R/normbench.log 2>&1; echo "normbench rc=$? at $(( $(date +%s) - T0 )) s"; cp $OUT/normbench.json $R/ 2>/dev/null
grep "t=32" $R/normbench.log | head -40
bench() {  # $1: old|new, $2: run name
  if [ $1 = old ]; then cp devscripts/old/decoder.py serve/models/decoder.py; cp devscripts/old/attention.py serve/forward/attention.py;
  else cp devscripts/new_decoder.py serve/models/decoder.py; cp devscripts/new_attention.py serve/forward/attention.py; fi
  s=$(date +%s)
  timeout 200 python -u -m vlora bench bench.suite=fp8 bench.fp8.prompts=2 bench.fp8.gemm=false bench.fp8.switch_repeats=1 \
    'bench.fp8.batch_sizes=[1,32]' bench.fp8.compare_fp8_lm_head=true bench.out_dir=$R/$2 > $R/$2.log 2>&1
  echo "$2 rc=$? $(( $(date +%s) - s )) s"; grep -A6 "^| batch" $R/$2/fp8.md | head -6
}
bench old old_1
bench new new_1
cp devscripts/new_decoder.py serve/models/decoder.py; cp devscripts/new_attention.py serve/forward/attention.py
LEFT=$(( 560 - ($(date +%s) - T0) ))
echo "tests with $LEFT s left"
timeout 60 python -m pytest -q tests/serve/models/test_fused_kernels.py -p no:cacheprovider > $R/fused_tests.log 2>&1; echo "fused tests rc=$?"; tail -2 $R/fused_tests.log
timeout $(( LEFT - 70 )) python -m pytest -q -m gpu tests/serve/forward/test_paged_attention.py tests/kernels/test_fp8_decode.py tests/serve/engine/test_fp8_fused_gpu.py -p no:cacheprovider > $R/gpu_tests.log 2>&1; echo "tests rc=$?"; tail -5 $R/gpu_tests.log
cd $OUT && tar czf r.tgz r
