#!/bin/bash
# the step inputs' one pinned copy on a GPU: its tests, then the victim's steps in process alone and under a flood,
# the tree before it and with it alternated (prof_flood.py)
cd "$(dirname "$0")/.."
python -m pip install --no-deps --no-index -q .wheels/antlr4*.whl .wheels/hydra*.whl .wheels/omegaconf*.whl .wheels/plumbum*.whl .wheels/rpyc*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD
R=$OUT/r; mkdir -p $R; cp devscripts/g4.sh $R/run.sh
{ nvidia-smi --query-gpu=name,memory.total --format=csv; nproc; python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"; date -u; } > $R/machine.txt 2>&1
cat $R/machine.txt
timeout 100 python -m pytest -q -p no:cacheprovider tests/serve/engine/test_step_input_copy.py tests/serve/engine/test_engine_gpu.py 2>&1 | tail -4 | tee $R/gpu_tests.txt
cp serve/engine/inputs.py /tmp/inputs_with.py
for i in 1 2; do
  for set in before with; do
    if [ $set = before ]; then cp devscripts/inputs_before.py serve/engine/inputs.py; else cp /tmp/inputs_with.py serve/engine/inputs.py; fi
    timeout 80 python devscripts/prof_flood.py cuda ${N:-80} $R/${set}_$i 256 > $R/${set}_$i.log 2>&1
    echo "$set $i rc=$?"; grep "^alone\|^flood" $R/${set}_$i.log | cut -c1-330
  done
done
cp /tmp/inputs_with.py serve/engine/inputs.py
cd $OUT && tar czf r.tgz r && rm -rf r
