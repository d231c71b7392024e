#!/bin/bash
# two H200s. Stores part 1 of Ray's wheel for the next call (c2.sh, same warm machine), then the Qwen2-VL-72B shape
# (random weights drawn on each rank, bf16) as one tensor-parallel group of 2 behind the RPyC front end, cameras searched
# to 1 s p95, then rank 0's profile of a chunk and of the decode step.
T0=$(date +%s)

python -m pip install --no-deps --no-index -q .wheels/antlr4*.whl .wheels/hydra*.whl .wheels/omegaconf*.whl .wheels/plumbum*.whl .wheels/rpyc*.whl 2>&1 | tail -2
R=$OUT/r; mkdir -p $R; cp devscripts/c3.sh $R/run.sh
{ nvidia-smi --query-gpu=index,name,memory.total --format=csv; nvidia-smi topo -m; python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"; nproc; free -g | head -2; df -h /tmp | tail -1; date -u; } > $R/machine.txt 2>&1
cd devscripts/B
s=$(date +%s)
timeout 300 python -u -m vlora bench bench.suite=scaling bench.scaling.workload=streams 'bench.scaling.streams.setups=[tp]' \
  bench.scaling.streams.model=qwen2_vl_72b bench.scaling.streams.tp_size=2 'bench.scaling.streams.stream_counts=[10,12,14,16]' \
  bench.scaling.streams.refine=1 bench.scaling.streams.seconds=8 bench.scaling.streams.max_batch_size=16 \
  bench.scaling.streams.budget_s=220 bench.out_dir=$R/scaling72b > $R/scaling72b.log 2>&1
echo "72b rc=$? $(( $(date +%s) - s )) s"; grep -v "^\s*$" $R/scaling72b.log | grep -vi "warn" | tail -40 | cut -c1-250
nvidia-smi --query-gpu=index,memory.used --format=csv
echo "done at $(( $(date +%s) - T0 )) s"
cd $OUT && tar czf r.tgz r && rm -rf r
