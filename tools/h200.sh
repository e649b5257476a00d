#!/usr/bin/env bash
# One call on the lent H200: tests, demo, benchmark, probes; logs under $OUT.
# Usage (device tool, carry [".whl"]): bash tools/h200.sh STAGE...
# What a kernel change owes the GPU, a call each: `test1-mem`, `rest2` (the whole suite), `fuzz layouts`.
# stages:
#   require-h200 (ends the call unless the card is an H200: put it first)
#   tests: test (all at once), test1 test2 test3 (the suite in three parts), rest (test2, test3 and the memory
#     test side by side), test1-mem + rest2 (the suite in two calls), memtest, test-x2 (two GPUs), test-seq
#     (one process); fuzz (the three fuzzers, the GPU profile); layouts (tools/two_widths.py's small kernel,
#     then tools/layout_probe.py's cases, plain and under memcheck); sanitize (memcheck and racecheck over
#     every kernel); fa-suite (FlashAttention's own tests/test_flash_attn.py, carried unchanged in .fa/ (carry
#     ".fa"), on common.flash_attn_interface through tools/fa_suite/run.py: FA_PER_TEST cases of each test
#     function, each backend; its 250-iteration race test left out); gluon, gluon-bwd (its halves
#     gluon-bwd-plain, gluon-bwd-ws, gluon-bwd-probe), gluon-bwd-dispatch (the one pass as the backward, its
#     tests and the timings against SDPA; TRITON_CARRIED=1), gluon-bwd-host (the one pass in a loop of calls),
#     gluon-bwd-forms (its forms timed, the grouped-query training step), fp8, paged-check, serving (a
#     feature's tests, then its probe); ring-test (two GPUs)
#   timings: bench, bench-full (BENCHMARKS.md's run, --write), bench-table (the committed table's bf16 forward and
#     backward in one call), bench-fp8, bench-bwd, bench-fwd4k, bench-x2 (two GPUs); compare; demo; probe;
#     serving-one (issue 45's serving figures), serving-bench (generate_batch's tokens a second); fp8-paged (the
#     paged FP8 decode's tiles swept); fp8-join-tiles (NineToothed's FP8 pages of 16 joined a step); gluon-tiles
#     (the Gluon forward's tiles swept); maxnreg; quirks; ring-bench,
#     ring-bench-long (two GPUs); ncu (Nsight Compute's counters of NCU_CASES, tools/ncu_targets.py)
#   another Triton (tools/carry_triton.sh): triton-part (a call a part; 3.9.0 is one), triton-install; then TRITON_CARRIED=1
#   tuning: tune, tune64, tune128, tune-bwd, tune-fp8, tune-gluon, tune-fwd-nt, tune-fwd-nt-dims
#   A/B of a change: ab (AB_PROBES in each of AB_TREES and here), ab-bench (forward throughput in each tree),
#     ab-tests (a part of the suite in each tree); trees from committed patches: tools/ab_trees.sh
# (any other word runs as a shell command)
set -uo pipefail
# (once a call: the stages a stage runs side by side, as `rest` does, find it installed)
[ -n "${H200_INSTALLED:-}" ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export H200_INSTALLED=1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
# TRITON_CARRIED=1: run under the Triton carried in parts (tools/carry_triton.sh; stages triton-part, triton-install)
if [ -n "${TRITON_CARRIED:-}" ] && [[ " $* " != *" triton-install "* ]]; then
  [ -d /tmp/triton-carried/triton ] || { echo "no carried Triton here: run the triton-part calls, then triton-install"; exit 1; }
  export PYTHONPATH=/tmp/triton-carried:$PYTHONPATH
  # (the carried wheel keeps the ptxas 3.9 compiles sm_90 with, CUDA 13's ptxas-blackwell, and not the legacy
  # one it runs for older GPUs: that name points at the one kept)
  export TRITON_PTXAS_PATH=/tmp/triton-carried/triton/backends/nvidia/bin/ptxas-blackwell
fi
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
# the suite in three parts (fuzz and ring have stages of their own); the logs name every test (-v), so a
# part cut short by the call's limit still says which tests had not finished
HALF1="tests/test_attention.py tests/test_backward.py tests/test_model_features.py"
REST="tests --ignore=tests/test_attention.py --ignore=tests/test_backward.py --ignore=tests/test_model_features.py --ignore=tests/test_fuzz.py --ignore=tests/test_fuzz_paged.py --ignore=tests/test_fuzz_varlen.py --ignore=tests/test_ring.py"
HALF2="tests/test_paged.py tests/test_varlen.py tests/test_dropout.py tests/test_errors.py tests/test_seed.py tests/test_launch.py"
HALF3="$REST --ignore=tests/test_paged.py --ignore=tests/test_varlen.py --ignore=tests/test_dropout.py --ignore=tests/test_errors.py --ignore=tests/test_seed.py --ignore=tests/test_launch.py"
# (NO_GLUON_TESTS=1: test3 without tests/test_gluon.py, for a call that runs the `gluon` stage on its own: under
# triton 3.9, whose one-pass cases run where 3.6 skips them, test3 with it ran past a call beside test2)
[ -n "${NO_GLUON_TESTS:-}" ] && HALF3="$HALF3 --ignore=tests/test_gluon.py"
# the memory test compiles a kernel for each class of 10,000 calls' lengths, one after another (NineToothed's
# pass ran past 400 s): a stage of its own, both backends at once, so that test3 fits a call
MEMTEST="tests/test_reliability.py::test_no_growth_over_10000_calls"
for stage in "$@"; do
  echo "=== $stage $(date +%T)"
  case $stage in
    # the stages after it only on an H200 (kind nvidia-h200 may bring an H100, where an H200 question gets no
    # answer): otherwise the call ends here, having spent only its start
    require-h200) nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 || { echo "not an H200: the rest not run"; exit 3; } ;;
    probe) timeout 120 python3 tools/probe.py 2>&1 | tee "$OUT/probe.log" ;;
    # a Triton carried in parts (tools/carry_triton.sh): each call's part kept in /tmp while the machine stays warm,
    # then unpacked beside the image's own; TRITON_CARRIED=1 puts it first on PYTHONPATH for the stages after
    triton-part) mkdir -p /tmp/triton-parts && cp .triton-carry/part-* /tmp/triton-parts/ && ls -l /tmp/triton-parts ;;
    triton-install) rm -rf /tmp/triton-carried && mkdir -p /tmp/triton-carried
                    cat /tmp/triton-parts/part-* | xz -d | tar -x -C /tmp/triton-carried || exit 1
                    PYTHONPATH=/tmp/triton-carried:$PYTHONPATH python3 -c "import triton, torch; print('carried triton', triton.__version__, 'under torch', torch.__version__)" ;;
    test) timeout 570 python3 -m pytest tests -q -n 8 -p no:cacheprovider --tb=short -rfE > "$OUT/pytest.log" 2>&1; tail -25 "$OUT/pytest.log" ;;
    # The whole suite outgrew one call (600 s) on a fresh machine: three parts, a call each (test2 and test3 may share one;
    # TEST_TIMEOUT: seconds for each part's pytest, 570 unless set, for a call that runs more after it).
    test1|test2|test3) part=HALF${stage#test}
       deselect=(); [ "$stage" = test3 ] && deselect=(--deselect "$MEMTEST[triton]" --deselect "$MEMTEST[ninetoothed]")
       timeout -s INT "${TEST_TIMEOUT:-570}" python3 -m pytest ${!part} "${deselect[@]}" -v -n 14 -p no:cacheprovider --tb=short -rfE --durations=12 > "$OUT/pytest${stage#test}.log" 2>&1
       grep -c PASSED "$OUT/pytest${stage#test}.log"; tail -22 "$OUT/pytest${stage#test}.log"
       # failures run again alone (at most 10, RERUN_TIMEOUT s): 14 workers beside the 2^31-element tests ran
       # an 80 GB H100 out of memory at a launch (2026-12-05), which a test run alone does not
       mapfile -t failed < <(grep '^FAILED ' "$OUT/pytest${stage#test}.log" | sed 's/^FAILED //; s/ - .*$//')
       if [ "${#failed[@]}" -gt 0 ] && [ "${#failed[@]}" -le 10 ]; then
         echo "--- the ${#failed[@]} failures again, alone:"
         timeout -s INT "${RERUN_TIMEOUT:-150}" python3 -m pytest "${failed[@]}" -q -n 2 -p no:cacheprovider --tb=short -rfE 2>&1 | tail -8
       fi ;;
    # test2, test3 and the memory test at once (16 cores; 2026-12-02 they took 4 m 4 s, 3 m 26 s and 5 m 21 s
    # side by side): what test1 leaves of the suite, in one call
    rest) for part in test2 test3 memtest; do bash "$0" "$part" > "$OUT/$part.out" 2>&1 & done; wait
          tail -4 "$OUT/test2.out"; tail -4 "$OUT/test3.out"; tail -6 "$OUT/memtest.out" ;;
    # the suite in two calls with the memory test beside test1 (2026-12-06 on an H200: test1 303 s, the memory test
    # 273 s on 2 workers), so that test2 and test3 share the next call without it (there test3 took 521 s of the
    # 600 beside both)
    test1-mem) (bash "$0" memtest > "$OUT/memtest.out" 2>&1) &
               TEST_TIMEOUT=560 bash "$0" test1 > "$OUT/test1.out" 2>&1; wait
               tail -24 "$OUT/test1.out"; tail -8 "$OUT/memtest.out" ;;
    rest2) for part in test2 test3; do bash "$0" "$part" > "$OUT/$part.out" 2>&1 & done; wait
           tail -4 "$OUT/test2.out"; tail -4 "$OUT/test3.out" ;;
    memtest) timeout -s INT 570 python3 -m pytest "$MEMTEST" -v -n 2 -p no:cacheprovider --tb=short -rfEP --durations=2 > "$OUT/memtest.log" 2>&1
             tail -12 "$OUT/memtest.log" ;;
    # Both halves at once, one per GPU (kind nvidia-h200-x2): the suite in one call.
    test-x2) CUDA_VISIBLE_DEVICES=0 timeout 570 python3 -m pytest $HALF1 -q -n 14 -p no:cacheprovider --tb=short -rfE > "$OUT/pytest1.log" 2>&1 &
             CUDA_VISIBLE_DEVICES=1 timeout 570 python3 -m pytest $REST -q -n 14 -p no:cacheprovider --tb=short -rfE > "$OUT/pytest2.log" 2>&1; wait
             tail -8 "$OUT/pytest1.log"; tail -8 "$OUT/pytest2.log" ;;
    test-seq) timeout 420 python3 -m pytest tests -q -p no:cacheprovider 2>&1 | tail -40 | tee "$OUT/pytest.log" ;;
    # The Gluon Hopper forward: its tests (both variants against SDPA), then its speed against the tl kernel
    # and SDPA; the whole suite through it: ATTENTION_GLUON=1 bash tools/h200.sh test1 rest
    # the Gluon backward's GPU tests (both schemes; the one pass's dQ by the bulk reduce-add where triton has it,
    # TRITON_CARRIED=1), then its probe against the tl backward and cuDNN's
    # (the warp-specialised one pass's cases apart and bounded, so that a kernel waiting forever on an mbarrier
    # costs its own cases only; the probe then leaves it out, PROBE_BWD_WS=0; the tests and the probe fit a call
    # each; GLUON_BWD_K: a -k expression more for the other cases, e.g. "tma" for those only triton 3.9 runs;
    # GLUON_BWD_T: their seconds, 240 unless set)
    gluon-bwd) bash "$0" gluon-bwd-tests gluon-bwd-probe ;;
    gluon-bwd-tests) bash "$0" gluon-bwd-plain gluon-bwd-ws ;;
    gluon-bwd-plain) timeout "${GLUON_BWD_T:-240}" python3 -m pytest tests/test_gluon.py -k "backward and not one-pass-ws${GLUON_BWD_K:+ and ($GLUON_BWD_K)}" -q -n 8 -p no:cacheprovider --tb=short -rfE 2>&1 | tail -15 | tee "$OUT/gluon_bwd_tests.log" ;;
    gluon-bwd-ws) timeout -k 10 150 python3 -m pytest tests/test_gluon.py -k "backward and one-pass-ws" -q -n 8 -p no:cacheprovider --tb=short -rfE 2>&1 | tail -15 | tee "$OUT/gluon_bwd_ws_tests.log"
               echo "${PIPESTATUS[0]}" > /tmp/gluon_bwd_ws.rc ;;
    gluon-bwd-probe) ws=$(cat /tmp/gluon_bwd_ws.rc 2>/dev/null || echo 0)
               [ "$ws" = 0 ] || echo "the warp-specialised cases ended with exit $ws: the probe leaves them out"
               PROBE_BWD_WS=$([ "$ws" = 0 ] && echo 1 || echo 0) timeout "${GLUON_BWD_PROBE_T:-500}" python3 tools/probe.py gluon_bwd 2>&1 | tee "$OUT/gluon_bwd.log" ;;
    # the one pass as the triton backend's backward (TRITON_CARRIED=1: it runs under triton >= 3.9 only): its GPU
    # tests (the dispatch, the bound launches, the warp-specialised cases at ws_tile), then triton's forward, backward
    # and training step against SDPA's at D 64 and 128, 1k to 16k keys (the one pass from 1024; 2026-12-07 on an H100:
    # 39 s and 218 s at 4k and 16k)
    gluon-bwd-dispatch) timeout 240 python3 -m pytest tests/test_gluon.py -k "takes_the_one_pass or one-pass-ws or one_pass_runs or bound_one_pass" -q -n 8 -p no:cacheprovider --tb=short -rfE 2>&1 | tail -15 | tee "$OUT/gluon_bwd_dispatch.log"
                 timeout 300 python3 -m common bench --sections throughput --modes fwd bwd fwd+bwd --dtypes bfloat16 --head-dims 64 128 --lengths ${DISPATCH_LENGTHS:-1024 4096 16384} --backends triton torch --out /tmp/bench-bwd39 --markdown "" 2>&1 | grep "^throughput" > "$OUT/bench_bwd39.log"; cp /tmp/bench-bwd39/results.json "$OUT/results_bwd39.json"; tail -48 "$OUT/bench_bwd39.log" ;;
    # the one pass's forms against the tl backward (switched off for it) and SDPA's, the backward alone, at
    # PROBE_BWD_LENGTHS (2026-12-07: 1024 and 4096 timed; from 1024 it is dispatched), then issue 43's grouped-query step
    gluon-bwd-forms) PROBE_BWD_LENGTHS="${PROBE_BWD_LENGTHS:-1024 4096}" PROBE_BWD_TILES=0 PROBE_BWD_SCHEMES="one-pass ws,one-pass ws stats smem,one-pass ws stats smem 128 rows,one-pass ws stats smem 128 rows dqt,one-pass ws stats smem 3 stages,one-pass ws stats smem dqt" timeout 400 python3 tools/probe.py gluon_bwd 2>&1 | grep bf16 | tee "$OUT/gluon_bwd_forms.log"
                 timeout 90 python3 tools/probe.py gqa_step 2>&1 | grep fwd+bwd | tee "$OUT/gqa_step.log" ;;
    # the one pass in a user's loop against the tl backward's bound launches, around its size guard (TRITON_CARRIED=1)
    gluon-bwd-host) timeout 240 python3 tools/probe.py gluon_bwd_host 2>&1 | tee "$OUT/gluon_bwd_host.log" ;;
    # where a training step's time goes at 1k and 4k (kernels, host functions), the one pass and the tl backward, SDPA
    train-step) timeout 300 python3 tools/probe.py train_step 2>&1 | grep -v nanobind | tee "$OUT/train_step.log" ;;
    gluon) timeout 300 python3 -m pytest tests/test_gluon.py -q -n 8 -p no:cacheprovider --tb=short -rfE 2>&1 | tail -15 | tee "$OUT/gluon_tests.log"
           timeout 240 python3 tools/probe.py gluon 2>&1 | tee "$OUT/gluon_probe.log" ;;
    # the paged and FP8 tests of both backends (FP8-cache generation and the paged reliability tests too), then the
    # paged FP8 decode at pages of 16, 32 and 64, both backends, shipped and under PAGED_ALT (PROBE_SWITCHES words)
    paged-check) timeout 260 python3 -m pytest tests/test_paged.py tests/test_fp8.py tests/test_launch.py tests/test_flash_attn_interface.py tests/test_transformers.py::test_generation_from_an_fp8_paged_cache -q -n 14 -p no:cacheprovider --tb=short -rfE 2>&1 | tail -8 | tee "$OUT/paged_tests.log"
                 PROBE_PAGES="16 32 64" PROBE_BACKENDS="triton ninetoothed" PROBE_SWITCHES="${PAGED_ALT:-small-warps4 cfg:-,2,5}" timeout 300 python3 tools/probe.py paged_fp8_sweep 2>&1 | tee "$OUT/paged_fp8.log" ;;
    fp8) timeout 240 python3 -m pytest tests/test_fp8.py tests/test_transformers.py::test_generation_from_an_fp8_paged_cache -q -n 8 -p no:cacheprovider --tb=short -rfEP 2>&1 | grep -v "^$" | tail -40 | tee "$OUT/fp8_tests.log"
         timeout 300 python3 tools/probe.py fp8 2>&1 | tee "$OUT/fp8_probe.log" ;;
    demo) timeout 180 python3 -m common demo 2>&1 | tee "$OUT/demo.log" ;;
    bench) timeout 300 python3 -m common bench --lengths 1024 4096 16384 --out /tmp/bench --markdown "" 2>&1 | tail -400 > "$OUT/bench.log"; cp /tmp/bench/results.json "$OUT/" ;;
    # FP8's rows for BENCHMARKS.md with their bf16 twins (throughput at 4k and 16k, decode) in one run;
    # merge with the full benchmark's results.json by --from-json
    bench-fp8) timeout 500 python3 -m common bench --sections throughput decode fp8 --dtypes bfloat16 --lengths 4096 16384 --backends triton ninetoothed torch --out /tmp/bench-fp8 --markdown "" 2>&1 | tail -120 > "$OUT/bench_fp8.log"; cp /tmp/bench-fp8/results.json "$OUT/results_fp8.json"; grep -E "fp8|float8" "$OUT/bench_fp8.log" | tail -40 ;;
    bench-bwd) timeout 420 python3 -m common bench --sections throughput --modes bwd --dtypes bfloat16 --lengths 1024 4096 16384 --out /tmp/bench-bwd --markdown "" 2>&1 | tail -200 > "$OUT/bench_bwd.log"; cp /tmp/bench-bwd/results.json "$OUT/results_bwd.json"; tail -60 "$OUT/bench_bwd.log" ;;
    bench-fwd4k) timeout 300 python3 -m common bench --sections throughput --modes fwd --dtypes float16 --lengths 1024 4096 --backends triton ninetoothed torch --out /tmp/bench-fwd --markdown "" 2>&1 | tail -100 > "$OUT/bench_fwd.log"; cp /tmp/bench-fwd/results.json "$OUT/results_fwd.json"; tail -30 "$OUT/bench_fwd.log" ;;
    # The whole benchmark in one call on two GPUs (kind nvidia-h200-x2): fp16 throughput, the homework's and
    # the decode shapes on one, bf16 forward and backward throughput on the other; merge the three
    # results_*.json with `python -m common bench --from-json ...` (results are saved after every shape).
    bench-x2) CUDA_VISIBLE_DEVICES=0 timeout 560 python3 -m common bench --dtypes float16 --out /tmp/b-fp16 --markdown "" > "$OUT/bench_fp16.log" 2>&1 &
              (CUDA_VISIBLE_DEVICES=1 timeout 330 python3 -m common bench --sections throughput --dtypes bfloat16 --out /tmp/b-bf16 --markdown ""
               CUDA_VISIBLE_DEVICES=1 timeout 220 python3 -m common bench --sections throughput --modes bwd --dtypes bfloat16 --lengths 1024 4096 16384 --out /tmp/b-bwd --markdown "") > "$OUT/bench_bf16.log" 2>&1; wait
              cp /tmp/b-fp16/results.json "$OUT/results_fp16.json"; cp /tmp/b-bf16/results.json "$OUT/results_bf16.json"; cp /tmp/b-bwd/results.json "$OUT/results_bwd.json"
              tail -3 "$OUT/bench_fp16.log" "$OUT/bench_bf16.log" ;;
    # NineToothed's forward table again (its D 64 causal 4k entry ran 14% under another candidate on 2026-12-01;
    # on 19:48 UTC it was the fastest again)
    tune-fwd-nt) timeout 450 python3 -m common tune --backends ninetoothed --passes fwd 2>&1 | tee "$OUT/tune_fwd_nt.log"; cp impl_ninetoothed/configs.json "$OUT/nt_configs.json" ;;
    # NineToothed's forward table for the head dims in $TUNE_DIMS only (default 64), then its parity with Triton there
    tune-fwd-nt-dims) timeout 400 python3 -m common tune --backends ninetoothed --passes fwd --head-dims ${TUNE_DIMS:-64} 2>&1 | tee "$OUT/tune_fwd_nt.log"; cp impl_ninetoothed/configs.json "$OUT/nt_configs.json"
                      timeout 180 python3 -m common bench --sections throughput --modes fwd --dtypes float16 --head-dims ${TUNE_DIMS:-64} --lengths 1024 4096 16384 --backends triton ninetoothed --out /tmp/parity --markdown "" > "$OUT/parity.log" 2>&1; cp /tmp/parity/results.json "$OUT/results_parity.json"; tail -20 "$OUT/parity.log" ;;
    tune-bwd) timeout 500 python3 -m common tune --passes bwd 2>&1 | tee "$OUT/tune_bwd.log"; cp impl_triton/configs.json "$OUT/triton_configs.json"; cp impl_ninetoothed/configs.json "$OUT/nt_configs.json" ;;
    # the committed table from one call: the bf16 forward, the homework's shapes, decode and FP8 (one run), then
    # the bf16 backward (another); merged by `bench --from-json` here
    bench-table) timeout 330 python3 -m common bench --dtypes bfloat16 --lengths 1024 4096 16384 --out /tmp/bench-fwd --markdown "" 2>&1 | tail -300 > "$OUT/bench_fwd.log"; cp /tmp/bench-fwd/results.json "$OUT/results_fwd.json"
                 timeout 255 python3 -m common bench --sections throughput --modes bwd --dtypes bfloat16 --lengths 1024 4096 16384 --out /tmp/bench-bwd --markdown "" 2>&1 | tail -200 > "$OUT/bench_bwd.log"; cp /tmp/bench-bwd/results.json "$OUT/results_bwd.json"; tail -n 5 "$OUT/bench_fwd.log" "$OUT/bench_bwd.log" ;;
    bench-full) timeout 540 python3 -m common bench --write 2>&1 | tail -300 > "$OUT/bench.log"; cp benchmarks/results.json benchmarks/results.csv benchmarks/*.png "$OUT/" ;;
    tune) timeout 400 python3 -m common tune 2>&1 | tee "$OUT/tune.log"; cp impl_triton/configs.json "$OUT/triton_configs.json"; cp impl_ninetoothed/configs.json "$OUT/nt_configs.json" ;;
    # the FP8 forward's table entries, timed in FP8 (both backends, D 64 and 128, every bucket from 1k)
    tune-fp8) timeout 500 python3 -m common tune --passes fwd --dtypes float8_e4m3fn 2>&1 | tee "$OUT/tune.log"; cp impl_triton/configs.json "$OUT/triton_configs.json"; cp impl_ninetoothed/configs.json "$OUT/nt_configs.json" ;;
    # the Triton table's gluon section: the tl kernel against each Gluon variant per key (sm_90; TUNE_FP8=1: the FP8
    # keys too, once the FP8 ping-pong forward has passed its GPU tests)
    tune-gluon) timeout 450 python3 -m common tune --backends triton --passes gluon --head-dims 64 128 256 --dtypes float16 bfloat16 ${TUNE_FP8:+float8_e4m3fn} 2>&1 | tee "$OUT/tune_gluon.log"; cp impl_triton/configs.json "$OUT/triton_configs.json" ;;
    tune64) timeout 400 python3 -m common tune --head-dims 64 2>&1 | tee "$OUT/tune.log"; cp impl_triton/configs.json "$OUT/triton_configs.json"; cp impl_ninetoothed/configs.json "$OUT/nt_configs.json" ;;
    tune128) timeout 300 python3 -m common tune --head-dims 128 2>&1 | tee "$OUT/tune.log"; cp impl_triton/configs.json "$OUT/triton_configs.json"; cp impl_ninetoothed/configs.json "$OUT/nt_configs.json" ;;
    # memcheck over every kernel's calls, racecheck over one small call of each, a backend a process, all four
    # side by side; the kernels compiled first, without the sanitizer (under it, compiling alone outlasted 300 s)
    sanitize) timeout 170 python3 tools/sanitize.py > "$OUT/sanitize_plain.log" 2>&1; tail -1 "$OUT/sanitize_plain.log"
              for tool in memcheck racecheck; do for b in triton ninetoothed; do
                small=; [ $tool = racecheck ] && small=--small
                (timeout ${SANITIZE_TIMEOUT:-400} compute-sanitizer --tool $tool --error-exitcode 1 python3 tools/sanitize.py $small --backend $b > "$OUT/$tool-$b.log" 2>&1; echo "$tool $b rc $?" >> "$OUT/$tool-$b.log") &
              done; done; wait
              tail -n 4 "$OUT"/memcheck-*.log "$OUT"/racecheck-*.log ;;
    fuzz) FUZZ_PROFILE=gpu timeout 500 python3 -m pytest tests/test_fuzz.py tests/test_fuzz_paged.py tests/test_fuzz_varlen.py -q -n 12 -p no:cacheprovider --hypothesis-show-statistics 2>&1 | tail -40 | tee "$OUT/fuzz.log" ;;
    # every case of tools/layout_probe.py (small head dims in misaligned and (B, L, H, D) inputs) in a process of its
    # own, then again under compute-sanitizer's memcheck (LAYOUT_CASES: those cases only)
    layouts) timeout 120 python3 tools/two_widths.py 2>&1 | tee "$OUT/two_widths.log"
             timeout ${LAYOUT_TIMEOUT:-200} python3 tools/layout_probe.py --jobs 8 ${LAYOUT_CASES:-} 2>&1 | tee "$OUT/layouts.log"
             [ "${LAYOUT_SANITIZE_TIMEOUT:-200}" = 0 ] || timeout ${LAYOUT_SANITIZE_TIMEOUT:-200} python3 tools/layout_probe.py --sanitize --jobs 8 ${LAYOUT_CASES:-} 2>&1 | tee "$OUT/layouts_sanitize.log" ;;
    fa-suite) for b in triton ninetoothed; do ATTENTION_BACKEND=$b FA_PER_TEST=${FA_PER_TEST:-100} timeout ${FA_TIMEOUT:-270} python3 tools/fa_suite/run.py .fa/test_flash_attn.py -q -n 8 -rfE --tb=short -k "not race_condition" > "$OUT/fa_suite_$b.log" 2>&1; tail -12 "$OUT/fa_suite_$b.log"; done ;;
    # issue 44's paged FP8 decode under other key steps, warps, stages and register caps (both kernels)
    fp8-paged) PROBE_BACKENDS="${PROBE_BACKENDS:-triton ninetoothed}" timeout 420 python3 tools/probe.py paged_fp8_sweep 2>&1 | tee "$OUT/paged_fp8_sweep.log" ;;
    # NineToothed's FP8 pages of 16 with a step's tiles joined before their products (PAGED_FP8_JOIN_TILES) against
    # the shipped form, both value layouts, beside Triton's
    fp8-join-tiles) PROBE_BACKENDS="triton ninetoothed" PROBE_PAGES=16 PROBE_SWITCHES="join-tiles join-tiles-4-warps" timeout 300 python3 tools/probe.py paged_fp8_sweep 2>&1 | tee "$OUT/fp8_join_tiles.log" ;;
    # issue 45's serving figures from one call: every page size, static-cache decoding under CUDA graphs, then
    # continuous batching's tokens a second
    serving-one) timeout 230 python3 tools/probe.py paged 2>&1 | tee "$OUT/paged.log"
                 timeout 165 python3 tools/probe.py static 2>&1 | tee "$OUT/static.log"
                 timeout 180 python3 tools/probe.py serving 2>&1 | tee "$OUT/serving.log" ;;
    # continuous batching's tokens a second (generate_batch), nothing beside it: each implementation's line as it ends
    serving-bench) timeout 420 python3 tools/probe.py serving 2>&1 | tee "$OUT/serving.log" ;;
    serving) timeout 300 python3 -m pytest tests/test_paged.py tests/test_varlen.py tests/test_flash_attn_interface.py -q -n 14 -p no:cacheprovider --tb=short -rfE 2>&1 | tail -15 | tee "$OUT/serving_tests.log"; timeout 200 python3 tools/probe.py paged 2>&1 | tee "$OUT/paged.log" ;;
    ring-test) timeout 540 torchrun --nproc-per-node 2 -m tests.ring_worker triton ninetoothed torch 2>&1 | grep -v '^W1' | tail -40 | tee "$OUT/ring_test.log" ;;
    # issue 13's open points: 256k, and 64k causal with more calls per point
    ring-bench-long) timeout 560 torchrun --nproc-per-node 2 tools/ring_bench.py --lengths 65536 262144 --bwd-lengths 65536 --calls 5 --json "$OUT/ring_bench_long.json" 2>&1 | grep -v '^W1' | tail -60 > "$OUT/ring_bench_long.log"; tail -40 "$OUT/ring_bench_long.log" ;;
    ring-bench) timeout 400 torchrun --nproc-per-node 2 tools/ring_bench.py --json "$OUT/ring_bench.json" 2>&1 | grep -v '^W1' | tail -60 > "$OUT/ring_bench.log"; tail -40 "$OUT/ring_bench.log" ;;
    # Registers capped (Triton's maxnreg) where a kernel would then hold one more program an SM: decode, D 64 forward
    maxnreg) (for cap in 0 128 168; do PROBE_MAXNREG=$cap timeout 190 python3 tools/probe.py maxnreg; done) 2>&1 | tee "$OUT/maxnreg.log" ;;
    quirks) timeout 120 python3 tools/sdpa_quirks.py 2>&1 | tee "$OUT/quirks.log" ;;
    # A/B in one call: the probes named in $AB_PROBES in each of $AB_TREES (default ab/: untracked
    # copies of other revisions, made with `git archive REV | tar -x -C ab`; carry them) and here.
    ab) for tree in ${AB_TREES:-ab} .; do echo "--- $tree"; (cd "$tree" && PYTHONPATH=${TRITON_CARRIED:+/tmp/triton-carried:}/tmp/site:$PWD timeout 250 python3 tools/probe.py $AB_PROBES); done 2>&1 | tee "$OUT/ab.log" ;;
    # The forward (and with AB_BWD=1 the backward) throughput of both kernel backends in each of $AB_TREES and
    # here (fp16, L 1k/4k/16k), one results_<tree>.json each: the A/B of a kernel change
    # (here: results_<checkout folder's name>.json); tools/ab_summary.py puts them side by side.
    # AB_BACKENDS: the backends timed in every tree (SDPA's "torch" beside ours gives each tree its ratio);
    # AB_HERE: those timed in this tree (Triton's kernel is the same in both when only NineToothed changed);
    # AB_MASKING: "causal" or "full" for half the shapes; AB_DTYPES, AB_DIMS: the inputs' dtypes and head dims;
    # AB_SECTIONS: the benchmark's sections ("throughput" unless set; "fp8": its FP8 prefill and decode);
    # AB_TAG: a suffix to the results' names (two ab-bench runs in one call).
    ab-bench) for tree in ${AB_TREES:-ab} .; do echo "--- $tree"; name=$(basename "$(cd "$tree" && pwd)")${AB_TAG:-}
                backends=${AB_BACKENDS:-triton ninetoothed}; [ "$tree" = . ] && backends=${AB_HERE:-$backends}
                (cd "$tree" && PYTHONPATH=${TRITON_CARRIED:+/tmp/triton-carried:}/tmp/site:$PWD timeout ${AB_TIMEOUT:-270} python3 -m common bench --sections ${AB_SECTIONS:-throughput} --modes fwd ${AB_BWD:+bwd} --masking ${AB_MASKING:-full causal} --dtypes ${AB_DTYPES:-float16} --head-dims ${AB_DIMS:-64 128} --lengths 1024 4096 16384 --backends $backends --out "/tmp/ab-$name" --markdown "" 2>&1 | grep -E "throughput|fp8")
                cp "/tmp/ab-$name/results.json" "$OUT/results_$name.json"; done 2>&1 | tee -a "$OUT/ab_bench.log" ;;
    # the tests in AB_TESTS selected by AB_K (the persistent Gluon forward's cases against SDPA unless set) in each
    # of $AB_TREES and here (not here with AB_TESTS_HERE=0), AB_TESTS_TIMEOUT seconds each
    ab-tests) for tree in ${AB_TREES:-ab} $([ "${AB_TESTS_HERE:-1}" = 0 ] || echo .); do echo "--- $tree"
                (cd "$tree" && PYTHONPATH=${TRITON_CARRIED:+/tmp/triton-carried:}/tmp/site:$PWD timeout ${AB_TESTS_TIMEOUT:-150} python3 -m pytest ${AB_TESTS:-tests/test_gluon.py} -k "${AB_K:-matches_sdpa and persistent}" -q -n 8 -p no:cacheprovider --tb=short -rfE 2>&1 | tail -6)
              done 2>&1 | tee "$OUT/ab_tests.log" ;;
    # the Gluon forward's tiles swept, persistent programs among them (2 stages leave D 128 room for the next Q)
    gluon-tiles) PROBE_GLUON_DIMS="${PROBE_GLUON_DIMS:-128 256}" PROBE_GLUON_LENGTHS="${PROBE_GLUON_LENGTHS:-1024 4096}" \
                 timeout ${TILES_TIMEOUT:-500} python3 tools/probe.py gluon_tiles 2>&1 | tee "$OUT/gluon_tiles.log" ;;
    ncu) NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
         [ -n "$NCU" ] || { echo "no ncu on this machine"; exit 1; }
         for target in ${NCU_CASES:-d128-4k d128-4k-sdpa fp8-d128-4k d256-4k d256-4k-sdpa bwd-d128-4k bwd-d128-4k-sdpa}; do
           timeout ${NCU_TIMEOUT:-150} "$NCU" --profile-from-start off --clock-control none --set full -f \
             -o "$OUT/ncu_$target" python3 tools/ncu_targets.py "$target" > "$OUT/ncu_$target.log" 2>&1
           [ -f "$OUT/ncu_$target.ncu-rep" ] || { echo "--- $target: no report"; tail -5 "$OUT/ncu_$target.log"; continue; }
           "$NCU" --import "$OUT/ncu_$target.ncu-rep" --page details > "$OUT/ncu_$target.txt" 2>&1
           "$NCU" --import "$OUT/ncu_$target.ncu-rep" --page raw --csv > "$OUT/ncu_$target.csv" 2>&1
           "$NCU" --import "$OUT/ncu_$target.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_$target.sass.csv" 2>&1
           echo "--- $target"; grep -E "^  [a-z_]|Duration|Compute \(SM\) Throughput|Memory Throughput|Issue Slots Busy|No Eligible" "$OUT/ncu_$target.txt" | head -24
           python3 tools/ncu_stalls.py "$OUT/ncu_$target.sass.csv" --top 12 > "$OUT/ncu_$target.stalls.txt" 2>&1
         done
         # one archive (a call brings back a few files only; the reports themselves stay behind: tens of MB)
         (cd "$OUT" && tar czf ncu.tgz --exclude='*.ncu-rep' ncu_* && rm -f ncu_*) ;;
    compare) timeout 300 python3 -m common compare --write 2>&1 | tee "$OUT/compare.log"; cp comparison/gpu.json "$OUT/" ;;
    *) eval "$stage" ;;
  esac
  echo "=== end $stage $(date +%T)"
done
