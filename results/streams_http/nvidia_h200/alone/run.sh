#!/bin/bash
# one GPU: camera streams over HTTP against RPyC on one engine (alone on the machine), then the FP8 GPU tests
# (the plain decode GEMM back, the SiLU-mul's two launches counted, FP8 checkpoints loaded on a GPU)
T0=$(date +%s)
python -m pip install --no-deps --no-index -q .wheels/antlr4*.whl .wheels/hydra*.whl .wheels/omegaconf*.whl .wheels/plumbum*.whl .wheels/rpyc*.whl 2>&1 | tail -2
python -m pip install --no-index --find-links .wheels -q starlette uvicorn httpx 2>&1 | tail -2
R=$OUT/r; mkdir -p $R; cp devscripts/fin.sh $R/run.sh
{ nvidia-smi --query-gpu=index,name,memory.total --format=csv; python -c "import torch, triton, transformers, starlette, uvicorn, httpx; print(torch.__version__, triton.__version__, transformers.__version__, starlette.__version__, uvicorn.__version__, httpx.__version__)"; nproc; date -u; } > $R/machine.txt 2>&1
cd devscripts/B
s=$(date +%s)
timeout 180 python -u -m bench.streams_http --counts 24 28 32 --seconds 8 --out-dir $R/http > $R/http.log 2>&1
echo "http rc=$? $(( $(date +%s) - s )) s"; grep -E "^transport=" $R/http.log
s=$(date +%s)
timeout $(( 290 - ($(date +%s) - T0) )) python -m pytest -q -m "gpu or not gpu" tests/serve/engine/test_fp8_gpu.py tests/serve/engine/test_fp8_fused_gpu.py tests/serve/models/test_fp8_checkpoint.py tests/serve/engine/test_fp8_checkpoint_engine.py > $R/fp8_gpu_tests.log 2>&1
echo "fp8 gpu tests rc=$? $(( $(date +%s) - s )) s"; grep -E "passed|failed|FAILED" $R/fp8_gpu_tests.log | tail -5
echo "done at $(( $(date +%s) - T0 )) s"
cd $OUT && tar czf r.tgz r && rm -rf r
