#!/bin/bash
# two H200s, right after c1.sh on the same machine. Ray Serve installed from the two parts, then camera streams (7B shape,
# heads) on one engine (GPU 0) while GPU 1 measures FP8 against bf16 on trained adapters' head answers; then two Ray
# Serve replicas, one a GPU, behind the RPyC front end, searched the same way, and one replica killed under load.
T0=$(date +%s)
bash devscripts/ray_install.sh 2>&1 | tail -4 || exit 1
python -m pip install --no-deps --no-index -q .wheels/antlr4*.whl .wheels/hydra*.whl .wheels/omegaconf*.whl .wheels/plumbum*.whl .wheels/rpyc*.whl 2>&1 | tail -2
python -m pip install --no-deps --no-index -q .wheels/datasets*.whl .wheels/dill*.whl .wheels/multiprocess*.whl 2>&1 | tail -2
export RAY_USAGE_STATS_ENABLED=0 RAY_memory_monitor_refresh_ms=0
R=$OUT/r; mkdir -p $R; cp devscripts/c2.sh $R/run.sh
{ nvidia-smi --query-gpu=index,name,memory.total --format=csv; python -c "import torch, ray, datasets; print(torch.__version__, ray.__version__, datasets.__version__)"; nproc; date -u; } > $R/machine.txt 2>&1
cd devscripts/B
S="bench.suite=scaling bench.scaling.workload=streams bench.scaling.streams.seconds=8 bench.scaling.streams.refine=1 bench.out_dir=$R/scaling"
C="'bench.scaling.streams.stream_counts=[26,30,34]'"
(
  export CUDA_VISIBLE_DEVICES=1
  s=$(date +%s)
  timeout 170 python -m vlora bench bench.suite=fp8 bench.fp8.heads_only=true bench.out_dir=$R/fp8_heads > $R/fp8_heads.log 2>&1
  echo "fp8 heads rc=$? $(( $(date +%s) - s )) s"
) > $R/gpu1.txt 2>&1 &
P1=$!
s=$(date +%s)
CUDA_VISIBLE_DEVICES=0 timeout 170 bash -c "python -u -m vlora bench $S $C 'bench.scaling.streams.setups=[single]'" > $R/single.log 2>&1
echo "single rc=$? $(( $(date +%s) - s )) s"; grep -E "streams=|pass" $R/single.log | tail -6 | cut -c1-200
wait $P1; cat $R/gpu1.txt
s=$(date +%s)
timeout $(( 475 - ($(date +%s) - T0) )) bash -c "python -u -m vlora bench $S $C 'bench.scaling.streams.setups=[single,replicas]' 'bench.scaling.streams.gpus=[2]' bench.scaling.streams.kill_seconds=50 bench.scaling.streams.kill_drain_s=20" > $R/replicas.log 2>&1
echo "replicas rc=$? $(( $(date +%s) - s )) s"; grep -v "^\s*$" $R/replicas.log | grep -vi warn | tail -30 | cut -c1-220
grep -iE "agreement|^\| (exists|count|class|detect)" $R/fp8_heads.log | head -12 | cut -c1-200
echo "done at $(( $(date +%s) - T0 )) s"
cd $OUT && tar czf r.tgz r && rm -rf r
