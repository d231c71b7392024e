#!/bin/bash
# the tree as it stands on a GPU: (1) the whole soak with the HTTP port's floods added, (2) the floods alone with
# quiet steps on and off (engine.tenant_quiet_prefill), alternated. WHOLE=0 skips (1); RUNS names (2)'s rounds.
cd "$(dirname "$0")/.."
python -m pip install --no-deps --no-index -q .wheels/antlr4*.whl .wheels/hydra*.whl .wheels/omegaconf*.whl .wheels/plumbum*.whl .wheels/rpyc*.whl .wheels/starlette*.whl .wheels/uvicorn*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD
R=$OUT/r; mkdir -p $R; cp devscripts/g1.sh $R/run.sh; git rev-parse --short HEAD > $R/commit.txt 2>/dev/null
{ nvidia-smi --query-gpu=name,memory.total --format=csv; nproc; lscpu | grep "Model name"; python -c "import torch, triton, transformers, starlette, uvicorn; print(torch.__version__, triton.__version__, transformers.__version__, starlette.__version__, uvicorn.__version__)"; date -u; } > $R/machine.txt 2>&1
cat $R/machine.txt
if [ "${WHOLE:-1}" = 1 ]; then
  s=$(date +%s)
  timeout 290 python -u -m vlora bench bench.suite=soak bench.soak.device=cuda 'bench.soak.floods=[long,topup4,queue2048,topup32,poll32,httppoll32]' "bench.soak.server_overrides=[\"engine.tenant_quiet_prefill=${WHOLE_QUIET:-false}\"]" bench.out_dir=$R/whole${WHOLE_QUIET:+_quiet} > $R/whole${WHOLE_QUIET:+_quiet}.log 2>&1
  echo "whole rc=$? $(( $(date +%s) - s )) s"; grep "done in\|fairness_\|missed\|rss\|http" $R/whole*.log | cut -c1-160
fi
run() {  # name, quiet
  s=$(date +%s)
  timeout 140 python -u -m vlora bench bench.suite=soak bench.soak.device=cuda '+bench.soak.phases=[floods]' "bench.soak.server_overrides=[\"engine.tenant_quiet_prefill=$2\"]" bench.out_dir=$R/$1 > $R/$1.log 2>&1
  echo "$1 rc=$? $(( $(date +%s) - s )) s"; grep "fairness_" $R/$1.log | cut -c1-150
}
for i in ${RUNS:-1}; do for arm in ${ARMS:-on off}; do if [ $arm = on ]; then run on_$i true; else run off_$i false; fi; done; done
if [ -n "$GPUTESTS" ]; then timeout 200 python -m pytest -q -m gpu tests/serve/rpc tests/serve/engine/test_engine_gpu.py > $R/gpu_tests.txt 2>&1; echo "gpu tests rc=$?"; tail -3 $R/gpu_tests.txt; fi
cd $OUT && tar czf r.tgz r && rm -rf r
