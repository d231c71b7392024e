#!/bin/bash
# the soak on the GPU: floods alone without and with a front-end process per tenant, then the full soak (with)
cd "$(dirname "$0")/.."
python -m pip install --no-deps --no-index -q .wheels/antlr4*.whl .wheels/hydra*.whl .wheels/omegaconf*.whl .wheels/plumbum*.whl .wheels/rpyc*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD
R=$OUT/r; mkdir -p $R; cp devscripts/d.sh $R/run.sh; git log --oneline -1 > $R/commit.txt 2>/dev/null
{ nvidia-smi --query-gpu=name,memory.total --format=csv; nproc; python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"; date -u; } > $R/machine.txt 2>&1
i=0; for v in 8; do i=$((i+1))
  s=$(date +%s)
  timeout 140 python -u -m vlora bench bench.suite=soak bench.soak.device=cuda '+bench.soak.phases=[floods]' "bench.soak.server_overrides=[\"rpc.tenant_processes=$v\"]" bench.out_dir=$R/floods_tp${v}_$i > $R/floods_tp${v}_$i.log 2>&1
  echo "floods tp=$v rc=$? $(( $(date +%s) - s )) s"; grep -v "Writing" $R/floods_tp${v}_$i.log | tail -14 | cut -c1-250
done
s=$(date +%s)
timeout 280 python -u -m vlora bench bench.suite=soak bench.soak.device=cuda bench.out_dir=$R/soak > $R/soak.log 2>&1
echo "soak rc=$? $(( $(date +%s) - s )) s"; grep -v "Writing" $R/soak.log | tail -25 | cut -c1-300
cd $OUT && tar czf r.tgz r && rm -rf r
