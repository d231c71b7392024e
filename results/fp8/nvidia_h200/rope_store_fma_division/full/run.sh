#!/bin/bash
python -m pip install --no-deps --no-index -q .wheels/antlr4*.whl .wheels/hydra*.whl .wheels/omegaconf*.whl .wheels/plumbum*.whl .wheels/rpyc*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD
R=$OUT/r; mkdir -p $R; cp devscripts/c3.sh $R/run.sh
{ nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv; python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"; date -u; } > $R/machine.txt 2>&1
timeout 230 python -u -m vlora bench bench.suite=fp8 bench.fp8.prompts=8 bench.fp8.compare_fp8_lm_head=true bench.fp8.gemm=false bench.fp8.switch_repeats=3 bench.fp8.profile=true bench.out_dir=$R/full > $R/full.log 2>&1
echo "full rc=$?"; grep -A5 "^| batch" $R/full/*/fp8.md | head -6
cd $OUT && tar czf r.tgz r
