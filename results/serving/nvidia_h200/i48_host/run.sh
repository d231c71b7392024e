#!/bin/bash
# one GPU: the orchestrator's confirmation point at load 0.5 (5 seeds), V-LoRA against merge-only, with the
# planner's host time and the mean measured step per replay
python -m pip install --no-deps --no-index -q .wheels/antlr4*.whl .wheels/hydra*.whl .wheels/omegaconf*.whl .wheels/plumbum*.whl .wheels/rpyc*.whl 2>&1 | tail -2
R=$OUT/r; mkdir -p $R; cp devscripts/i48.sh $R/run.sh
{ nvidia-smi --query-gpu=name,memory.total --format=csv; python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"; date -u; } > $R/machine.txt 2>&1
cd devscripts/B
s=$(date +%s)
timeout 420 python -m vlora bench bench.suite=serving bench.serving.tag=i48_host \
  'bench.serving.targets=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]' bench.serving.rank=64 \
  'bench.serving.skewness=[0.9]' 'bench.serving.loads=[0.5]' 'bench.serving.seeds=[0,1,2,3,4]' \
  'bench.serving.policies=[v_lora,merge_only]' bench.serving.duration_s=4 bench.serving.drain_s=15 \
  bench.serving.warmup_s=2 bench.serving.capacity_rps=20.48 \
  bench.serving.profile=results/serving/nvidia_h200/learned_r64_all7/profile.json 'bench.serving.mode_other_shares=[]' \
  bench.out_dir=$R/serving > $R/serving.log 2>&1
echo "serving rc=$? $(( $(date +%s) - s )) s"; tail -30 $R/serving.log | cut -c1-300
cd $OUT && tar czf r.tgz r && rm -rf r
