#!/usr/bin/env bash
# One GPU-machine session of checks: versions, CUDA build, tests, benchmarks.
#
#   scripts/gpu_check.sh                     # all steps: info build tests ops gat
#   scripts/gpu_check.sh build tests         # only some steps (info always runs)
#   scripts/gpu_check.sh build bench         # bench = ops + gat
#   scripts/gpu_check.sh build bench quick   # benchmarks with --quick sizes
#   scripts/gpu_check.sh build cudatests gat profile
#
# Steps (each logged to its own file, summarized at the end; the script goes
# on past failures and exits non-zero if any step failed, timed out or was
# skipped for lack of time):
#   info   nvidia-smi, versions of python/torch/PyG/CUDA/nvcc/ninja
#   build  python3 -m pyg_fastattn.build (PYG_FASTATTN_VERBOSE=1), and a check
#          that the CUDA kernels are native (the step fails if not); beside
#          it, the CPU-only build that the build tests copy objects from
#   tests  python3 -m pytest tests -q (the whole suite, in TEST_SHARDS
#          concurrent processes; cudatests: -m cuda -x only)
#   ops    benchmarks/bench_ops.py --device $DEV (OPS_ONLY: its --only;
#          OPS_ENV: an env assignment for a second, A/B run)
#   gat    benchmarks/bench_gat.py --device $DEV --cuda-graph
#   profile  benchmarks/profile_gat.py --device $DEV (not in the default set;
#          PROFILE_CONV / PROFILE_ONLY / PROFILE_PROVIDERS / PROFILE_ROWS: its
#          --conv / --only / --providers / --rows; PROFILE_ENV: an env assignment for a
#          second run, e.g. an A/B knob)
#   prepare  benchmarks/bench_prepare.py --device $DEV --sizes 1M:20M (graph
#          preparation and the fresh-graph step; PREPARE_ARGS: more of its
#          arguments; not in the default set)
#   ddp    examples/train_ddp.py under torchrun (NCCL), 1 process and one
#          per visible GPU when there are several (not in the default set)
#   ncu    Nsight Compute: benchmarks/ncu_kernels.py's workloads (NCU_WORKLOADS,
#          default gat_1m gat_1m_bf16 sa_1m gat_100k; NCU_KERNELS: a regex of
#          the kernels to profile, default all; NCU_ENV: settings, each
#          NAME=VALUE[,NAME=VALUE], for more profiles of each workload, named
#          <workload>_env1, _env2, ...), one profiled call each,
#          --set ${NCU_SET:-full}, --clock-control none; the details page of
#          every kernel and the hottest SASS lines of the attention kernels go
#          to bench_out/ncu (reports stay in the scratch folder; not in the
#          default set)
#   ab     benchmarks/ab_env.py: AB_WORKLOADS (default gat_1m gat_1m_bf16
#          gat_100k) under each of AB_SETS (space-separated settings, each
#          NAME=VALUE[,NAME=VALUE]), interleaved in one process (not in the
#          default set)
#   sanitize  compute-sanitizer memcheck over SANITIZE_ARGS (default: the CUDA
#          tests of test_robustness.py and test_hub.py, native backend), with
#          PyTorch's caching allocator off so that every buffer is its own
#          allocation (not in the default set)
#   script  $SCRIPT (a command line, e.g. "python3 .data/probe.py") in this
#          script's environment, so that it loads the library the build step
#          loaded (a probe started outside gpu_check.sh with other settings
#          has rebuilt the extension twice); logged to script.log, its tail
#          in bench.log (not in the default set; last of the steps)
#   cpubench  benchmarks/bench_gat.py --device cpu on this machine's cores
#          (CPU_BENCH_ONLY, default "Cora epoch"; CPU_BENCH_CONV, default
#          gat; providers pyg,fast,floor; not in the default set)
#
# TEST_ARGS: pytest arguments in place of the whole suite for cudatests
# (files, -k, ...), test files in place of the whole suite for tests; TEST_ENV: an env assignment for a second
# cudatests run of the same selection (e.g. PYG_FASTATTN_SPLIT_EDGES=16).
# BENCH_ONLY / BENCH_PROVIDERS: --only / --providers of bench_gat.py;
# BENCH_XGRAD=1: its --x-grad (layer fwd+bwd also differentiates x), and
# profile_gat.py's.
# BENCH_ENV / PREPARE_ENV / PROFILE_ENV: an env assignment (e.g. an A/B
# switch) for a second run of the gat / prepare / profile step in the same
# call; the second gat and prepare runs write to bench_out/ab (in the
# tarball; their tables are printed in the step's log).
#
# Time: the whole run stays within GPU_CHECK_BUDGET seconds (default 530, so
# one device call of <= ~9 minutes suffices). Each step runs under `timeout`
# with min(its own limit, what is left minus the minimum reserved for the
# steps after it). Limits (seconds) can be changed with T_INFO, T_BUILD,
# T_TESTS_CUDA, T_TESTS, T_OPS, T_GAT, T_PROFILE, T_PREPARE.
#
# Outputs in $OUT (default ./gpu_out), at most 8 files, refreshed after every
# step so that a killed run still returns what it had:
#   summary.txt       step table, environment, benchmark tables, failing tails
#   gpu_check.tar.gz  every log and every benchmark output (json/csv/md/png)
#   build.log, tests.log, bench.log, profile.log   (tails of) the step logs
#   ops_cuda.md, gat_cuda.md (gat_cuda.png is in the tarball)
#   prebuilt.txz      what the build step built, xz-compressed (gzip, as
#                     prebuilt.tgz, where xz is missing): the library (packed
#                     as soon as it is built) and the CPU-only build of the
#                     build tests; carry it as
#                     .data/prebuilt<name>.txz (or .tgz; one name per pack), and
#                     a later call with the same sources skips those builds
# Data: if ./.data/Planetoid exists (a copy of shared/data carried along),
# PYG_FASTATTN_DATA points there. Other knobs: OUT, PYG_FASTATTN_CACHE
# (default /tmp/pyg_fastattn_cache), GPU_CHECK_WORK (scratch folder),
# GPU_CHECK_DEVICE=cpu (run the same steps without a GPU: script smoke test).
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
ROOT=$PWD
export PYTHONUNBUFFERED=1 MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYG_FASTATTN_CACHE="${PYG_FASTATTN_CACHE:-/tmp/pyg_fastattn_cache}"
if [ -d "$ROOT/.data/Planetoid" ]; then
    export PYG_FASTATTN_DATA="$ROOT/.data/Planetoid"
