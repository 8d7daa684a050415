#!/usr/bin/env bash
# Rerun the README's benchmark figures on one H200 at the current code, in parts that each fit one
# 10-minute call of a lent GPU machine (each step has its own time limit, so one slow step cannot
# take the others' results with it):
#
#     INFERSCALE_COMMIT=$(git rev-parse --short HEAD) bench/tools/rerun_h200.sh PART RESULTS_DIR [TARBALL]
#
#   1  kernels: ceilings, paged decode vs jax's paged_attention (B=32 over 4k / 32k, B=128 over 4k),
#      prefill vs cuDNN's causal path, splice, KV write, cascade (bench/kernels/kernels.py abcdef); the ragged
#      kernel (bench/kernels/ragged.py); compressed-KV kernels (bench/kernels/kv_dtype.py a); int8 tier promotion
#   2  engine (bench/engine/engine_bench.py abcdeg): TTFT injected / full / question alone, the HF peer (StaticCache +
#      torch.compile), decode at batch 1, injection modes, decode over one shared 4k segment
#   3  engine arrivals (engine_bench.py f), serving steps (steps.py: warm-up, decode steps, shared burst),
#      tiers with bf16 pages (promotion, snapshot restore, TTFT by tier)
#   4  compilation cache cold vs warm, float32 precision vs HF, private 4k contexts in 40 GB of KV
#      (bf16 then int8 pages)
#   5  compressed-KV quality: train the small LM on 2048-token windows (bench/tools/train_small_lm.py, stopped
#      after 150 s of steps), then bench/kernels/kv_dtype.py sections b and c on it
#   6  serving at scale (the README's serving table): 8 segments of 4096 tokens, 64-token questions, 64 tokens,
#      C = 64 / 256 through HTTP (two API-server processes, clients in one process per 16) and in-process
#      (bench/serving/serve.py; the README's command)
#   7  where the served loop loses to the bare one: the engine loop's host time with no device
#      (bench/tools/host_loop.py, on this machine's CPU), the engine loop alone at C = 64 / 256
#      (bench/tools/profile_host.py --per-call), then HTTP at C = 256 with two API-server processes, and
#      in-process with a 0.5 ms GIL switch interval
#   8  the decode step's cascade with the merge in the suffix kernel (bench/kernels/cascade_groups.py, fused
#      against fm=0), the checkpoint read one tensor at a time and eight (bench/tools/weights_load.py), the
#      bare engine loop at C = 256 (profile_host.py --per-call)
#   9  startup: serve cold then warm with the executable store (INFERSCALE_EXE_STORE=1, loads on the compile
#      pool), then warm from JAX's cache alone (bench/tools/serve_ready.py), one compilation cache; then warm with the
#      store and the buckets' first runs in the warm-up (serve --first-runs now)
#  10  one request at a time: where the first token's time goes in serve (bench/tools/first_token_timeline.py),
#      then C = 1 / 16 through HTTP and in-process (bench/serving/serve.py, 32 requests)
#  11  multi-step decode (inferscale_jax/decode_loop.py): decode steps at 1 / 64 / 256 rows run 1, 4 and 8 to a loop
#      (bench/engine/steps.py --decode-steps 1,4,8), then C = 1 / 16 through HTTP and in-process with
#      --decode-steps 8 (compare part 10's C = 1 / 16)
#  12  the README's comparison of contexts: part 6's workload through HTTP at C = 64 / 256 with the 4k context
#      inline (the automatic prefix cache), then with no context (bench/serving/serve.py --context inline / none)
#  13  the first token under load, stretch by stretch (bench/tools/ttft_under_load.py, C = 256, two API-server
#      processes): over the model-free paced engine at 12 ms steps (this host's API path alone; then with four
#      API-server processes), then the 8B model (64-token prompts, no segment)
#  14  the closed loop's waves (bench/NOTES.md, run AM): the first token under load over part 6's segments, every
#      answer 64 tokens and then 64 +- 32 (ttft_under_load.py --segments 8), then part 6's served workload at C = 256
#      through HTTP with --max-tokens-spread 32
#  15  the paged kernels' loops with each tile's page slots computed in its own iteration against carried from the
#      one before (INFERSCALE_SLOT_PREFETCH=0 / 1): the decode step's cascade kernels at 64 / 256 rows over 1 / 8
#      segments with the shared part's stage counts (bench/kernels/cascade_groups.py), plain paged decode beside
#      them, then the engine's decode steps at 1 / 64 / 256 rows both ways (bench/engine/steps.py)
#  17  the mixed steps' cascade shared part by knob (bench/kernels/mixed_shared.py: the 2048-token cohort step and
#      the 512-token spread step over 8 segments, INFERSCALE_MIXED_SHARED variants against the engine's default)
#  18  the engine loop with a mixed-step variant of part 17 against the default: the bare loop at C = 256 over 8
#      segments (bench/tools/profile_host.py), answers of 64 and of 64 +- 32 tokens, each with
#      INFERSCALE_MIXED_SHARED="" and ="$VARIANT" (set VARIANT to part 17's winner, e.g. VARIANT=br=128,w=8,sp=1;
#      CONC=64 for the loop at C = 64)
#  19  the scheduler's round-down of a step's token budget to a bucket (inferscale_jax/scheduler.py,
#      INFERSCALE_ROUND_DOWN_MIN_TOKENS=256 / 0): the bare loop at C = 256 over 8 segments, answers of 64 +- 32
#      and of 64 tokens, on against off (bench/tools/profile_host.py)
#  20  where C = 64's small mixed steps go (bench/NOTES.md, run AP): the graph-mode profile of the loop at C = 64 with
#      answers of 64 +- 32 (bench/tools/profile_graph.py: the 64-row decode step and 128 / 256-token mixed steps) and at
#      C = 1 (a lone question's prefill step)
#  21  a step call's host time by argument count, and whether a stacked weight's per-layer slice costs a copy
#      (bench/tools/call_args.py: before stacking the weights and the cache into one array per kind), then the decode
#      step's cascade kernel at 64 / 256 rows over 8 segments by split count (cascade_groups.py --knobs sp=N)
#  22  the 8B's matmuls at 1 / 64 / 128 / 256 / 512 rows under XLA's GEMM flags: default against cuBLAS only, then at
#      64 rows against the exhaustive Triton tiling search (bench/kernels/gemm_flags.py)
#  23  HTTP at C = 64 with the clients spread over 4 benchmark processes, then also with 4 API-server processes, then
#      the clients in 1 process (part 6's): whether the client's own event loop or the API processes' per-request
#      work in the closed loop's waves holds C = 64's HTTP point (bench/NOTES.md, run AQ)
#  24  a mixed step's one-token rows through the decode step's cascade kernel (INFERSCALE_MIXED_DECODE=cascade) against
#      the ragged kernel and shared part (the default): the kernels' and the engine's checks of both on the GPU
#      (pytest), then the bare loop at C = 64 and 256 (CONCS) with answers of 64 +- 32 tokens, each mode
#  25  mixed steps' cascade group bucket: the most their rows can hold (the default) against the smallest warmed one
#      that holds their groups (INFERSCALE_MIXED_GROUPS=fit), the bare loop at C = 64 and 256 (CONCS), answers 64 +- 32
#  26  the mixed steps' ragged kernel (INFERSCALE_MIXED_RAGGED): the kernel's checks on the GPU (pytest) and its split-KV
#      forms alone (bench/kernels/ragged.py --sections 4), then
#      the bare loop at C = 64 and 256 with the default (sl: only the blocks that see the most keys split), sp=1
#      (unsplit), sl=0 (every block split)
#  27  the mixed steps' shared part against dense attention libraries on the same work (cuDNN, jax's Mosaic GPU
#      FlashAttention-3 kernel, plain XLA; bench/kernels/shared_ceiling.py): whether a Hopper kernel is worth writing
#  28  XLA's fusion flags (heroless priority fusion, the block-level rewriter; FUSION_FLAGS) against its defaults: the
#      graph-mode profile at C = 1 under each (bench/tools/profile_graph.py): kernels per step and the replayed step
#  29  the shared part's row blocks: the mixed steps' shared-part knobs (br=128 forms; cb / cw / cs, the chunks' own
#      launch) on the c64, spread, cohort and three-question c64q3 steps (bench/kernels/mixed_shared.py), then the
#      decode steps' cascade with 3 stages (bench/kernels/cascade_groups.py), by the GPU's kernel time
#  30  the mixed steps' merge of the shared part into the ragged kernel (INFERSCALE_MIXED_MERGE=kernel, the default,
#      against =jnp): the kernels' checks on the GPU (pytest), then the bare loop at C = 64 and 256 both ways
#  31  the session-39 defaults against the tree before them (.before/: 7f27466's inferscale_jax/ and pallas_kernels/,
#      carried): the bare loop at C = 64 and steps.py's decode steps both ways; then the normalised 16-bit shared
#      partials (INFERSCALE_SHARED_PARTIALS=q_dtype against fp32) by kernel (mixed_shared.py) and in the loop;
#      in one call each on a fresh machine: 31a (steps.py both ways, the partials by kernel), 31b (the loops both
#      ways), 31c (the partials in the loop)
#  32  a layer's glue (bench/kernels/glue.py): the residual add + RMSNorm after the o and down projections as XLA
#      runs them against one Pallas kernel (pallas_kernels/norm.py) by knob, and RoPE, at 64-2048 token rows
#  33  the qkv split + RoPE kernel in the engine (INFERSCALE_ROPE=pallas, the default since run AY) against XLA's
#      fusion (jnp): the glue kernels' checks on the GPU (pytest), then the bare loop at C = $CONCS (256) both ways
#  34  the skinny-matmul kernel (pallas_kernels/gemm.py) against XLA's dot: its checks on the GPU (pytest, with the
#      engine's tokens both ways), then the 8B's four projections at 1 / 64 / 128 rows by knob
#      (bench/kernels/skinny_gemm.py, each input set with its own weight copy: read from HBM as in a step)
#  35  the skinny-matmul kernel in the engine (INFERSCALE_MATMUL=pallas, the default since run BA, against xla): the bare loop at
#      C = $CONCS (64) both ways, then steps.py's decode steps with the kernel
#  36  which matrix instructions the kernels run (bench/tools/sass_check.py: HGMMA or HMMA in the SASS of the
#      512-token mixed step's attention, the skinny matmul, an XLA dot), then the skinny matmul at 16 / 32 rows
#  37  the skinny matmul at 1 and 8 rows with K split 2-8 ways (bench/kernels/skinny_gemm.py): whether more programs
#      than the column blocks bring a one-row step's projections nearer their read floor (run AZ: p2 took o and down
#      from 18.2 / 53.9 to 15.2 / 43.2 us at 1 row); then the ragged kernel's small (decode-row) tile by its keys per
#      step and stages (bench/kernels/ragged.py section 5: its shared memory bounds the programs an SM holds)
#  38  the engine loop with the ragged kernel's small tile at part 37's winner (VARIANT, an INFERSCALE_MIXED_RAGGED
#      value, e.g. VARIANT=sk=64) against the default: the bare loop at C = $CONCS (256) over 8 segments, answers
#      64 +- 32 (bench/tools/profile_host.py). Since b57a29b the default already runs 1 stage in these 512-token
#      steps: VARIANT=st=1 compares two equal setups, and VARIANT=sk=64 measures sk=64 at 1 stage against 1 stage
#  39  where the steps' time goes at the current code (bench/tools/profile_graph.py, graph mode): the bare loop at
#      C = 256 with answers of 64 +- 32 (the 512-token mixed step, run AW's capture), then C = 1 (the one-row decode step
#      against its 1.25x target: its kernels per step)
#  40  the decode steps against their floors at the current code: bench/engine/steps.py's decode section (1 / 64 / 256
#      rows, the README's device-step targets) and the graph-mode profile of the bare loop at C = 64 (its 64-row
#      decode step and its 128-token mixed step)
#  41  the shared part gathering its own queries (INFERSCALE_SHARED_Q=kernel: no packed copy of q, no gather
#      kernel) against the default: the mixed steps' attention by kernel (bench/kernels/mixed_shared.py: c64, spread,
#      c64q3), the bare loop at C = $CONCS (256), then the decode steps (steps.py --sections decode, each form)
#  42  the step's sampler by draw (bench/kernels/sampler.py: INFERSCALE_SAMPLER gumbel against cdf at 1 / 64 / 256
#      rows, greedy and sampled rows), then, with VARIANT=cdf, the bare loop at C = $CONCS (256) both ways
#  43  the paged decode kernel's occupancy (run BD: 12.5%, two programs an SM, bounded by its shared memory): the
#      decode steps at 1 / 64 / 256 rows (bench/engine/steps.py --sections decode) with INFERSCALE_DECODE unset and
#      each of DECODE_VARIANTS (default: st=1, bk=64, bk=64,st=1, w=2,st=1)
#  47  the cascade shared part's latency (run BE): more warps an SM (bench/tools/triton_check.py: w=8 doubles them),
#      on the mixed steps (bench/kernels/mixed_shared.py, the spread, c64q3 and cohort steps: VARIANTS, default
#      w=8, w=8,st=2, w=8,bk=32), then the decode steps at 1 / 64 / 256 rows with the decode steps' shared part at
#      its defaults and at INFERSCALE_DECODE_SHARED=$DECODE_VARIANT (default w=4, the form before run BF) (steps.py
#      --sections decode);
#      between them, the ragged kernel's one-token rows in a launch of their own at more blocks an SM (mixed_shared.py);
#      CONCS="64 256": the bare loop with the defaults, then INFERSCALE_DECODE_SHARED=$VARIANT (default w=4: the
#      decode steps' shared part before run BF made 8 warps its default on 32-row blocks)
#  48  part 47's bare-loop A/B alone (the decode steps' shared part at its default, then INFERSCALE_DECODE_SHARED=
#      ${VARIANT:-w=4}, at C = $CONCS, default 64 256): for a call that has no room for part 47's kernel sections
#  45  the one-token rows' kernels under Nsight Compute (memory throughput, L2 hits, occupancy achieved, warp
#      stalls; Firecracker hosts only, `uname -r` is written first): the paged decode kernel at 256 rows of ~112
#      keys (bench/tools/profile_decode.py), then the spread step's ragged kernel as the engine runs it (started from
#      the shared part's partials, `_i2`) and that step's cascade shared part, both as bench/tools/profile_mixed.py
#      launches them (mixed_shared.py crashed under ncu, runs BD and BE) (with the compute pipes,
#      instruction mix and source-line stalls; NCU_SKIP_DECODE=1 skips the decode kernel, profiled in run BD)
#  44  the ragged kernel's two tiles in launches of their own (INFERSCALE_MIXED_RAGGED=tl=1: each kernel one tile's
#      register budget; run BD: the small tile at 201 registers, two programs an SM) against one launch: the mixed
#      steps' attention by kernel (bench/kernels/mixed_shared.py: spread, c64, c64q3; checked against the engine's
#      output), then with CONCS set (e.g. 256) the bare loop both ways
#  16  the checkpoint read (models/loader.py: os.preadv into each tensor's array, threads in parallel): the 8B
#      checkpoint loaded one tensor at a time and eight (bench/tools/weights_load.py; run AL: 14.2 / 12.1 s)
# Parts 6-14, 16, 18-20, 23-26, 28, 30, 31, 33, 35, 38-42 write the 8B checkpoint to /tmp/llama8b first when it is missing (~35 s); it stays out of
# the repository, whose copy on the machine loses files that .gitignore does not cover (bench/NOTES.md, run AH).
#
# Each step writes its tables under RESULTS_DIR/<step>/ and its console log to RESULTS_DIR/<step>.log;
# after each step RESULTS_DIR is packed into TARBALL when given (what a cut call still returns).
set -uo pipefail
part=${1:?part 1-48}
res=${2:?results folder}
tarball=${3:-}
mkdir -p "$res"
res=$(cd "$res" && pwd)  # (absolute: part 31 runs steps from another folder)
[ -n "$tarball" ] && tarball=$(realpath -m "$tarball")
export PYTHONUNBUFFERED=1
export INFERSCALE_CACHE=${INFERSCALE_CACHE:-/tmp/inferscale-cache}

