#!/bin/bash
# whole soak (WHOLE=1, its floods the default unless WHOLE_F) and the floods alone on a GPU, RUNS rounds; SETS="a b"
# alternates server settings (A_OVR, B_OVR: bench.soak.server_overrides lists)
cd "$(dirname "$0")/.."
python -m pip install --no-deps --no-index -q .wheels/antlr4*.whl .wheels/hydra*.whl .wheels/omegaconf*.whl .wheels/plumbum*.whl .wheels/rpyc*.whl .wheels/starlette*.whl .wheels/uvicorn*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD
R=$OUT/r; mkdir -p $R; cp devscripts/g3.sh $R/run.sh; git rev-parse --short HEAD > $R/commit.txt 2>/dev/null
{ nvidia-smi --query-gpu=name,memory.total --format=csv; nproc; lscpu | grep -i "Model name\|Thread(s) per core\|Core(s) per socket\|Socket(s)"; python -c "import torch, triton, transformers, starlette, uvicorn; print(torch.__version__, triton.__version__, transformers.__version__, starlette.__version__, uvicorn.__version__)"; date -u; } > $R/machine.txt 2>&1
cat $R/machine.txt
F="bench.soak.floods=${FLOODS:-[long,topup4,queue2048,topup32]}"
if [ "${WHOLE:-0}" = 1 ]; then
  s=$(date +%s)
  timeout ${WHOLE_S:-300} python -u -m vlora bench bench.suite=soak bench.soak.device=cuda ${WHOLE_F:+"bench.soak.floods=$WHOLE_F"} bench.out_dir=$R/whole > $R/whole.log 2>&1
  echo "whole rc=$? $(( $(date +%s) - s )) s"; grep "done in\|fairness_\|missed\|rss" $R/whole.log | cut -c1-160
fi
# SETS="a b": each round runs set a (overrides ${A_OVR}) then set b (${B_OVR}), e.g. A_OVR='[]' B_OVR='[engine.x=1]'
for i in ${RUNS:-1}; do
  for set in ${SETS:-a}; do
    v=${set^^}_OVR; ovr=${!v:-[]}
    s=$(date +%s)
    timeout ${RUN_S:-160} python -u -m vlora bench bench.suite=soak bench.soak.device=cuda '+bench.soak.phases=[floods]' "$F" "bench.soak.server_overrides=$ovr" bench.out_dir=$R/${set}_$i > $R/${set}_$i.log 2>&1
    echo "${set}_$i rc=$? $(( $(date +%s) - s )) s $ovr"; grep "fairness_" $R/${set}_$i.log | cut -c1-150
  done
done
cd $OUT && tar czf r.tgz r && rm -rf r
