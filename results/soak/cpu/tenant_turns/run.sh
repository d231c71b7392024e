#!/bin/bash
# the floods on this 2-core machine with tenants taking turns among newcomers (0de4543), two runs back to back
cd "$(dirname "$0")/../../../.."
R=results/soak/cpu/tenant_turns
{ nproc; lscpu | grep "Model name"; python -c "import torch, transformers; print(torch.__version__, transformers.__version__)"; date -u; } > $R/machine.txt 2>&1
for name in turns_1 turns_2; do
  python -m vlora bench bench.suite=soak '+bench.soak.phases=[floods]' bench.out_dir=$R/$name > $R/$name.log 2>&1
  echo "$name rc=$?"; grep "fairness_" $R/$name.log | cut -c1-160
done