step() {  # step NAME SECONDS SCRIPT ARGS...  (the script's --out is RESULTS_DIR/NAME)
    local name=$1 limit=$2 script=$3
    shift 3
    step_as "$name" "$limit" "$script" "$@" --out "$res/$name"
}

step_as() {  # step_as NAME SECONDS SCRIPT ARGS...  (ARGS name the output themselves)
    local name=$1 limit=$2 script=$3
    shift 3
    echo "=== $name: python $script $* ($(date +%T), limit ${limit} s)"
    timeout "$limit" python3 "$script" "$@" > "$res/$name.log" 2>&1
    local rc=$?
    tail -n 25 "$res/$name.log"
    echo "=== $name rc=$rc ($(date +%T))"
    [ -n "$tarball" ] && tar czf "$tarball" -C "$res" .
    return 0
}

ckpt() {  # the 8B-shaped random checkpoint, once per machine
    # (its index is written last: a cut run leaves none, and the next part builds it again)
    [ -f /tmp/llama8b/model.safetensors.index.json ] || step_as checkpoint 60 bench/tools/make_checkpoint.py /tmp/llama8b
}

loops_ab() {  # loops_ab VAR PREFIX MODE...: the bare loop at C = $CONCS (64 256), answers 64 +- 32, with VAR=MODE each
    local var=$1 prefix=$2 conc mode
    shift 2
    for conc in ${CONCS:-64 256}; do
        for mode in "$@"; do  # (mode "default": the variable set empty)
            local tag=${mode//[=,]/_} value=$mode
            [ "$mode" = default ] && value=
            local name="loop_c${conc}_s32_$prefix${tag:-default}"
            (export "$var=$value"; step_as "$name" 240 bench/tools/profile_host.py --model /tmp/llama8b \
                --concurrency "$conc" --max-tokens-spread 32 --warm-steps 300 --steps 200 --no-profile --per-call \
                --out "$res/$name.md")
        done
    done
}

decode_shared_loops() {  # parts 47 (with CONCS) and 48: the bare loop with the decode steps' shared part at its
    ckpt                   # default, then at $VARIANT (default w=4: the form before run BF made 8 warps its default
    loops_ab INFERSCALE_DECODE_SHARED decode_shared_ default "${VARIANT:-w=4}"  # on 32-row blocks)
}

nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,memory.used --format=csv || true
case "$part" in
1)
    step kernels 220 bench/kernels/kernels.py --sections abcdef --decode-shapes 32x4096,32x32768,128x4096
    step ragged 150 bench/kernels/ragged.py
    step kv_dtype 110 bench/kernels/kv_dtype.py --sections a
    step tiers_int8 50 bench/engine/tier_moves.py --kv-dtype int8 --sections ab
    ;;
