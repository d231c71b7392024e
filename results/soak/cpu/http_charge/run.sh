#!/bin/bash
# poll32 and an HTTP flood (FLOOD, default httppoll32), alternated: BEFORE, a worktree of 8dc39f8 (no event-loop charge), and
# AFTER, the tree of c4efed9. OUT collects the runs.
OUT=${OUT:-/tmp/charge_ab}
mkdir -p "$OUT"
for i in 1 2 3; do
  for arm in before after; do
    if [ $arm = before ]; then cd "$BEFORE"; else cd "$AFTER"; fi
    python -m vlora bench bench.suite=soak '+bench.soak.phases=[floods]' "bench.soak.floods=[poll32,${FLOOD:-httppoll32}]" \
      bench.out_dir="$OUT/${arm}_$i" > "$OUT/${arm}_$i.log" 2>&1
    echo "$arm $i done $(date +%T)"
  done
done
