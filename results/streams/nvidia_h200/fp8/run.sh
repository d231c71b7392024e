#!/bin/bash
# one GPU: the streams suite (cameras with heads) in bf16 and with FP8 projections, one process each, same counts
python -m pip install --no-deps --no-index -q .wheels/antlr4*.whl .wheels/hydra*.whl .wheels/omegaconf*.whl .wheels/plumbum*.whl .wheels/rpyc*.whl 2>&1 | tail -2
R=$OUT/r; mkdir -p $R; cp devscripts/fp8b.sh $R/run.sh
{ nvidia-smi --query-gpu=name,memory.total --format=csv; python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"; date -u; } > $R/machine.txt 2>&1
cd devscripts/B
for q in none fp8; do
s=$(date +%s)
timeout 270 python -u -m vlora bench bench.suite=streams 'bench.streams.modes=[head]' bench.streams.hf_baseline=false \
    'bench.streams.stream_counts=[28,32,36,40,44]' bench.streams.refine=0 bench.streams.seconds=8 bench.streams.engine_only=false \
    bench.streams.quantization=$q bench.out_dir=$R/streams_$q > $R/streams_$q.log 2>&1
echo "streams $q rc=$? $(( $(date +%s) - s )) s"; grep -E "warmed up|mode=head streams=.* offered|within" $R/streams_$q.log | cut -c1-300
done
cd $OUT && tar czf r.tgz r && rm -rf r