2)
    step engine 520 bench/engine/engine_bench.py --sections abcdeg --e-modes plain,cascade --e-batches 8,32,128
    ;;
3)
    step arrivals 200 bench/engine/engine_bench.py --sections f
    step steps 220 bench/engine/steps.py --sections warmup,decode,throughput
    step tiers 80 bench/engine/tier_moves.py
    ;;
4)
    step compile_cache 130 bench/engine/cold_warm_start.py
    step precision 90 bench/engine/precision.py
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 step private_bf16 100 bench/engine/engine_bench.py --sections e --e-modes private \
        --e-batches 32,64 --kv-budget-gb 40 --kv-dtype bfloat16
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 step private_int8 120 bench/engine/engine_bench.py --sections e --e-modes private \
        --e-batches 32,64,128 --kv-budget-gb 40 --kv-dtype int8
    ;;
5)
    # the checkpoint stays out of RESULTS_DIR (tens of MB); its summary comes back
    step_as small_lm 240 bench/tools/train_small_lm.py /tmp/small-lm --seq 2048 --batch 16 --steps 900 --max-seconds 150
    cp /tmp/small-lm/train.md "$res/small_lm_train.md" 2>/dev/null
    step quality 150 bench/kernels/kv_dtype.py --sections bc --model /tmp/small-lm
    ;;
