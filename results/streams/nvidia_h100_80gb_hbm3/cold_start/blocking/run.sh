#!/bin/bash
# where the illegal memory access comes from: the cold point with CUDA_LAUNCH_BLOCKING=1 (HEAD export)
python -m pip install --no-deps --no-index -q .wheels/antlr4*.whl .wheels/hydra*.whl .wheels/omegaconf*.whl .wheels/plumbum*.whl .wheels/rpyc*.whl 2>&1 | tail -2
mkdir -p $OUT/r
for i in 1 2; do
  start=$(date +%s)
  (cd devscripts/B && CUDA_LAUNCH_BLOCKING=1 HYDRA_FULL_ERROR=1 timeout 240 python -m vlora bench bench.suite=streams 'bench.streams.modes=[head]' bench.streams.hf_baseline=false \
    'bench.streams.stream_counts=[1]' bench.streams.refine=0 bench.streams.seconds=2 bench.streams.engine_only=false bench.streams.warmup_point_s=0 \
    bench.streams.cold_streams=28 bench.out_dir=$OUT/r/c$i > $OUT/r/c$i.log 2>&1)
  rc=$?
  echo "c$i exit $rc after $(( $(date +%s) - start )) s" | tee -a $OUT/r/c$i.log
  grep -E "cold mode|Error|error|File \"/work" $OUT/r/c$i.log | grep -v "^\s*$" | cut -c1-300 | head -60
  [ $rc -ne 0 ] && break
done
cd $OUT && tar czf r.tgz r && rm -rf r
