#!/bin/bash
# call 3: FP8 heads: a cold point at 48, warm 48/52/56, two ramps at 48; then bf16 seed 3 (cold 36, warm 36, ramps)
T0=$(date +%s)
cd "$(dirname "$0")/.."
python -m pip install --no-deps --no-index -q .wheels/antlr4*.whl .wheels/hydra*.whl .wheels/omegaconf*.whl .wheels/plumbum*.whl .wheels/rpyc*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD
R=$OUT/r; mkdir -p $R; cp devscripts/f.sh $R/run.sh
{ nvidia-smi --query-gpu=name,driver_version,memory.total,power.limit,clocks.max.sm --format=csv; nproc; python -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)"; date -u; } > $R/machine.txt 2>&1
nvidia-smi dmon -s pucvm -d 1 -o T > $R/dmon.txt 2>&1 &
DMON=$!
COMMON="bench.suite=streams bench.streams.modes=[head] bench.streams.refine=0 bench.streams.seconds=8 bench.streams.hf_baseline=false bench.streams.engine_only=false bench.streams.matmul_sustained_s=0"
s=$(date +%s); date -u +%T > $R/t_fp8.txt
timeout 300 python -m vlora bench $COMMON bench.streams.quantization=fp8 bench.streams.cold_streams=48 'bench.streams.stream_counts=[48,52,56]' 'bench.streams.ramp_counts=[48,48]' bench.out_dir=$R/fp8 > $R/fp8.log 2>&1
echo "fp8 rc=$? $(( $(date +%s) - s )) s"
grep -v USDT $R/fp8.log | grep -E "^\[streams [0-9:]+\] (ready|cold mode|engine warm)|^ *(point|cold|warm|ramp) |^cold|ramp\)" | cut -c1-330
s=$(date +%s); date -u +%T > $R/t_seed3.txt
LEFT=$(( 585 - ($(date +%s) - T0) ))
timeout $LEFT python -m vlora bench $COMMON bench.streams.cold_streams=36 'bench.streams.stream_counts=[36]' 'bench.streams.ramp_counts=[36,36,36]' bench.streams.seed=3 bench.out_dir=$R/seed3 > $R/seed3.log 2>&1
echo "seed 3 rc=$? $(( $(date +%s) - s )) s"
grep -v USDT $R/seed3.log | grep -E "^\[streams [0-9:]+\] (ready|cold mode|engine warm)|^ *(point|cold|warm|ramp) |^cold|ramp\)" | cut -c1-330
kill $DMON
cd $OUT && tar czf r.tgz r
