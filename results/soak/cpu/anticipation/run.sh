#!/bin/bash
# anticipation on 2 CPU cores: the soak's floods, anticipate_ms 20 (default) against none, alternated
cd "$(dirname "$0")/../../../.."
R=results/soak/cpu/anticipation
run() {  # name, overrides list
  s=$(date +%s)
  timeout 400 python -u -m vlora bench bench.suite=soak '+bench.soak.phases=[floods]' "bench.soak.server_overrides=$2" bench.out_dir=$R/$1 > $R/$1.log 2>&1
  echo "$1 rc=$? $(( $(date +%s) - s )) s"; grep "fairness_" $R/$1.log | cut -c1-160
}
run antic_1 '[]'
run none_1 '["engine.anticipate_ms=null"]'
run antic_2 '[]'
run none_2 '["engine.anticipate_ms=null"]'