6)
    ckpt
    serve=(bench/serving/serve.py --model /tmp/llama8b --tenants 1 --segments-per-tenant 8 --segment-tokens 4096
           --question-tokens 64 --max-tokens 64 --warm 1.0 --cold 0 --num-requests 1024)
    step serve 500 "${serve[@]}" --concurrency 64,256 --mode http,inproc --serve-args "--api-server-count 2"
    ;;
7)
    JAX_PLATFORMS=cpu step_as host_loop 60 bench/tools/host_loop.py --out "$res/host_loop.md"  # (the host alone)
    ckpt
    for c in 64 256; do
        step_as "loop_c$c" 120 bench/tools/profile_host.py --model /tmp/llama8b --concurrency $c --warm-steps 150 \
            --steps 100 --no-profile --per-call --out "$res/loop_c$c.md"
    done
    serve=(bench/serving/serve.py --model /tmp/llama8b --tenants 1 --segments-per-tenant 8 --segment-tokens 4096
           --question-tokens 64 --max-tokens 64 --warm 1.0 --cold 0 --num-requests 1024 --concurrency 256)
    step serve_api2 180 "${serve[@]}" --mode http --serve-args "--api-server-count 2"
    step serve_switch 100 "${serve[@]}" --mode inproc --switch-interval 0.0005
    ;;
8)
    step cascade 150 bench/kernels/cascade_groups.py --rows 64,256 --segments 1,8,64 --no-mixed --knobs fm=0
    ckpt
    step_as weights_load 120 bench/tools/weights_load.py --model /tmp/llama8b --workers 1,4,8 --repeat 1
    step_as loop_c256 150 bench/tools/profile_host.py --model /tmp/llama8b --concurrency 256 --warm-steps 150 \
        --steps 100 --no-profile --per-call --out "$res/loop_c256.md"
    ;;
9)
    ckpt
    INFERSCALE_CACHE=/tmp/isc-ready INFERSCALE_EXE_STORE=1 step_as ready_store 400 bench/tools/serve_ready.py --runs 2 \
        --out "$res/ready_store.md" -- --model /tmp/llama8b
    INFERSCALE_CACHE=/tmp/isc-ready INFERSCALE_EXE_STORE=0 step_as ready_jax 150 bench/tools/serve_ready.py --runs 1 \
        --out "$res/ready_jax.md" -- --model /tmp/llama8b
    # the buckets' first runs in the warm-up (serve --first-runs now) instead of in idle time: what it costs a start
    INFERSCALE_CACHE=/tmp/isc-ready INFERSCALE_EXE_STORE=1 step_as ready_first_runs_now 120 bench/tools/serve_ready.py \
        --runs 1 --out "$res/ready_first_runs_now.md" -- --model /tmp/llama8b --first-runs now
    ;;
10)
    ckpt
    step_as timeline 200 bench/tools/first_token_timeline.py --model /tmp/llama8b --requests 40 \
        --out "$res/first_token_timeline.md"
    serve=(bench/serving/serve.py --model /tmp/llama8b --tenants 1 --segments-per-tenant 8 --segment-tokens 4096
           --question-tokens 64 --max-tokens 64 --warm 1.0 --cold 0 --num-requests 32)
    step serve_c1_16 330 "${serve[@]}" --concurrency 1,16 --mode http,inproc
    ;;
