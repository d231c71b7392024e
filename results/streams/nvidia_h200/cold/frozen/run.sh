#!/bin/bash
# call 4: bf16 heads with the front end's heap frozen: cold at 36, warm 36, three ramps at 36 (seed 4)
cd "$(dirname "$0")/.."
python -m pip install --no-deps --no-index -q .wheels/antlr4*.whl .wheels/hydra*.whl .wheels/omegaconf*.whl .wheels/plumbum*.whl .wheels/rpyc*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD
R=$OUT/r; mkdir -p $R; cp devscripts/g.sh $R/run.sh
{ nvidia-smi --query-gpu=name,driver_version,memory.total,power.limit,clocks.max.sm --format=csv; nproc; date -u; } > $R/machine.txt 2>&1
nvidia-smi dmon -s pucvm -d 1 -o T > $R/dmon.txt 2>&1 &
DMON=$!
s=$(date +%s)
timeout 235 python -m vlora bench bench.suite=streams bench.streams.modes=[head] bench.streams.refine=0 bench.streams.seconds=8 bench.streams.hf_baseline=false bench.streams.engine_only=false bench.streams.matmul_sustained_s=0 bench.streams.cold_streams=36 'bench.streams.stream_counts=[36]' 'bench.streams.ramp_counts=[36,36,36]' bench.streams.seed=4 bench.out_dir=$R/seed4 > $R/seed4.log 2>&1
echo "seed 4 rc=$? $(( $(date +%s) - s )) s"
grep -v USDT $R/seed4.log | grep -E "^ *(point|cold|warm|ramp) |^cold|ramp\)" | cut -c1-200
python - <<'PY' $R/seed4
import json, glob, sys
for f in glob.glob(sys.argv[1] + "/*/streams.json"):
    for r in json.load(open(f))["rows"]:
        print(r["point"], r["streams"], round(r["p95_ms"]), r["window_utc"], r["gc"])
PY
kill $DMON
cd $OUT && tar czf r.tgz r
