#!/bin/bash
# the tree as it stands on a GPU: the whole soak (every phase, the HTTP port's poll flood and the victim
# tenant's own flood added), then the floods alone, RUNS rounds; the `cpu` record of each flood says where the
# machine's cores went.
cd "$(dirname "$0")/.."
python -m pip install --no-deps --no-index -q .wheels/antlr4*.whl .wheels/hydra*.whl .wheels/omegaconf*.whl .wheels/plumbum*.whl .wheels/rpyc*.whl .wheels/starlette*.whl .wheels/uvicorn*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD
R=$OUT/r; mkdir -p $R; cp devscripts/g2.sh $R/run.sh; git rev-parse --short HEAD > $R/commit.txt 2>/dev/null
{ nvidia-smi --query-gpu=name,memory.total --format=csv; nproc; lscpu | grep -i "Model name\|Thread(s) per core\|Core(s) per socket\|Socket(s)"; python -c "import torch, triton, transformers, starlette, uvicorn; print(torch.__version__, triton.__version__, transformers.__version__, starlette.__version__, uvicorn.__version__)"; date -u; } > $R/machine.txt 2>&1
cat $R/machine.txt
F='bench.soak.floods=[long,topup4,queue2048,topup32,poll32,httppoll32,own64]'
if [ "${WHOLE:-1}" = 1 ]; then
  s=$(date +%s)
  timeout ${WHOLE_S:-300} python -u -m vlora bench bench.suite=soak bench.soak.device=cuda "$F" bench.out_dir=$R/whole > $R/whole.log 2>&1
  echo "whole rc=$? $(( $(date +%s) - s )) s"; grep "done in\|fairness_\|missed\|rss" $R/whole.log | cut -c1-160
fi
for i in ${RUNS:-1}; do
  s=$(date +%s)
  timeout 160 python -u -m vlora bench bench.suite=soak bench.soak.device=cuda '+bench.soak.phases=[floods]' "$F" bench.out_dir=$R/floods_$i > $R/floods_$i.log 2>&1
  echo "floods_$i rc=$? $(( $(date +%s) - s )) s"; grep "fairness_" $R/floods_$i.log | cut -c1-150
done
cd $OUT && tar czf r.tgz r && rm -rf r
