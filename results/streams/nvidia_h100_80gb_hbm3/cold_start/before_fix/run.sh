#!/bin/bash
# cold vs warm at 28 streams on clean exports: A = warm-up commit (before the scheduler's fair-share preemption and tower LoRA), B = HEAD; C = A without the engine's warm-up
python -m pip install --no-deps --no-index -q .wheels/antlr4*.whl .wheels/hydra*.whl .wheels/omegaconf*.whl .wheels/plumbum*.whl .wheels/rpyc*.whl 2>&1 | tail -2
mkdir -p $OUT/r
{ nvidia-smi --query-gpu=name,memory.total --format=csv; nproc; python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"; date -u; } > $OUT/r/machine.txt 2>&1
point() {  # name dir extra...
  local name=$1 dir=$2; shift 2
  local start=$(date +%s)
  (cd devscripts/$dir && timeout 200 python -m vlora bench bench.suite=streams 'bench.streams.modes=[head]' bench.streams.hf_baseline=false \
    'bench.streams.stream_counts=[28]' bench.streams.refine=0 bench.streams.seconds=8 bench.streams.engine_only=false \
    bench.streams.cold_streams=28 bench.out_dir=$OUT/r/$name "$@" > $OUT/r/$name.log 2>&1)
  echo "$name exit $? after $(( $(date +%s) - start )) s" | tee -a $OUT/r/$name.log
  grep -E "warmed up|cold mode|^\[streams\] mode|cold \(" $OUT/r/$name.log | cut -c1-400
}
point A A
point B B
point C A bench.streams.engine_warm_up=false
cd $OUT && tar czf r.tgz r && rm -rf r