11)
    step steps_loops 250 bench/engine/steps.py --sections decode --decode-steps 1,4,8
    ckpt
    serve=(bench/serving/serve.py --model /tmp/llama8b --tenants 1 --segments-per-tenant 8 --segment-tokens 4096
           --question-tokens 64 --max-tokens 64 --warm 1.0 --cold 0 --num-requests 32)
    step serve_c1_16_n8 300 "${serve[@]}" --concurrency 1,16 --mode http,inproc --serve-args "--decode-steps 8"
    ;;
12)
    ckpt
    serve=(bench/serving/serve.py --model /tmp/llama8b --tenants 1 --segments-per-tenant 8 --segment-tokens 4096
           --question-tokens 64 --max-tokens 64 --warm 1.0 --cold 0 --num-requests 1024 --concurrency 64,256
           --mode http --serve-args "--api-server-count 2")
    step serve_inline 280 "${serve[@]}" --context inline
    step serve_none 250 "${serve[@]}" --context none
    ;;
13)
    step_as ttft_load_paced 150 bench/tools/ttft_under_load.py --paced-step-ms 12 --concurrency 256 --seconds 40 \
        --out "$res/ttft_load_paced.md" -- --api-server-count 2
    step_as ttft_load_paced_api4 150 bench/tools/ttft_under_load.py --paced-step-ms 12 --concurrency 256 --seconds 40 \
        --out "$res/ttft_load_paced_api4.md" -- --api-server-count 4
    ckpt
    step_as ttft_load_8b 400 bench/tools/ttft_under_load.py --model /tmp/llama8b --concurrency 256 --seconds 60 \
        --out "$res/ttft_load_8b.md" -- --api-server-count 2
    ;;
14)
    ckpt
    load=(bench/tools/ttft_under_load.py --model /tmp/llama8b --concurrency 256 --seconds 30 --segments 8
          --segment-tokens 4096)
    step_as ttft_load_seg 170 "${load[@]}" --out "$res/ttft_load_seg.md" -- --api-server-count 2
    step_as ttft_load_seg_spread 170 "${load[@]}" --max-tokens-spread 32 --out "$res/ttft_load_seg_spread.md" \
        -- --api-server-count 2
    serve=(bench/serving/serve.py --model /tmp/llama8b --tenants 1 --segments-per-tenant 8 --segment-tokens 4096
           --question-tokens 64 --max-tokens 64 --warm 1.0 --cold 0 --num-requests 1024 --concurrency 256
           --mode http --serve-args "--api-server-count 2")
    step serve_spread 240 "${serve[@]}" --max-tokens-spread 32
    ;;
16)
    ckpt
    step_as weights_load 150 bench/tools/weights_load.py --model /tmp/llama8b --workers 1,8 --repeat 1
    ;;
17)
    step mixed_shared 300 bench/kernels/mixed_shared.py
    ;;
18)
    : "${VARIANT:?set VARIANT to an INFERSCALE_MIXED_SHARED value, the winner of part 17}"
    ckpt
    for spread in 0 32; do
        for v in "" "$VARIANT"; do
            name="loop_c${CONC:-256}_s${spread}_${v:-default}"
            INFERSCALE_MIXED_SHARED="$v" step_as "${name//[=,]/_}" 140 bench/tools/profile_host.py --model /tmp/llama8b \
                --concurrency "${CONC:-256}" --max-tokens-spread "$spread" --warm-steps 300 --steps 200 --no-profile --per-call \
                --out "$res/${name//[=,]/_}.md"
        done
    done
    ;;
19)
    # the scheduler's round-down of a step's token budget (scheduler.py, session 31): the bare loop at C = 256,
    # equal and spread answer lengths, on (the default, 256) against off (0); then the served table with it on
    ckpt
    for spread in 32 0; do
        for rd in 256 0; do
            INFERSCALE_ROUND_DOWN_MIN_TOKENS=$rd step_as "loop_s${spread}_rd${rd}" 200 bench/tools/profile_host.py \
                --model /tmp/llama8b --concurrency 256 --max-tokens-spread "$spread" --warm-steps 300 --steps 200 \
                --no-profile --per-call --out "$res/loop_s${spread}_rd${rd}.md"
        done
    done
    ;;
20)
    ckpt
    XLA_FLAGS="${XLA_FLAGS:-} --xla_enable_command_buffers_during_profiling=true" step_as profile_graph_c64 330 \
        bench/tools/profile_graph.py --model /tmp/llama8b --concurrency 64 --max-tokens-spread 32 --warm-steps 200 \
        --mixed-captures 3 --decode-reps 4 --mixed-reps 4 --raw /tmp/pg_c64 --out "$res/profile_graph_c64.md"
    # C = 1: the mixed step is a lone question's prefill (its device time is most of C = 1's TTFT)
    XLA_FLAGS="${XLA_FLAGS:-} --xla_enable_command_buffers_during_profiling=true" step_as profile_graph_c1 150 \
        bench/tools/profile_graph.py --model /tmp/llama8b --concurrency 1 --warm-steps 20 --mixed-captures 1 \
        --decode-reps 4 --mixed-reps 4 --loop-steps 8 --raw /tmp/pg_c1 --out "$res/profile_graph_c1.md"
    ;;
22)
    # (the exhaustive search autotunes ~20 s per shape and row count: 64 rows alone, with a longer limit)
    step gemm_flags 240 bench/kernels/gemm_flags.py --sets default,cublas --child-timeout 110
    step_as gemm_exhaustive 340 bench/kernels/gemm_flags.py --sets default,exhaustive --rows 64 --child-timeout 300 \
        --out "$res/gemm_exhaustive"
    ;;
