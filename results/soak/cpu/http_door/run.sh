#!/bin/bash
# floods-only soak, alternated: the server with its HTTP port open (idle) and without
cd "$(git rev-parse --show-toplevel)"
OUT=${OUT:-/tmp/http_ab}
for i in 1 2; do
  for mode in on off; do
    if [ $mode = on ]; then ov='bench.soak.server_overrides=["http.port=0"]'; else ov='bench.soak.server_overrides=[]'; fi
    python -m vlora bench bench.suite=soak '+bench.soak.phases=[floods]' "$ov" bench.out_dir=$OUT/${mode}_$i > $OUT/${mode}_$i.log 2>&1
    echo "$mode $i done $(date +%T)"
  done
done
