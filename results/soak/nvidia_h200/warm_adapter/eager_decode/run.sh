#!/bin/bash
# the warm-up with its made-up adapter and its eager decode sizes: the whole soak on a server that starts with no adapter
cd "$(dirname "$0")/.."
python -m pip install --no-deps --no-index -q .wheels/antlr4*.whl .wheels/hydra*.whl .wheels/omegaconf*.whl .wheels/plumbum*.whl .wheels/rpyc*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD
R=$OUT/r; mkdir -p $R; cp devscripts/w4.sh $R/run.sh
{ nvidia-smi --query-gpu=name,memory.total --format=csv; nproc; lscpu | grep "Model name"; python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"; date -u; } > $R/machine.txt 2>&1
s=$(date +%s)
timeout 420 python -u -m vlora bench bench.suite=soak bench.soak.device=cuda bench.out_dir=$R/whole > $R/whole.log 2>&1
echo "whole rc=$? $(( $(date +%s) - s )) s"; grep -E "soak: |NO$|fairness_" $R/whole.log | cut -c1-170 | tail -32
python - $R/whole/*/soak.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for line in d.get("log_tail", "").splitlines():
    if "compiled" in line or "warm" in line.lower():
        print(line[:260])
print("boundary", d["phases"].get("boundary"))
PY
cd $OUT && tar czf r.tgz r && rm -rf r
