#!/bin/bash
# the cold start with the warm-up's LoRA kernel sweep (issue 45): run A, fresh Triton/Inductor caches: cold 28 cameras then warm;
# then a warm one, with the compile watch and the names of cache files written over time; run B, a new
# process on run A's (now full) caches: the same points. B cold ~ warm: the cold cost is compiling.
python -m pip install --no-deps --no-index -q .wheels/antlr4*.whl .wheels/hydra*.whl .wheels/omegaconf*.whl .wheels/plumbum*.whl .wheels/rpyc*.whl 2>&1 | tail -2
R=$OUT/r; mkdir -p $R; cp devscripts/cold3.sh $R/run.sh
{ nvidia-smi --query-gpu=name,memory.total --format=csv; python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"; date -u; } > $R/machine.txt 2>&1
C=/tmp/coldcaches; mkdir -p $C/triton $C/inductor
export TRITON_CACHE_DIR=$C/triton TORCHINDUCTOR_CACHE_DIR=$C/inductor
( prev=/tmp/snap0; : > $prev; while true; do find $C -name '*.json' -o -name '*.py' -o -name '*.cubin' 2>/dev/null | sort > /tmp/snap1; comm -13 $prev /tmp/snap1 | sed "s|^|$(date +%s.%N | cut -c1-14) |"; mv /tmp/snap1 $prev; sleep 0.5; done ) > $R/cache_files.log 2>&1 &
MON=$!
cd devscripts/B
for run in A B; do
  TORCH_LOGS=recompiles timeout 240 python -u -m vlora bench bench.suite=streams 'bench.streams.modes=[head]' bench.streams.hf_baseline=false \
    'bench.streams.stream_counts=[28]' bench.streams.refine=0 bench.streams.seconds=8 bench.streams.engine_only=false \
    bench.streams.fresh_caches=false bench.streams.cold_streams=28 bench.out_dir=$R/streams_$run 2>&1 \
    | while IFS= read -r l; do echo "$(date +%s.%N | cut -c1-14) $l"; done > $R/run_$run.log
  echo "run $run done"; grep -E "ready|warm-up|cold|mode=head streams|compiled|ecompil|Error|Traceback" $R/run_$run.log | cut -c1-400 | head -40
done
kill $MON
grep -c . $R/cache_files.log
cd $OUT && tar czf r.tgz r && rm -rf r
