#!/bin/bash
# With the PDL chain on (the default): FP8 heads, a cold point at 48 then warm 48/52; bf16 heads over a 60 s window at 36.
T0=$(date +%s)
python -m pip install --no-deps --no-index -q .wheels/antlr4*.whl .wheels/hydra*.whl .wheels/omegaconf*.whl .wheels/plumbum*.whl .wheels/rpyc*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD
R=$OUT/r; mkdir -p $R; cp devscripts/c11.sh $R/run.sh
{ nvidia-smi --query-gpu=name,driver_version,memory.total,power.limit,clocks.max.sm --format=csv; nproc; python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"; date -u; } > $R/machine.txt 2>&1
COMMON="bench.suite=streams bench.streams.modes=[head] bench.streams.refine=0 bench.streams.seconds=8 bench.streams.hf_baseline=false bench.streams.engine_only=false bench.streams.matmul_sustained_s=0"
s=$(date +%s)
timeout 230 python -m vlora bench $COMMON bench.streams.quantization=fp8 bench.streams.cold_streams=48 'bench.streams.stream_counts=[48,52]' bench.out_dir=$R/fp8 > $R/fp8.log 2>&1
echo "fp8 rc=$? $(( $(date +%s) - s )) s"; grep -E "^ *(point|cold|warm) |^cold" $R/fp8.log | cut -c1-220
left=$(( 585 - ($(date +%s) - T0) ))
s=$(date +%s)
timeout $(( left - 10 )) python -m vlora bench $COMMON bench.streams.cold_streams=0 'bench.streams.stream_counts=[36]' 'bench.streams.window_counts=[36]' bench.streams.window_seconds=60 bench.out_dir=$R/bf16_window > $R/bf16_window.log 2>&1
echo "bf16 window rc=$? $(( $(date +%s) - s )) s"; grep -E "^ *(point|warm|window) " $R/bf16_window.log | cut -c1-220
cd $OUT && tar czf r.tgz r
