#!/bin/bash
# two H200s: TP=2's timings again with each rank at its share of the cores (LocalGroup's rank_threads), one GPU's rows
# and the parity rows carried over from the previous run (tp_seed2.json), so only the group is built and timed.
T0=$(date +%s)
python -m pip install --no-deps --no-index -q .wheels/antlr4*.whl .wheels/hydra*.whl .wheels/omegaconf*.whl 2>&1 | tail -2
R=$OUT/r; mkdir -p $R/tp/nvidia_h200; cp devscripts/d.sh $R/run.sh; cp devscripts/tp_seed2.json $R/tp/nvidia_h200/tp.json
{ nvidia-smi --query-gpu=index,name --format=csv; nproc; date -u; } > $R/machine.txt 2>&1
cd devscripts/B
timeout 150 python -u -m vlora bench bench.suite=tp 'bench.tp.sizes=[2]' bench.tp.shape=7b 'bench.tp.batches=[1,32,64]' \
    bench.tp.budget_s=140 bench.out_dir=$R/tp > $R/tp.log 2>&1
echo "tp rc=$? $(( $(date +%s) - T0 )) s"; grep -A5 "## Vision encoder" $R/tp.log | tail -3; grep -A3 "| tp | tower_ms" $R/tp.log | tail -1; grep -E "^\| 32 \| 2 " $R/tp.log | head -2
cd $OUT && tar czf r.tgz r && rm -rf r
