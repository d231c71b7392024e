#!/bin/bash
# The split-K sums left to the fused norm (serve/models/fp8.py NORM_SUMS): GPU tests, then the 7B step A/B alternated.
T0=$(date +%s)
python -m pip install --no-deps --no-index -q .wheels/antlr4*.whl .wheels/hydra*.whl .wheels/omegaconf*.whl .wheels/plumbum*.whl .wheels/rpyc*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD
R=$OUT/r; mkdir -p $R; cp devscripts/c9.sh $R/run.sh
{ nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv; python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"; date -u; git log -1 --format=%h; } > $R/machine.txt 2>&1
left() { echo $(( 585 - ($(date +%s) - T0) )); }
if [ "${TESTS:-1}" = 1 ]; then
  timeout 300 python -m pytest -q -m gpu tests/kernels/test_fp8_norm_sums.py tests/serve/engine/test_fp8_norm_sums_gpu.py tests/serve/engine/test_pdl_chain_gpu.py -p no:cacheprovider > $R/gpu_tests.log 2>&1
  echo "gpu tests rc=$? at $(( $(date +%s) - T0 )) s"; tail -3 $R/gpu_tests.log
fi
bench() {  # $1: name, rest: runwith settings
  n=$1; shift; s=$(date +%s)
  timeout 150 python -u devscripts/runwith.py "$@" -- bench bench.suite=fp8 bench.fp8.prompts=2 bench.fp8.gemm=false bench.fp8.switch_repeats=1 \
    'bench.fp8.batch_sizes=[1,32]' bench.fp8.compare_fp8_lm_head=true bench.out_dir=$R/$n > $R/$n.log 2>&1
  echo "$n rc=$? $(( $(date +%s) - s )) s"; f=$(ls $R/$n/*/fp8.md 2>/dev/null); [ -n "$f" ] && { grep "^| fp8 | none | unmerged | fp32" $f; grep -A4 "^| batch" $f | tail -2; }
}
for v in ${ORDER:-1 0 1 0 1 0}; do
  [ $(left) -lt 95 ] && break
  i=$(( ${i:-0} + 1 ))
  bench sums${v}_$i serve.models.fp8.NORM_SUMS=$([ $v = 1 ] && echo True || echo False)
done
cd $OUT && tar czf r.tgz r
