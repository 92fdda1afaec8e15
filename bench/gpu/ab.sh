#!/usr/bin/env bash
# Interleaved A/B of two source trees on one machine: a GPU host's speed drifts by tens of
# percent from one run to the next (BENCHMARKS.md, session 36), so one run of each decides
# nothing; pairs run back to back, alternating which goes first, and each pair's ratio
# is read beside the others.
#
#   git archive <base-rev> | (mkdir -p .carry/base && tar -x -C .carry/base)   # here
#   bash bench/gpu/ab.sh .carry/base 3 bench/host_overhead.py --batches 512 --no-peer
#
# runs the bench script with its arguments from this checkout ("head") and from the base
# tree, N times each, alternating (head first in odd pairs), each run's JSON lines kept in
# ${OUT:-/tmp}/ab/{head,base}_<i>.txt (stdout; stderr in .err), then prints every run's
# last JSON line, pair by pair. PYTHONPATH puts /tmp/site (bench/gpu/setup.sh) first;
# PYTHON picks the interpreter (python3).
set -uo pipefail
base=$(cd "$1" && pwd); pairs=$2; shift 2
head=$PWD
dir=${OUT:-/tmp}/ab
mkdir -p "$dir"
for i in $(seq 1 "$pairs"); do
    if (( i % 2 )); then order="head base"; else order="base head"; fi
    for name in $order; do
        tree=$head; [ "$name" = base ] && tree=$base
        (cd "$tree" && PYTHONPATH=/tmp/site:$tree timeout "${AB_TIMEOUT:-900}" "${PYTHON:-python3}" "$@" \
            > "$dir/${name}_$i.txt" 2> "$dir/${name}_$i.err")
        echo "pair $i $name (rc $?): $(grep '^{' "$dir/${name}_$i.txt" | tail -1)"
    done
done