23)
    ckpt
    serve=(bench/serving/serve.py --model /tmp/llama8b --tenants 1 --segments-per-tenant 8 --segment-tokens 4096
           --question-tokens 64 --max-tokens 64 --warm 1.0 --cold 0 --num-requests 1024 --concurrency 64 --mode http)
    for ka in 4,2 4,4 1,2; do  # client processes, API-server processes (the first start compiles: ~100 s)
        k=${ka%,*} a=${ka#*,}
        step "serve_c64_procs${k}_api$a" 300 "${serve[@]}" --client-procs $k --serve-args "--api-server-count $a"
    done
    ;;
24)
    # a mixed step's one-token rows through the decode step's cascade kernel (INFERSCALE_MIXED_DECODE=cascade)
    # against the ragged kernel + shared part (the default): the kernels' checks on the GPU first, then the
    # bare loop at C = 64 and 256 with spread answers (most steps mixed)
    step_as mixed_decode_tests 240 -m pytest -q -p no:cacheprovider tests/kernels/test_kernels_mixed_cascade.py \
        tests/core/test_scheduler.py -k "decode_cascade or mixed_steps_run or questions_chunks or mixed_step"
    ckpt
    loops_ab INFERSCALE_MIXED_DECODE "" ragged cascade
    ;;
25)
    # mixed steps' group bucket: the most their rows can hold (max, the default) against the smallest warmed one that
    # holds their groups (INFERSCALE_MIXED_GROUPS=fit: 16 for the served workload's 8 segments): the bare loop at
    # C = 64 and 256 with spread answers (most steps mixed)
    ckpt
    loops_ab INFERSCALE_MIXED_GROUPS groups_ max fit
    ;;
26)
    # the mixed steps' ragged kernel (INFERSCALE_MIXED_RAGGED): the default (only the blocks that see the most keys
    # split), unsplit (sp=1), every block split (sl=0: split-KV from the fewest programs a step's work can make,
    # 4 ways at 128 tokens); the bare loop at C = 64 and 256, answers 64 +- 32 (C = 256 is unsplit by both)
    # (the kernel's checks only: the scheduler's engine tests compile for minutes on the GPU, run AT)
    [ -n "${SKIP_TESTS:-}" ] || step_as ragged_tests 300 -m pytest -q -p no:cacheprovider \
        tests/kernels/test_kernels_ragged.py -k "split_forms or split_longest or split_plan or kernel_matches_ref or lse_matches"
    # the kernel alone on the steps that matter: the C = 64 mixed step, a long chunk beside it, a lone question
    [ -n "${SKIP_TESTS:-}" ] || step ragged_splits 150 bench/kernels/ragged.py --sections 4
    ckpt
    loops_ab INFERSCALE_MIXED_RAGGED ragged_ ${MODES:-default sp=1 sl=0}
    ;;
27)
    step shared_ceiling 240 bench/kernels/shared_ceiling.py
    ;;
28)
    # XLA's own fusion flags against its defaults: the graph-mode profile of C = 1's steps under each (kernels per
    # step, the step's replayed time); FUSION_FLAGS names boolean flags, bare (no "--", no "=value"; each is set
    # true), space-separated, "-" for none; CONC the concurrency (1: the decode step of the C = 1 ITL target; 64:
    # also its mixed steps)
    ckpt
    conc=${CONC:-1}
    for f in ${FUSION_FLAGS:-- xla_gpu_experimental_enable_triton_heroless_priority_fusion \
            xla_gpu_experimental_enable_fusion_block_level_rewriter}; do
        flag=; [ "$f" = - ] || flag="--$f=true"
        tag=${f#xla_gpu_}; tag=${tag//experimental_/}; tag=${tag#enable_}; [ "$f" = - ] && tag=default
        XLA_FLAGS="${XLA_FLAGS:-} --xla_enable_command_buffers_during_profiling=true $flag" step_as \
            "fusion_c${conc}_$tag" 150 bench/tools/profile_graph.py --model /tmp/llama8b --concurrency "$conc" \
            --max-tokens-spread 32 --warm-steps 20 --mixed-captures 1 --decode-reps 4 --mixed-reps 4 --loop-steps 8 \
            --raw "/tmp/pg_fusion_$tag" --out "$res/fusion_c${conc}_$tag.md"
    done
    ;;
29)
    # the shared part's row blocks by kind of row (bench/NOTES.md, run AW 5 and the plan after session 38): the mixed
    # steps' shared-part knobs on four steps, then the decode steps' cascade with 3 stages, both by the device column
    step mixed_blocks 300 bench/kernels/mixed_shared.py --steps c64,spread,cohort,c64q3 --variants br=128 br=128,w=8 \
        br=128,w=8,st=2 cb=128,cw=8 cb=128,cw=8,cs=4 cb=128,cw=8,cs=8 sp=3 st=2
    step cascade_stages 150 bench/kernels/cascade_groups.py --rows 64,256 --segments 8 --no-mixed --knobs st=3 \
        st=3,sp=2
    ;;
30)
    # the mixed steps' shared/ragged merge inside the ragged kernel (its init partials, the default) against the jnp
    # merge after it (INFERSCALE_MIXED_MERGE=jnp): the kernels' checks on the GPU first, then the bare loop at C = 64
    # and 256 with spread answers (most steps mixed)
    step_as mixed_merge_tests 200 -m pytest -q -x -p no:cacheprovider tests/kernels/test_kernels_ragged_init.py \
        tests/kernels/test_kernels_mixed_cascade.py
    ckpt
    loops_ab INFERSCALE_MIXED_MERGE merge_ kernel jnp
    ;;
