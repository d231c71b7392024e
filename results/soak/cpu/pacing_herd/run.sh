#!/bin/bash
# full floods with the defaults, alternating the tree before the pacing fix (/tmp/before) and after (/work/main)
out=${1:-/tmp/pace/herd}; mkdir -p $out
for i in ${IDX:-1 2 3}; do
  for arm in before:/tmp/before after:/work/main; do
    name=${arm%%:*}; tree=${arm#*:}
    date -u +%H:%M:%S > $out/${name}_$i.start
    (cd $tree && timeout 700 python -u -m vlora bench bench.suite=soak '+bench.soak.phases=[floods]' \
      bench.out_dir=$out/${name}_$i > $out/${name}_$i.log 2>&1)
  done
done
echo done > $out/DONE