fi
# GPU_CHECK_DEVICE=cpu runs the same steps on a machine without a GPU (to
# smoke-test this script); the default is cuda.
export GPU_CHECK_DEVICE="${GPU_CHECK_DEVICE:-cuda}"
DEV=$GPU_CHECK_DEVICE
OUT="${OUT:-$ROOT/gpu_out}"
mkdir -p "$OUT"
WORK="${GPU_CHECK_WORK:-/tmp/gpu_check.$$}"
LOGS="$WORK/logs"
BENCH="$WORK/bench_out"
rm -rf "$WORK"
mkdir -p "$LOGS" "$BENCH"
STATUS="$WORK/status.txt"
: >"$STATUS"

BUDGET=${GPU_CHECK_BUDGET:-530}
RESERVE=15 # for the final collection
START=$SECONDS

# ---------------------------------------------------------------- arguments
want_info=1 want_build=0 want_tests=0 want_ops=0 want_gat=0 want_profile=0 want_ddp=0 want_prepare=0 want_cpubench=0 want_ncu=0 want_sanitize=0 want_ab=0 want_script=0
cuda_only=0 quick=""
if [ $# -eq 0 ]; then
    want_build=1 want_tests=1 want_ops=1 want_gat=1
fi
for a in "$@"; do
    case "$a" in
        all) want_build=1 want_tests=1 want_ops=1 want_gat=1 ;;
        info) ;;
        build) want_build=1 ;;
        tests | test) want_tests=1 ;;
        cudatests) want_tests=1 cuda_only=1 ;;
        profile) want_profile=1 ;;
        ddp) want_ddp=1 ;;
        prepare) want_prepare=1 ;;
        cpubench) want_cpubench=1 ;;
        ncu) want_ncu=1 ;;
        sanitize) want_sanitize=1 ;;
        ab) want_ab=1 ;;
        script) want_script=1 ;;
        ops) want_ops=1 ;;
        gat) want_gat=1 ;;
        bench) want_ops=1 want_gat=1 ;;
        quick) quick="--quick" ;;
        -h | --help)
            awk 'NR > 1 && !/^#/ {exit} NR > 1' "${BASH_SOURCE[0]}"
            exit 0
            ;;
        *)
            echo "unknown step '$a' (info build tests cudatests ops gat bench profile prepare ddp ab ncu sanitize cpubench script all quick)" >&2
            exit 2
            ;;
    esac
