#!/usr/bin/env bash
# Split tests/test_*.py into N shards of about equal run time (one line of
# pytest arguments per shard): the heaviest item first, each to the
# least-loaded shard. The files whose tests each run for minutes
# (test_train.py, test_robustness.py, test_compile.py) are split into their
# test functions (pytest node ids), so that no shard waits on a whole file
# of them.
# Weights: rough seconds on the H200 machine's 16 cores in 12 shards
# (whole-suite run of 2026-12-05, `--durations`); unknown items weigh 3.
#   scripts/test_shards.sh 5                 # every tests/test_*.py
#   scripts/test_shards.sh 2 tests/test_a.py tests/test_b.py
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
n=${1:-1}
shift || true
pool=("$@")
[ ${#pool[@]} -gt 0 ] || pool=(tests/test_*.py)
weight() {
    case ${1##*/} in  # the file name, with a test after :: where split
        test_train.py::test_compiled_training_reaches_eager_accuracy) echo 220 ;;
        test_train.py::test_bf16_autocast_reaches_fp32_accuracy) echo 200 ;;
        test_train.py::test_fast_gat_reaches_cora_accuracy) echo 25 ;;
        test_train.py::test_no_data_exits_with_clear_message) echo 15 ;;
        test_train.py::*) echo 8 ;;
        test_robustness.py::test_stale_build_lock_does_not_hang) echo 80 ;;
        test_robustness.py::test_concurrent_builds) echo 70 ;;
        test_robustness.py::test_broken_cache_falls_back_to_reference) echo 30 ;;
        test_robustness.py::test_no_compiler_falls_back_to_reference) echo 18 ;;
        test_robustness.py::test_reference_backend_env) echo 14 ;;
        test_robustness.py::*) echo 3 ;;
        test_compile.py::test_opcheck | test_compile.py::test_inductor_*) echo 40 ;;
        test_compile.py::test_compiled_* | test_compile.py::test_autocast_*) echo 25 ;;
        test_compile.py::*) echo 10 ;;
        test_gatv2.py) echo 90 ;;
        test_transformer_conv.py | test_transformer_attention.py) echo 95 ;;
        test_ops.py | test_hub.py) echo 90 ;;
        test_gatv2_async.py) echo 70 ;;
        test_ddp.py) echo 50 ;;
        test_graph_build.py) echo 35 ;;
        test_pyg_interop.py) echo 25 ;;
        test_prepare.py | test_gatconv.py) echo 12 ;;
        *) echo 3 ;;
    esac
}
# Files of slow tests go in as their test functions.
split() {
    case $(basename "$1") in
        test_train.py | test_robustness.py | test_compile.py)
            sed -n 's/^def \(test_[A-Za-z0-9_]*\).*/\1/p' "$1" | sed "s|^|$1::|" ;;
        *) echo "$1" ;;
    esac
}
mapfile -t files < <(for p in "${pool[@]}"; do split "$p"; done |
    while read -r f; do echo "$(weight "$f") $f"; done |
    LC_ALL=C sort -k1,1nr -k2,2 | cut -d' ' -f2)
declare -a load sel
for ((k = 0; k < n; k++)); do load[k]=0 sel[k]=""; done
for f in "${files[@]}"; do
    best=0
    for ((k = 1; k < n; k++)); do
        [ "${load[k]}" -lt "${load[best]}" ] && best=$k
    done
    load[best]=$((load[best] + $(weight "$f")))
    sel[best]="${sel[best]:+${sel[best]} }$f"
done
for ((k = 0; k < n; k++)); do echo "${sel[k]}"; done
