#!/bin/bash
# the whole soak on the GPU with the server's defaults
cd "$(dirname "$0")/.."
python -m pip install --no-deps --no-index -q .wheels/antlr4*.whl .wheels/hydra*.whl .wheels/omegaconf*.whl .wheels/plumbum*.whl .wheels/rpyc*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD
R=$OUT/r; mkdir -p $R; cp devscripts/g2.sh $R/run.sh; echo "$COMMIT" > $R/commit.txt
{ nvidia-smi --query-gpu=name,memory.total --format=csv; nproc; date -u; } > $R/machine.txt 2>&1
s=$(date +%s)
timeout 560 python -u -m vlora bench bench.suite=soak bench.soak.device=cuda bench.out_dir=$R/soak > $R/soak.log 2>&1
echo "soak rc=$? $(( $(date +%s) - s )) s"; grep -v "Writing" $R/soak.log | tail -25 | cut -c1-200
cd $OUT && tar czf r.tgz r && rm -rf r