done

# min seconds reserved for each later step (so early steps cannot starve them;
# MIN_<STEP> overrides)
MIN_TESTS_CUDA=${MIN_TESTS_CUDA:-45} MIN_TESTS=${MIN_TESTS:-60} MIN_OPS=${MIN_OPS:-90} MIN_GAT=${MIN_GAT:-120}
MIN_PROFILE=${MIN_PROFILE:-60} MIN_PREPARE=${MIN_PREPARE:-40} MIN_DDP=${MIN_DDP:-40} MIN_CPUBENCH=${MIN_CPUBENCH:-60}
MIN_NCU=${MIN_NCU:-60} MIN_SANITIZE=${MIN_SANITIZE:-60} MIN_AB=${MIN_AB:-40} MIN_SCRIPT=${MIN_SCRIPT:-30}

reserved_after() { # sum of the minimum shares of the wanted steps after $1
    local s=0 seen=0 st
    for st in info build tests_cuda tests ops gat profile prepare ddp ab ncu sanitize cpubench script; do
        if [ $seen -eq 1 ]; then
            case $st in
                tests_cuda) [ $want_tests -eq 1 ] && s=$((s + MIN_TESTS_CUDA)) ;;
                tests) [ $want_tests -eq 1 ] && [ $cuda_only -eq 0 ] && s=$((s + MIN_TESTS)) ;;
                ops) [ $want_ops -eq 1 ] && s=$((s + MIN_OPS)) ;;
                gat) [ $want_gat -eq 1 ] && s=$((s + MIN_GAT)) ;;
                profile) [ $want_profile -eq 1 ] && s=$((s + MIN_PROFILE)) ;;
                prepare) [ $want_prepare -eq 1 ] && s=$((s + MIN_PREPARE)) ;;
                cpubench) [ $want_cpubench -eq 1 ] && s=$((s + MIN_CPUBENCH)) ;;
                ddp) [ $want_ddp -eq 1 ] && s=$((s + MIN_DDP)) ;;
                ab) [ $want_ab -eq 1 ] && s=$((s + MIN_AB)) ;;
                ncu) [ $want_ncu -eq 1 ] && s=$((s + MIN_NCU)) ;;
                sanitize) [ $want_sanitize -eq 1 ] && s=$((s + MIN_SANITIZE)) ;;
                script) [ $want_script -eq 1 ] && s=$((s + MIN_SCRIPT)) ;;
            esac
        fi
        [ "$st" = "$1" ] && seen=1
    done
    echo $s
}

FAILED=0
STEPS="${*:-info build tests ops gat}"

# ---------------------------------------------------------------- collection
tail_into() { # tail_into DEST LINES FILE...
    local dest=$1 n=$2 f
    shift 2
    : >"$dest"
    for f in "$@"; do
        [ -f "$f" ] || continue
        echo "===== $(basename "$f") (last $n lines) =====" >>"$dest"
        tail -n "$n" "$f" >>"$dest"
        echo >>"$dest"
    done
}

