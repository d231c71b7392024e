#!/bin/bash
# Confirms the split-K scale-read fix on a GPU: the chain's GPU tests, then chain off/on alternated.
T0=$(date +%s)
python -m pip install --no-deps --no-index -q .wheels/antlr4*.whl .wheels/hydra*.whl .wheels/omegaconf*.whl .wheels/plumbum*.whl .wheels/rpyc*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD
R=$OUT/r; mkdir -p $R; cp devscripts/c7.sh $R/run.sh
{ nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv; python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"; date -u; git log -1 --format=%h; } > $R/machine.txt 2>&1
bench() {  # $1: VLORA_PDL_CHAIN, $2: name
  s=$(date +%s)
  VLORA_PDL_CHAIN=$1 timeout 150 python -u -m vlora bench bench.suite=fp8 bench.fp8.prompts=2 bench.fp8.gemm=false bench.fp8.switch_repeats=1 \
    'bench.fp8.batch_sizes=[1,32]' bench.fp8.compare_fp8_lm_head=true bench.out_dir=$R/$2 > $R/$2.log 2>&1
  echo "$2 rc=$? $(( $(date +%s) - s )) s"; f=$(ls $R/$2/*/fp8.md 2>/dev/null); [ -n "$f" ] && { grep "^| fp8 | none | unmerged | fp32" $f; grep -A4 "^| batch" $f | tail -2; }
}
left() { echo $(( 585 - ($(date +%s) - T0) )); }
timeout 200 python -m pytest -q -m gpu tests/serve/engine/test_pdl_chain_gpu.py tests/serve/engine/test_fp8_fused_gpu.py -p no:cacheprovider > $R/gpu_tests.log 2>&1; echo "gpu tests rc=$? at $(( $(date +%s) - T0 )) s"; tail -3 $R/gpu_tests.log
for v in 1 0 1 0 1 0; do
  [ $(left) -lt 100 ] && break
  n=$(( ${n:-0} + 1 )); bench $v chain${v}_$n
done
cd $OUT && tar czf r.tgz r