31|31a|31b|31c)
    # the session-39 defaults (3 splits for 256-511-token mixed steps, the decode cascade's 3 stages and 2 splits
    # from 256 rows) against the tree before them, then the normalised 16-bit shared partials (bench/NOTES.md, the
    # plan after session 39).  The "before" tree: inferscale_jax/ and pallas_kernels/ of 7f27466 in .before/, made
    # here by `mkdir .before && git archive 7f27466 inferscale_jax pallas_kernels | tar -x -C .before` (ignored,
    # carried); the device's copy has no .git.  The scripts put their own root first on sys.path, so the before
    # run is a copy of this tree with those two folders replaced.  The whole part outlasts one call on a fresh
    # machine: 31a is the decode steps both ways and the partials by kernel, 31b the loops both ways, 31c the
    # partials in the loop.
    before=${BEFORE:-.before}
    if [ "$part" != 31c ] && { [ ! -d "$before/inferscale_jax" ] || [ ! -d "$before/pallas_kernels" ]; }; then
        echo "no $before tree (part 31's comment)"; exit 2
    fi
    ckpt
    old=/tmp/before_tree
    if [ "$part" != 31c ]; then
        rm -rf "$old" && mkdir -p "$old/bench"
        for x in *; do [ "$x" = bench ] || cp -r "$x" "$old/"; done
        for x in bench/*; do [ "$x" = bench/results ] || cp -r "$x" "$old/bench/"; done
        rm -rf "$old/inferscale_jax" "$old/pallas_kernels" && cp -r "$before/inferscale_jax" "$before/pallas_kernels" "$old/"
    fi
    if [ "$part" = 31 ] || [ "$part" = 31a ]; then
        step steps_after 200 bench/engine/steps.py --sections decode
        (cd "$old" && step_as steps_before 200 bench/engine/steps.py --sections decode --out "$res/steps_before")
        for mode in fp32 q_dtype; do
            INFERSCALE_SHARED_PARTIALS=$mode step mixed_partials_$mode 120 bench/kernels/mixed_shared.py \
                --steps c64,spread,c64q3 --variants
        done
    fi
    if [ "$part" = 31 ] || [ "$part" = 31b ]; then
        loop=(--model /tmp/llama8b --concurrency 64 --max-tokens-spread 32 --warm-steps 300 --steps 200 --no-profile
              --per-call)
        step_as loop_c64_s32_after 240 bench/tools/profile_host.py "${loop[@]}" --out "$res/loop_c64_s32_after.md"
        (cd "$old" && step_as loop_c64_s32_before 240 bench/tools/profile_host.py "${loop[@]}" \
            --out "$res/loop_c64_s32_before.md")
    fi
    if [ "$part" = 31 ] || [ "$part" = 31c ]; then
        loops_ab INFERSCALE_SHARED_PARTIALS partials_ fp32 q_dtype
    fi
    ;;
32)
    step glue 150 bench/kernels/glue.py
    ;;
33)
    step_as glue_checks 150 -m pytest -q -p no:cacheprovider tests/kernels/test_kernels_rope.py \
        tests/kernels/test_kernels_norm.py
    ckpt
    CONCS=${CONCS:-256} loops_ab INFERSCALE_ROPE rope_ pallas jnp
    ;;
36)
    step sass_check 150 bench/tools/sass_check.py
    step skinny_gemm_16_32 200 bench/kernels/skinny_gemm.py --rows 16,32 --variants default n64,k128,s4 \
        n64,k128,s4,p2 n32,k256,s3 n128,k64,s4
    ;;
37)
    step skinny_gemm_1_8 300 bench/kernels/skinny_gemm.py --rows 1,8 --variants n64,k128,s4,p2 n64,k128,s4,p4 \
        n64,k128,s4,p8 n64,k128,s4,p4,w8 n128,k128,s3,p4 n64,k256,s3,p4 n32,k128,s4,p4 n128,k64,s4,p2 n32,k128,s4,p8
    step ragged_small 240 bench/kernels/ragged.py --sections 5
    ;;
39)
    ckpt
    XLA_FLAGS="${XLA_FLAGS:-} --xla_enable_command_buffers_during_profiling=true" step_as profile_graph_c256 330 \
        bench/tools/profile_graph.py --model /tmp/llama8b --concurrency 256 --max-tokens-spread 32 --warm-steps 300 \
        --mixed-captures 2 --decode-reps 4 --mixed-reps 4 --loop-steps 8 --raw /tmp/pg_c256 \
        --out "$res/profile_graph_c256.md"
    XLA_FLAGS="${XLA_FLAGS:-} --xla_enable_command_buffers_during_profiling=true" step_as profile_graph_c1 150 \
        bench/tools/profile_graph.py --model /tmp/llama8b --concurrency 1 --warm-steps 20 --mixed-captures 1 \
        --decode-reps 4 --mixed-reps 4 --loop-steps 8 --raw /tmp/pg_c1 --out "$res/profile_graph_c1.md"
    ;;
47)
    step mixed_shared_warps 300 bench/kernels/mixed_shared.py --steps spread,c64q3,cohort \
        --variants ${VARIANTS:-w=8 w=8,st=2 w=8,bk=32}
    # the ragged kernel's one-token rows in a launch of their own at more blocks an SM (triton_check.py: the small
    # tile's own kernel holds 2 blocks at 1 stage, 3 at st=2,sk=64, 4 at st=3,sk=32; run BD timed tl=1 alone)
    step mixed_ragged_small 200 bench/kernels/mixed_shared.py --steps spread,c64q3 --variants \
        INFERSCALE_MIXED_RAGGED=tl=1 INFERSCALE_MIXED_RAGGED=tl=1,st=2,sk=64 INFERSCALE_MIXED_RAGGED=tl=1,st=3,sk=32
    step steps_decode 150 bench/engine/steps.py --sections decode
    INFERSCALE_DECODE_SHARED=${DECODE_VARIANT:-w=4} step steps_decode_shared_variant 150 bench/engine/steps.py \
        --sections decode  # (run BF timed w=8 here, against the 4 warps then the default)
    if [ -n "${CONCS:-}" ]; then decode_shared_loops; fi
    ;;
48)
    decode_shared_loops
    ;;
45)
    uname -r > "$res/uname.txt"
    sections=(--section SpeedOfLight --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables
              --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats
              --section ComputeWorkloadAnalysis --section InstructionStats --section SourceCounters)
    ncu_kernel() {  # ncu_kernel NAME REGEX SKIP SECONDS SCRIPT ARGS...: two launches' details as text
        local name=$1 regex=$2 skip=$3 limit=$4
        shift 4
        echo "=== ncu $name: $* ($(date +%T), limit ${limit} s)"
        # (XLA's command buffers off: the kernels run one by one, as ncu replays them; then no process of the
        # profiled run may keep the GPU's memory: run BE's first try left one holding 79 GB after a crash)
        XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=" timeout "$limit" ncu --clock-control none --kernel-name "regex:$regex" --launch-skip "$skip" --launch-count 2 \
            "${sections[@]}" -f -o "/tmp/ncu_$name" python3 "$@" > "$res/ncu_$name.log" 2>&1
        echo "=== ncu $name rc=$? ($(date +%T))"
        pkill -9 -f "$1" 2> /dev/null; sleep 1
        nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader
        ncu --import "/tmp/ncu_$name.ncu-rep" --page details --print-details all > "$res/ncu_$name.txt" 2>&1
        grep -E "Duration|Memory Throughput|DRAM Throughput|L2 Hit|Achieved Occupancy|Theoretical Occupancy|Registers|Compute \(SM\) Throughput|Issue Slots Busy" \
            "$res/ncu_$name.txt" | head -n 24
        [ -n "$tarball" ] && tar czf "$tarball" -C "$res" .
    }
    [ -z "${NCU_SKIP_DECODE:-}" ] && ncu_kernel decode paged_decode 1 150 bench/tools/profile_decode.py --batch 256 --ctx 112
    # (bench/tools/profile_mixed.py: the engine's attention call alone; mixed_shared.py crashed under ncu, run BE)
    ncu_kernel shared "cascade_shared" 1 200 bench/tools/profile_mixed.py --step spread
    if [ ! -s "/tmp/ncu_shared.ncu-rep" ]; then  # (a crash: once more with the basic sections only)
        sections=(--section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats)
        ncu_kernel shared_basic "cascade_shared" 1 200 bench/tools/profile_mixed.py --step spread
    fi
    ncu_kernel ragged "ragged_paged_attention.*_i2" 1 200 bench/tools/profile_mixed.py --step spread
    ;;
44)
    step mixed_ragged_tl 200 bench/kernels/mixed_shared.py --steps spread,c64,c64q3 \
        --variants INFERSCALE_MIXED_RAGGED=tl=1
    if [ -n "${CONCS:-}" ]; then
        ckpt
        loops_ab INFERSCALE_MIXED_RAGGED ragged_ default tl=1
    fi
    ;;
43)
    for v in "" ${DECODE_VARIANTS:-st=1 bk=64 bk=64,st=1 w=2,st=1}; do
        tag=${v//[=,]/_}
        INFERSCALE_DECODE=$v step "steps_decode_${tag:-default}" 150 bench/engine/steps.py --sections decode
    done
    ;;
42)
    step sampler 150 bench/kernels/sampler.py
    if [ -n "${VARIANT:-}" ]; then
        ckpt
        CONCS=${CONCS:-256} loops_ab INFERSCALE_SAMPLER sampler_ gumbel "$VARIANT"
    fi
    ;;
41)
    step mixed_shared_q 200 bench/kernels/mixed_shared.py --steps c64,spread,c64q3 \
        --variants INFERSCALE_SHARED_Q=kernel
    ckpt
    CONCS=${CONCS:-256} loops_ab INFERSCALE_SHARED_Q sharedq_ gather kernel
    step steps_decode_gather 200 bench/engine/steps.py --sections decode
    INFERSCALE_SHARED_Q=kernel step steps_decode_qk 200 bench/engine/steps.py --sections decode
    ;;
40)
    ckpt
    step steps_decode 200 bench/engine/steps.py --sections decode
    XLA_FLAGS="${XLA_FLAGS:-} --xla_enable_command_buffers_during_profiling=true" step_as profile_graph_c64 300 \
        bench/tools/profile_graph.py --model /tmp/llama8b --concurrency 64 --max-tokens-spread 32 --warm-steps 150 \
        --mixed-captures 1 --decode-reps 4 --mixed-reps 4 --loop-steps 8 --raw /tmp/pg_c64 \
        --out "$res/profile_graph_c64.md"
    ;;
38)
    : "${VARIANT:?set VARIANT to an INFERSCALE_MIXED_RAGGED value, the winner of part 37 (e.g. sk=64)}"
    ckpt
    CONCS=${CONCS:-256} loops_ab INFERSCALE_MIXED_RAGGED ragged_ default "$VARIANT"
    ;;
34)
    step_as gemm_checks 150 -m pytest -q -p no:cacheprovider tests/kernels/test_kernels_gemm.py
    step skinny_gemm 330 bench/kernels/skinny_gemm.py --rows 1,64,128 --variants default n64,k128,s4 n64,k64,s5 \
        n32,k256,s3 n64,k128,s4,p2 n128,k64,s4
    ;;
35)
    ckpt
    CONCS=${CONCS:-64} loops_ab INFERSCALE_MATMUL matmul_ pallas xla
    INFERSCALE_MATMUL=pallas step steps_matmul_pallas 200 bench/engine/steps.py --sections decode
    ;;
21)
    step call_args 150 bench/tools/call_args.py
    step cascade_splits 150 bench/kernels/cascade_groups.py --rows 64,256 --segments 8 --no-mixed \
        --knobs sp=1 sp=2 sp=4 sp=6
    ;;
15)
    kern=(bench/kernels/cascade_groups.py --rows 64,256 --segments 1,8 --no-mixed)
    INFERSCALE_SLOT_PREFETCH=1 step cascade_pf1 200 "${kern[@]}" --knobs st=3 pf=0 pf=0,st=3 pf=0,st=4 \
        pf=0,st=3,sp=4 pf=0,st=3,w=8
    INFERSCALE_SLOT_PREFETCH=0 step cascade_pf0 150 "${kern[@]}" --knobs st=3 pf=1
    INFERSCALE_SLOT_PREFETCH=1 step steps_pf1 130 bench/engine/steps.py --sections decode
    INFERSCALE_SLOT_PREFETCH=0 step steps_pf0 130 bench/engine/steps.py --sections decode
    ;;
*)
    echo "unknown part $part" >&2
    exit 2
    ;;
esac