collect() {
    {
        echo "gpu_check: $(date -u '+%Y-%m-%d %H:%M:%S UTC'), elapsed $((SECONDS - START)) s of $BUDGET"
        echo "steps requested: $STEPS"
        echo
        printf '%-11s %-9s %6s  %s\n' STEP STATUS SECONDS NOTE
        cat "$STATUS"
        echo
        if [ -f "$LOGS/info.log" ]; then
            echo "===== environment ====="
            grep -v '^\$ ' "$LOGS/info.log" | grep -E '^(GPU|torch|python|pyg|ninja|cpus)|NVIDIA-SMI|Cuda compilation' | head -20
            echo
        fi
        for f in "$LOGS/build.log"; do
            [ -f "$f" ] && {
                echo "===== build (last lines) ====="
                tail -n 5 "$f"
                echo
            }
        done
        for f in "$LOGS/tests_cuda.log" "$LOGS"/tests_*.part; do
            [ -f "$f" ] && {
                echo "===== $(basename "$f") (summary) ====="
                grep -E '^(FAILED|ERROR)' "$f" | head -n 30
                grep -E '^SKIPPED' "$f" | head -n 8
                grep -E '(passed|failed|errors?|skipped|deselected|no tests ran).* in [0-9.]+s' "$f" | tail -n 8
                echo
            }
        done
        for f in "$BENCH/ops_$DEV.md" "$BENCH"/*_"$DEV".md "$BENCH"/ab/*_"$DEV".md "$BENCH"/cpu/*_cpu.md; do
            [ -f "$f" ] && {
                case $f in */ab/*) echo "===== second run (${OPS_ENV:-} ${BENCH_ENV:-} ${PREPARE_ENV:-}): $(basename "$f") =====" ;; esac
                cat "$f"
                echo
            }
        done
        for f in "$LOGS"/*.log; do
            [ -f "$f" ] || continue
            n=$(basename "$f" .log)
            if grep -qE "^$n +(FAIL|TIMEOUT)" "$STATUS"; then
                echo "===== $n FAILED: last 40 lines ====="
                tail -n 40 "$f"
                echo
            fi
        done
    } >"$OUT/summary.txt" 2>/dev/null
    tail_into "$OUT/build.log" 400 "$LOGS/build.log"
    tail_into "$OUT/tests.log" 400 "$LOGS/tests_cuda.log" "$LOGS/tests.log" "$LOGS"/tests_*.part
    tail_into "$OUT/bench.log" 300 "$LOGS/ops.log" "$LOGS/gat.log" "$LOGS/prepare.log" "$LOGS/ddp.log" "$LOGS/cpubench.log" "$LOGS/ncu.log" "$LOGS/sanitize.log" "$LOGS/script.log"
    tail_into "$OUT/profile.log" 600 "$LOGS/profile.log"
    for f in "$BENCH"/*_"$DEV".md; do
        [ -f "$f" ] && cp "$f" "$OUT/"
    done
    [ -f "$OUT/build.log" ] && [ ! -s "$OUT/build.log" ] && rm -f "$OUT/build.log"
    [ -f "$OUT/tests.log" ] && [ ! -s "$OUT/tests.log" ] && rm -f "$OUT/tests.log"
    for f in bench profile; do
        [ -f "$OUT/$f.log" ] && [ ! -s "$OUT/$f.log" ] && rm -f "$OUT/$f.log"
    done
    cp "$STATUS" "$WORK/status_copy.txt" 2>/dev/null
    tar -czf "$OUT/gpu_check.tar.gz.tmp" -C "$WORK" logs bench_out status.txt 2>/dev/null &&
        mv "$OUT/gpu_check.tar.gz.tmp" "$OUT/gpu_check.tar.gz"
    rm -f "$OUT"/prebuilt.t?z.part  # a pack the build step's timeout cut short
}

# ---------------------------------------------------------------- steps
# run_step NAME LIMIT COMMAND (a bash -c string); the timeout is cut to
# what the budget leaves after reserving the later steps' minimum shares.
run_step() {
    local name=$1 limit=$2 cmd=$3
    local left=$((BUDGET - (SECONDS - START) - RESERVE - $(reserved_after "$name")))
    local t0=$SECONDS rc st note=""
    if [ "$left" -lt 15 ]; then
        printf '%-11s %-9s %6s  %s\n' "$name" SKIPPED 0 "no time left in the ${BUDGET}s budget" >>"$STATUS"
        FAILED=1
        collect
        return
    fi
    [ "$limit" -gt "$left" ] && {
        note="limit cut to ${left}s"
        limit=$left
    }
    echo ">>> [$((SECONDS - START))s] $name (timeout ${limit}s${note:+, $note}), log $LOGS/$name.log"
    {
        printf '%s\n' "$cmd" | sed 's/^/$ /'
        echo "\$ (timeout ${limit}s, started $(date -u '+%H:%M:%S UTC'))"
    } >"$LOGS/$name.log"
    STEP_LIMIT=$limit timeout --kill-after=10 "$limit" bash -c "$cmd" >>"$LOGS/$name.log" 2>&1
    rc=$?
    case $rc in
        0) st=PASS ;;
        124 | 137) st=TIMEOUT ;;
        *) st="FAIL($rc)" ;;
    esac
    if [ "$name" != info ] && [ "$st" != PASS ]; then FAILED=1; fi
    if [[ $name == tests* ]] && [ $rc -eq 5 ]; then
        st=NOTESTS
        FAILED=1
    fi
    printf '%-11s %-9s %6s  %s\n' "$name" "$st" "$((SECONDS - t0))" "$note" >>"$STATUS"
    echo "<<< $name: $st in $((SECONDS - t0)) s"
    tail -n 3 "$LOGS/$name.log" | sed 's/^/    /'
    collect
}


# GPU_CHECK_INFO=0 skips the info step (a second call on a warm machine)
[ "${GPU_CHECK_INFO:-1}" = 0 ] || run_step info "${T_INFO:-60}" '
nvidia-smi || echo "nvidia-smi failed"
echo
echo "python: $(python3 --version 2>&1) at $(command -v python3)"
python3 - <<EOF
import torch, platform
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("GPU", p.name, round(p.total_memory / 2**30, 1), "GiB", p.multi_processor_count, "SMs", "cc", f"{p.major}.{p.minor}")
try:
    import torch_geometric
    print("pyg", torch_geometric.__version__)
except Exception as e:
    print("pyg import failed:", e)
EOF
nvcc --version 2>&1 | tail -n 2 || echo "no nvcc"
echo "ninja $(ninja --version 2>&1 || echo missing)"
python3 -m pip list 2>/dev/null | grep -i -E "^(torch|torch-geometric|torch_geometric|pytest|scipy|matplotlib|numpy|ninja) " || true
echo "cpus: $(nproc); $(grep -m1 "model name" /proc/cpuinfo)"
free -g | head -2
df -h /tmp | tail -1
echo "PYG_FASTATTN_DATA=${PYG_FASTATTN_DATA:-unset}; PYG_FASTATTN_CACHE=$PYG_FASTATTN_CACHE"
'

# Libraries built by earlier calls (prebuilt.txz or .tgz from their $OUT,
# carried in .data/ as prebuilt*.txz / .tgz) go into the cache: a folder's
# name is the hash of the sources, flags and toolchain, so a library loads
# only if nothing changed. (-m: files dated now, after the sources' copy, so
# ninja finds unpacked objects up to date.)
for f in "$ROOT"/.data/prebuilt*.txz "$ROOT"/.data/prebuilt*.tgz; do
    [ -f "$f" ] && mkdir -p "$PYG_FASTATTN_CACHE" && tar -xmf "$f" -C "$PYG_FASTATTN_CACHE"
done

if [ $want_build -eq 1 ]; then
    run_step build "${T_BUILD:-360}" '
# The CPU-only build that the build tests copy their objects from
# (tests/test_robustness.py, _cpu_objects): one build here, not one in each
# of those tests while the other shards run. On a CUDA machine it runs beside
# the CUDA build (its own folder and lock), whose wall time is set by its
# longest nvcc jobs.
c=$(python3 -c "from pyg_fastattn import _build as b; print(b._build_dir_for(b._csrc(), False))")
had_cpu=$([ -f "$c/pyg_fastattn_C.so" ] && echo 1 || echo 0)
cpid=
if [ "$GPU_CHECK_DEVICE" = cuda ]; then
    PYG_FASTATTN_CUDA=0 python3 -m pyg_fastattn.build >"'"$LOGS"'/build_cpu.part" 2>&1 &
    cpid=$!
fi
fail() { [ -n "$cpid" ] && kill "$cpid" 2>/dev/null; exit "$1"; }
PYG_FASTATTN_VERBOSE=1 python3 -m pyg_fastattn.build || fail $?
python3 - <<EOF
import os, sys
from pyg_fastattn._build import info
i = info()
print(i)
if os.environ["GPU_CHECK_DEVICE"] == "cuda" and not i["native_cuda"]:
    print("CUDA kernels are NOT native")
    sys.exit(3)
# seconds per object, from the ninja log (start and end in ms)
log = os.path.join(i["build_dir"] or "", ".ninja_log")
if os.path.exists(log):
    rows = [l.split("\t") for l in open(log) if not l.startswith("#")]
    for r in sorted(rows, key=lambda r: int(r[0]) - int(r[1])):
        print(f"{(int(r[1]) - int(r[0])) / 1000:8.1f} s  {r[3]}")
EOF
[ $? -eq 0 ] || fail 3
d=$(python3 -c "from pyg_fastattn._build import info; print(info()[\"build_dir\"])")
# What this call built goes into prebuilt.txz: the library (xz: 9.8 MB where
# gzip gives 15.9; a returned file may have 16 MiB) as soon as it is built,
# then again with the CPU-only folder (objects included, under 1 MB), each
# written aside and renamed, so that a step cut short still returns a whole
# pack. A library unpacked from a carried prebuilt (no ninja log) is not
# packed again.
pack=()
if [ -f "$d/.ninja_log" ]; then pack+=("$(basename "$d")/pyg_fastattn_C.so")
else echo "library from a carried prebuilt: not packed again"; fi
pack_prebuilt() {
    [ ${#pack[@]} -gt 0 ] || return 0
    if command -v xz >/dev/null; then local f="'"$OUT"'/prebuilt.txz" z=-J; export XZ_OPT="-6 -T0"
    else local f="'"$OUT"'/prebuilt.tgz" z=-z; fi
    tar -c $z -f "$f.part" --exclude=lock -C "$(dirname "$d")" "${pack[@]}" && mv "$f.part" "$f"
}
pack_prebuilt
if [ -n "$cpid" ]; then
    wait "$cpid"; rc=$?
    echo "CPU-only build (beside the CUDA build):"; cat "'"$LOGS"'/build_cpu.part"
    [ $rc -eq 0 ] || exit $rc
else
    PYG_FASTATTN_CUDA=0 python3 -m pyg_fastattn.build || exit $?
fi
if [ $had_cpu -eq 0 ] && [ "$c" != "$d" ]; then pack+=("$(basename "$c")"); pack_prebuilt; fi
ls -l "'"$OUT"'"/prebuilt* 2>/dev/null || true
'
fi

if [ $want_tests -eq 1 ]; then
    # The whole suite (CPU tests too: this torch is another version), or
    # with cudatests only the CUDA ones.
    if [ $cuda_only -eq 1 ]; then
        run_step tests_cuda "${T_TESTS_CUDA:-150}" '
python3 -m pytest ${TEST_ARGS:-tests} -q -x -m cuda -rfEs --durations=10 -p no:cacheprovider || exit $?
[ -z "${TEST_ENV:-}" ] || env $TEST_ENV python3 -m pytest ${TEST_ARGS:-tests} -q -x -m cuda -rfEs -p no:cacheprovider'
    else
        # TEST_SHARDS=N runs the tests in N concurrent pytest processes
        # (balanced by scripts/test_shards.sh; 12 on a machine of 12 or more
        # cores, else 1), each logging to tests_<k>.part.
        run_step tests "${T_TESTS:-360}" '
n=${TEST_SHARDS:-$(( $(nproc) >= 12 ? 12 : 1 ))}
mapfile -t shards < <(scripts/test_shards.sh "$n" ${TEST_ARGS:-})
pids=()
for ((k = 0; k < n; k++)); do
    [ -n "${shards[$k]:-}" ] || continue
    read -ra sel <<<"${shards[$k]}"
    echo "shard $k: ${sel[*]}"
    # shards 0 and 1 hold the heaviest tests (Cora training runs on the CPU,
    # compiled and bf16): 4 threads each
    thr=$(( $(nproc) / n )); [ $k -lt 2 ] && [ $thr -lt 4 ] && thr=$(( $(nproc) < 4 ? $(nproc) : 4 ))
    OMP_NUM_THREADS=$thr python3 -m pytest "${sel[@]}" -q -rfEs --durations=8 -p no:cacheprovider \
        >"'"$LOGS"'/tests_$k.part" 2>&1 &
    pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
for ((k = 0; k < n; k++)); do
    [ -f "'"$LOGS"'/tests_$k.part" ] || continue
    echo "===== shard $k ====="
    cat "'"$LOGS"'/tests_$k.part"
done
exit $rc'
    fi
fi

if [ $want_ops -eq 1 ]; then
    # --budget-s: start no new workload once the step's timeout is near
    # OPS_ONLY: its --only; OPS_ENV: an env assignment for a second run
    # (A/B in one call; outputs in bench_out/ab, tables in the step's log)
    runs=$([ -n "${OPS_ENV:-}" ] && echo 2 || echo 1)
    run_step ops "${T_OPS:-180}" "share=\$(( STEP_LIMIT / $runs )); rc=0
bench() { python3 benchmarks/bench_ops.py --device $DEV --budget-s \$(( share > 80 ? share - 40 : share / 2 )) $quick ${OPS_ONLY:+--only '$OPS_ONLY'} \"\$@\"; }
bench --out '$BENCH' || rc=1
${OPS_ENV:+echo '== again with $OPS_ENV'; (export $OPS_ENV; bench --out '$BENCH/ab') || rc=1}
exit \$rc"
fi

if [ $want_gat -eq 1 ]; then
    # BENCH_CONVS: layer families, one bench_gat.py run each (share of the
    # step's time); gat by default
    # BENCH_ENV: an env assignment for a second run of each (A/B in one
    # call; its outputs in bench_out/ab)
    runs=$([ -n "${BENCH_ENV:-}" ] && echo 2 || echo 1)
    run_step gat "${T_GAT:-240}" "convs=(${BENCH_CONVS:-gat}); share=\$(( STEP_LIMIT / \${#convs[@]} / $runs )); rc=0
bench() { python3 benchmarks/bench_gat.py --conv \$c --device $DEV --cuda-graph --budget-s \$(( share > 120 ? share - 60 : share / 2 )) $quick ${BENCH_ONLY:+--only '$BENCH_ONLY'} ${BENCH_PROVIDERS:+--providers '$BENCH_PROVIDERS'} ${BENCH_XGRAD:+--x-grad} \"\$@\"; }
for c in \${convs[@]}; do
    bench --out '$BENCH' || rc=1
    ${BENCH_ENV:+echo '== again with $BENCH_ENV'; (export $BENCH_ENV; bench --out '$BENCH/ab') || rc=1}
done
exit \$rc"
fi

if [ $want_profile -eq 1 ]; then
    # PROFILE_ENV: an env assignment for a second run (A/B in one call)
    # (PROFILE_CONV may name several layer families, one run each)
    prof="python3 benchmarks/profile_gat.py --device $DEV --conv \$c ${PROFILE_ONLY:+--only '$PROFILE_ONLY'} ${PROFILE_PROVIDERS:+--providers '$PROFILE_PROVIDERS'} ${PROFILE_ROWS:+--rows $PROFILE_ROWS} ${BENCH_XGRAD:+--x-grad}"
    run_step profile "${T_PROFILE:-120}" "rc=0
for c in ${PROFILE_CONV:-gat}; do
    $prof || rc=1
    ${PROFILE_ENV:+echo '== again with $PROFILE_ENV'; env $PROFILE_ENV $prof || rc=1}
done
exit \$rc"
fi

if [ $want_prepare -eq 1 ]; then
    # PREPARE_ENV: an env assignment for a second run (outputs in bench_out/ab)
    prep="python3 benchmarks/bench_prepare.py --device $DEV --sizes 1M:20M --budget-s \$(( STEP_LIMIT > 60 ? STEP_LIMIT - 30 : STEP_LIMIT / 2 )) $quick ${PREPARE_ARGS:-}"
    run_step prepare "${T_PREPARE:-120}" "rc=0
$prep --out '$BENCH' || rc=1
${PREPARE_ENV:+echo '== again with $PREPARE_ENV'; (export $PREPARE_ENV; $prep --out '$BENCH/ab') || rc=1}
exit \$rc"
fi

if [ $want_ddp -eq 1 ]; then
    run_step ddp "${T_DDP:-120}" '
n=$(python3 -c "import torch; print(torch.cuda.device_count())")
for p in 1 $([ "$n" -gt 1 ] && echo "$n"); do
    echo "== $p process(es)"
    python3 -m torch.distributed.run --standalone --nproc_per_node $p \
        examples/train_ddp.py --device cuda --epochs 100 || exit $?
done'
fi

if [ $want_ab -eq 1 ]; then
    sets=""
    for st in ${AB_SETS:-PYG_FASTATTN_BWD_NARROW=1 PYG_FASTATTN_BWD_NARROW=0}; do sets+=" --set $st"; done
    run_step ab "${T_AB:-120}" "python3 benchmarks/ab_env.py ${AB_WORKLOADS:-gat_1m gat_1m_bf16 gat_100k}$sets"
fi

if [ $want_ncu -eq 1 ]; then
    export NCU_DIR="$BENCH/ncu" NCU_REP="$WORK/ncu_rep"
    run_step ncu "${T_NCU:-300}" '
command -v ncu >/dev/null || { echo "ncu not found"; exit 3; }
mkdir -p "$NCU_DIR" "$NCU_REP"
rc=0
for w in ${NCU_WORKLOADS:-gat_1m gat_1m_bf16 sa_1m gat_100k}; do
  runs=("$w:") k=0
  for e in ${NCU_ENV:-}; do k=$((k + 1)); runs+=("${w}_env$k:${e//,/ }"); done
  for spec in "${runs[@]}"; do
    r=${spec%%:*} envs=${spec#*:}
    echo "== $r ${envs:+($envs)}"
    env $envs ncu --profile-from-start off --clock-control none --set "${NCU_SET:-full}" \
        ${NCU_KERNELS:+--kernel-name "regex:$NCU_KERNELS"} \
        --import-source no -f -o "$NCU_REP/$r" python3 benchmarks/ncu_kernels.py "$w" || { rc=1; continue; }
    ncu --import "$NCU_REP/$r.ncu-rep" --page details >"$NCU_DIR/$r.txt" 2>&1 || rc=1
    grep -E "^  [a-z_].*\\(|Duration|Memory Throughput|DRAM Throughput|Compute \\(SM\\) Throughput|Achieved Occupancy|Registers Per Thread" "$NCU_DIR/$r.txt" | head -n 120
    for k in attention_bwd_kernel attention_fwd_kernel; do  # whole kernels, not split-path parts
        ncu --import "$NCU_REP/$r.ncu-rep" --page source --csv --print-source sass \
            --kernel-name "regex:^$k\$" >"$NCU_REP/$r.$k.csv" 2>&1 &&
            python3 benchmarks/ncu_kernels.py --hotspots "$NCU_REP/$r.$k.csv" >"$NCU_DIR/$r.$k.hot.txt" 2>&1
        gzip -c "$NCU_REP/$r.$k.csv" >"$NCU_DIR/$r.$k.csv.gz" 2>/dev/null
    done
  done
done
exit $rc'
fi

if [ $want_sanitize -eq 1 ]; then
    # SANITIZE_ARGS: pytest arguments, or several selections separated by ";"
    # (one compute-sanitizer process each, concurrently; logs sanitize_<k>.part)
    run_step sanitize "${T_SANITIZE:-180}" '
command -v compute-sanitizer >/dev/null || { echo "compute-sanitizer not found"; exit 3; }
IFS=";" read -ra groups <<<"${SANITIZE_ARGS:-tests/test_robustness.py tests/test_hub.py -m cuda -k \"not reference and not 64bit and not no_leaks\"}"
pids=()
for k in "${!groups[@]}"; do
    echo "selection $k: ${groups[$k]}"
    eval "PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout $((STEP_LIMIT > 30 ? STEP_LIMIT - 15 : STEP_LIMIT)) compute-sanitizer --tool memcheck --error-exitcode 9 --print-limit 50 python3 -m pytest ${groups[$k]} -q -rfEs -p no:cacheprovider" >"'"$LOGS"'/sanitize_$k.part" 2>&1 &
    pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
for k in "${!groups[@]}"; do echo "===== selection $k ====="; cat "'"$LOGS"'/sanitize_$k.part"; done
exit $rc'
fi

if [ $want_cpubench -eq 1 ]; then
    run_step cpubench "${T_CPUBENCH:-150}" "python3 benchmarks/bench_gat.py --device cpu --conv ${CPU_BENCH_CONV:-gat} --only '${CPU_BENCH_ONLY:-Cora epoch}' --providers pyg,fast,floor --out '$BENCH/cpu' --budget-s \$(( STEP_LIMIT > 80 ? STEP_LIMIT - 40 : STEP_LIMIT / 2 ))"
fi

if [ $want_script -eq 1 ]; then
    if [ -z "${SCRIPT:-}" ]; then
        echo "script: SCRIPT is not set" >&2
        printf '%-11s %-9s %6s  %s\n' script FAIL 0 'SCRIPT not set' >>"$STATUS"
        FAILED=1
    else
        run_step script "${T_SCRIPT:-120}" "$SCRIPT"
    fi
fi

collect
echo
cat "$STATUS"
echo "outputs in $OUT: $(ls "$OUT" | tr '\n' ' ')"
exit $FAILED
