#!/bin/bash
# The engine's decode step in one process (../batched_decodes/decode_steps.py: the tiny model, 1-32 sequences), glibc's mmap
# threshold dynamic (its default) or pinned at 256 KB (what the engine process set before), alternated three
# times; one OpenMP thread, as the soak's server runs. Run from the repository root.
D=results/soak/cpu/forward_heap
for i in 1 2 3; do
  OMP_NUM_THREADS=1 python results/soak/cpu/batched_decodes/decode_steps.py $D/steps/dynamic_$i.json > /dev/null 2>&1
  OMP_NUM_THREADS=1 MALLOC_MMAP_THRESHOLD_=262144 python results/soak/cpu/batched_decodes/decode_steps.py $D/steps/pinned_$i.json > /dev/null 2>&1
done
