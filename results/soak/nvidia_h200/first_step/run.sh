#!/bin/bash
# the first-step rule (engine.tenant_first_step_alone) on and off, alternated: the floods
cd "$(dirname "$0")/.."
python -m pip install --no-deps --no-index -q .wheels/antlr4*.whl .wheels/hydra*.whl .wheels/omegaconf*.whl .wheels/plumbum*.whl .wheels/rpyc*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD
R=$OUT/r; mkdir -p $R; cp devscripts/b1.sh $R/run.sh
{ nvidia-smi --query-gpu=name,memory.total --format=csv; nproc; lscpu | grep "Model name"; python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"; date -u; git log -1 --format=%h 2>/dev/null; } > $R/machine.txt 2>&1
T0=$(date +%s)
run() {  # name, overrides list
  left=$(( 570 - ($(date +%s) - T0) ))
  if [ $left -lt 150 ]; then echo "$1 skipped ($left s left)"; return; fi
  s=$(date +%s)
  timeout $(( left - 10 )) python -u -m vlora bench bench.suite=soak bench.soak.device=cuda '+bench.soak.phases=[floods]' "bench.soak.server_overrides=$2" bench.out_dir=$R/$1 > $R/$1.log 2>&1
  echo "$1 rc=$? $(( $(date +%s) - s )) s"; grep "fairness_" $R/$1.log | cut -c1-160
}
for name in "$@"; do
  case $name in
    alone*) run $name "[]" ;;
    shared*) run $name '["engine.tenant_first_step_alone=false"]' ;;
  esac
done
cd $OUT && tar czf r.tgz r && rm -rf r
