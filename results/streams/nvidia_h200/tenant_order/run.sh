#!/bin/bash
# call 3: streams (heads) bf16 then FP8, each in its own process, after the per-tenant sharing and the tower's Triton chains
cd "$(dirname "$0")/.."
python -m pip install --no-deps --no-index -q .wheels/antlr4*.whl .wheels/hydra*.whl .wheels/omegaconf*.whl .wheels/plumbum*.whl .wheels/rpyc*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD
R=$OUT/r; mkdir -p $R; cp devscripts/c.sh $R/run.sh; git log --oneline -1 > $R/commit.txt 2>/dev/null
{ nvidia-smi --query-gpu=name,memory.total --format=csv; nproc; python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"; date -u; } > $R/machine.txt 2>&1
s=$(date +%s)
timeout 300 python -u -m vlora bench bench.suite=streams 'bench.streams.modes=[head]' 'bench.streams.stream_counts=[32,36,40,44,48]' \
  bench.streams.refine=1 bench.streams.seconds=8 bench.streams.hf_baseline=true bench.streams.hf_batches=2 bench.streams.cold_streams=32 \
  'bench.streams.engine_only_rates=[36.0]' bench.out_dir=$R/streams_none > $R/streams_none.log 2>&1
echo "streams bf16 rc=$? $(( $(date +%s) - s )) s"; grep -v "^\[20" $R/streams_none.log | grep -E "engine in process|kind|paced|^ *(cold|warm) |^head|cold \(|transformers:" | cut -c1-300
s=$(date +%s)
timeout 245 python -u -m vlora bench bench.suite=streams 'bench.streams.modes=[head]' 'bench.streams.stream_counts=[36,40,44,48,52]' \
  bench.streams.refine=0 bench.streams.seconds=8 bench.streams.hf_baseline=false bench.streams.cold_streams=0 bench.streams.engine_only=false \
  bench.streams.quantization=fp8 bench.out_dir=$R/streams_fp8 > $R/streams_fp8.log 2>&1
echo "streams fp8 rc=$? $(( $(date +%s) - s )) s"; grep -v "^\[20" $R/streams_fp8.log | grep -E "^ *(cold|warm) |^head" | cut -c1-300
cd $OUT && tar czf r.tgz r
