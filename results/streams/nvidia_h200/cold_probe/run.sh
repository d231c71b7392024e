#!/bin/bash
# where the cold point's slow first steps come from: kernels compiled during it? (Triton / Inductor cache
# files over time, dynamo recompiles), the cold and one warm point at 28 cameras
python -m pip install --no-deps --no-index -q .wheels/antlr4*.whl .wheels/hydra*.whl .wheels/omegaconf*.whl .wheels/plumbum*.whl .wheels/rpyc*.whl 2>&1 | tail -2
R=$OUT/r; mkdir -p $R; cp devscripts/coldprobe.sh $R/run.sh
{ nvidia-smi --query-gpu=name --format=csv; date -u; } > $R/machine.txt
( while true; do n1=$(find /tmp/streams-caches-*/triton -type f 2>/dev/null | wc -l); n2=$(find /tmp/streams-caches-*/inductor -type f 2>/dev/null | wc -l); echo "$(date +%s.%N | cut -c1-14) triton_files=$n1 inductor_files=$n2"; sleep 0.5; done ) > $R/cache_files.log 2>&1 &
MON=$!
cd devscripts/B
TORCH_LOGS=recompiles timeout 200 python -u -m vlora bench bench.suite=streams 'bench.streams.modes=[head]' bench.streams.hf_baseline=false \
  'bench.streams.stream_counts=[28]' bench.streams.refine=0 bench.streams.seconds=8 bench.streams.engine_only=false \
  bench.streams.cold_streams=28 bench.out_dir=$R/streams 2>&1 | while IFS= read -r l; do echo "$(date +%s.%N | cut -c1-14) $l"; done > $R/run.log
kill $MON
grep -E "warm-up on|cold mode|mode=head streams|ecompil" $R/run.log | cut -c1-260 | head -20
awk '{print $2, $3}' $R/cache_files.log | uniq -c | head -40
cd $OUT && tar czf r.tgz r && rm -rf r
