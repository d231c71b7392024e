#!/bin/bash
# queue2048 alone on 2 CPU cores, anticipate_ms 20 (default) against none, alternated (run in this order: antic_1 none_1 antic_2 none_2)
cd "$(dirname "$0")/../../../../.."
for r in a n a n; do ov='[]'; [ $r = n ] && ov='["engine.anticipate_ms=null"]'; timeout 300 python -u -m vlora bench bench.suite=soak '+bench.soak.phases=[floods]' 'bench.soak.floods=[queue2048]' "bench.soak.server_overrides=$ov" bench.out_dir=/tmp/q_$r$RANDOM > /tmp/q.log 2>&1; echo "$r $(grep fairness_ /tmp/q.log | cut -c1-120)"; done
