#!/bin/bash
# two H200s. Phase 1: tensor parallel TP=2 at the 7B shape, its parity rows carried over from the last run (tp_seed.json),
# so the timings run again: decode, prefill and the vision tower both ways (tp_vision split / whole, split profiled).
# Phase 2, side by side: GPU 0 the Triton FP8 decode GEMM (its tests on the GPU, the fp8 suite with it on, then a
# launch-table sweep); GPU 1 camera streams over HTTP against RPyC (the client's encoding off its worker threads).
T0=$(date +%s)
python -m pip install --no-deps --no-index -q .wheels/antlr4*.whl .wheels/hydra*.whl .wheels/omegaconf*.whl .wheels/plumbum*.whl .wheels/rpyc*.whl 2>&1 | tail -2
python -m pip install --no-index --find-links .wheels -q starlette uvicorn httpx 2>&1 | tail -2
R=$OUT/r; mkdir -p $R/tp/nvidia_h200; cp devscripts/a.sh $R/run.sh; cp devscripts/tp_seed.json $R/tp/nvidia_h200/tp.json
{ nvidia-smi --query-gpu=index,name,memory.total --format=csv; nvidia-smi topo -m; python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"; nproc; date -u; } > $R/machine.txt 2>&1
cd devscripts/B
s=$(date +%s)
timeout 250 python -u -m vlora bench bench.suite=tp 'bench.tp.sizes=[2]' bench.tp.shape=7b 'bench.tp.batches=[1,32,64]' \
    bench.tp.budget_s=230 bench.out_dir=$R/tp > $R/tp.log 2>&1
echo "tp rc=$? $(( $(date +%s) - s )) s"; grep -v "^\s*$" $R/tp.log | tail -25 | cut -c1-250
LEFT=$(( 570 - ($(date +%s) - T0) ))
P2S=$(date +%s); echo "phase 2 from $(( P2S - T0 )) s, $LEFT s left"
rem() { echo $(( LEFT - 8 - ($(date +%s) - P2S) )); }
(
  export CUDA_VISIBLE_DEVICES=0
  s=$(date +%s)
  timeout 70 python -m pytest -q tests/kernels/test_fp8_decode.py tests/kernels/test_fp8_decode_ptx.py > $R/fp8_decode_tests.log 2>&1
  echo "fp8 decode kernel tests rc=$? $(( $(date +%s) - s )) s"; tail -2 $R/fp8_decode_tests.log
  s=$(date +%s)
  VLORA_FP8_DECODE_MAX_M=64 timeout 120 python -m vlora bench bench.suite=fp8 bench.fp8.profile=true bench.out_dir=$R/fp8_triton > $R/fp8_triton_bench.log 2>&1
  echo "fp8 bench (Triton decode GEMM on) rc=$? $(( $(date +%s) - s )) s"
  s=$(date +%s)
  timeout $(rem) python -m bench.fp8_decode_sweep --projections down_proj gate_up_proj --m 1 32 64 --out $R/sweep.csv > $R/sweep.log 2>&1
  echo "sweep rc=$? $(( $(date +%s) - s )) s"
) > $R/phase2_gpu0.txt 2>&1 &
P0=$!
(
  export CUDA_VISIBLE_DEVICES=1
  s=$(date +%s)
  timeout $(( LEFT - 10 )) python -u -m bench.streams_http --counts 24 28 32 36 --seconds 8 --out-dir $R/http > $R/http.log 2>&1
  echo "http rc=$? $(( $(date +%s) - s )) s"
) > $R/phase2_gpu1.txt 2>&1 &
P1=$!
wait $P0 $P1
cat $R/phase2_gpu0.txt $R/phase2_gpu1.txt; grep -E "^transport=" $R/http.log
grep -A6 "## Decode step (ms)" $R/fp8_triton_bench.log; tail -12 $R/sweep.log | cut -c1-200
echo "done at $(( $(date +%s) - T0 )) s"
cd $OUT && tar czf r.tgz r && rm -rf r
