#!/usr/bin/env bash
# One device session's GPU work, detached so it outlives the 10-minute call that starts it
# (the device tool kills a call's processes when it returns, except a new process session, which
# lives until the machine goes back). Later calls only watch and bring back what is done.
#
#   lab/gpu_session.sh start COMMIT BUDGET_S [PHASES]   copy this tree to /var/tmp/flash-repo,
#                                 launch the phases (setsid), return at once
#   lab/gpu_session.sh watch SECONDS   progress every 20 s; copies the results so far to $OUT
#                                 (every minute, and at the end); returns after SECONDS or once
#                                 every phase ended
#   lab/gpu_session.sh jit        pack the JIT caches as they are now and return them in $OUT:
#                                 a session whose device time ends with its last phase never gets
#                                 the end-of-phases pack (2026-12-05); call it once the first
#                                 servers have booted
#
# Needs the vLLM payload installed (python3 -m lab.device_payload install, lab/README.md). Phases, run
# in the order PHASES lists them (`none`: only restore the JIT caches), each skipped when the budget
# left is shorter than it needs (said in phases.log):
#   e2e      tests/run gpu-e2e, every scenario but diag_ple_ids (E2E_K overrides the -k): a/b/c-default
#            alone first (kv_plan), then the others with fixed KV pools in waves of
#            FLASH_E2E_BOOT_WAVE (default 4); its deadline is what the phases after it leave (e2e_deadline)
#   decode8  lab/bench_decode.py matrix, 8 of the 48 layers (real per-layer shapes, dummy weights)
#   kernels  lab/bench_step_kernels.py (draft head, QSA top-k, copy bandwidth, PLE staging) + tests/gpu
#   decode4  the same matrix at 4 layers (two layer counts: the line read at 48 layers)
#   sidegemm lab/bench_side_gemm.py: the side layers' GEMMs, BF16 against FP8 block-scaled (vLLM's
#            own pick and CUTLASS, then DeepGEMM/Triton/FlashInfer, which JIT-compile, in a second run)
#   recipe48 lab/bench_recipe.py run: all 48 layers, NVFP4 experts, the servers `flash serve`
#            renders (RECIPE_CONFIGS, default stock,default,nvidia) in blocks of whole servers until
#            the budget's end; RECIPE_ARGS adds options (e.g. --repeats 3); RECIPE_LAYERS (default 48)
#            fewer layers of the same shapes, for a GPU that cannot hold 48
#   latency48 lab/bench_latency.py run on the same dirs: prefix-cache hits and TTFT for shared
#            prefixes of 1k-16k tokens, ITL of a stream while a 32k-token prefill runs
#            (LATENCY_CONFIGS, default stock,default,shared; LATENCY_ARGS adds options)
#   profile48 lab/bench_profile.py run on the same dirs: vLLM's torch profiler around a stream with a
#            prompt's pieces beside it, decode steps and a lone prompt, read into each step class's
#            kernels and host time (PROFILE_CONFIGS, default stock,default,shared-25; PROFILE_ARGS)
#            (both: DECODE_REPEATS, default 3; DECODE_TOKENS per request, 256; DECODE_SECONDS each
#            may take, its boot included, 420; DECODE_CONFIGS, default stock,eager,hoisted: fewer
#            servers give the rest more pairs in the same seconds; hoisted-dedup256 is opt-in)
# Results: /var/tmp/gs (phases.log, e2e/, decode/, kernels/). PHASES: a comma list, default
# e2e,decode8,kernels,decode4.
#
# JIT caches travel between sessions: every device session starts on a fresh machine, and the
# first boots spend minutes compiling Triton kernels and autotuning FlashInfer (run37: `init engine`
# 197 s cold vs 23 s warm). They are packed once e2e ends and again when every phase has, and the
# next `watch` puts the newest pack as $OUT/jit-cache.tar.gz.NN parts of 15 MiB, once
# (FLASH_SESSION_JIT_DIRS under $HOME, when no bigger than FLASH_SESSION_JIT_MAX_MIB, default 45);
# keep it as .payload/jit-cache-RELEASE.tar.gz here and carry it in a call before `start`, which unpacks it.
set -uo pipefail

# (the FLASH_SESSION_* overrides exist for the CPU rehearsal, tests/unit/test_gpu_session.py)
GS=${FLASH_SESSION_DIR:-/var/tmp/gs}
REPO=${FLASH_SESSION_REPO:-/var/tmp/flash-repo}
ENV_SH=${FLASH_E2E_VLLM_ENV:-/var/tmp/flash-vllm-0.33.0/env.sh}
BENCH=${FLASH_SESSION_BENCH:-/var/tmp/bench-decode}
ROWS=${FLASH_SESSION_PLE_ROWS:-32000000}  # the reduced PLE table (4.8 GiB; real width and heads)
# the decode matrices: repeats, tokens per request, and the seconds each may measure for
DECODE_REPEATS=${DECODE_REPEATS:-3} DECODE_TOKENS=${DECODE_TOKENS:-256} DECODE_SECONDS=${DECODE_SECONDS:-420}
DECODE_CONFIGS=${DECODE_CONFIGS:-stock,eager,hoisted}
RECIPE_CONFIGS=${RECIPE_CONFIGS:-stock,default,nvidia} RECIPE_ARGS=${RECIPE_ARGS:-}
# recipe48/latency48's layer count: 48, the real model; an 80 GB H100 cannot hold 48 and ran 32
# (RECIPE_LAYERS=32 RECIPE_ARGS="--set GPU_MEM=0.95 ...": benchmarks/recipe48-h200 run3)
RECIPE_LAYERS=${RECIPE_LAYERS:-48}
LATENCY_CONFIGS=${LATENCY_CONFIGS:-stock,default,shared} LATENCY_ARGS=${LATENCY_ARGS:-}
PROFILE_CONFIGS=${PROFILE_CONFIGS:-stock,default,shared-25} PROFILE_ARGS=${PROFILE_ARGS:-}

JIT_DIRS=${FLASH_SESSION_JIT_DIRS:-.triton/cache .cache/flashinfer .cache/vllm}  # relative to $HOME
JIT_MAX_MIB=${FLASH_SESSION_JIT_MAX_MIB:-45}  # 3 returned parts of 15 MiB beside gs.tar.gz
REL=$(basename "$(dirname "$ENV_SH")"); REL=${REL#flash-vllm-}  # the payload's release, e.g. 0.29.0
# carried into the checkout; one per release (another Triton's kernels would only be dead weight)
JIT_CARRIED=${FLASH_SESSION_JIT_TAR:-.payload/jit-cache-$REL.tar.gz}

# the tree this script belongs to (lab/..): `start` checks its settings with the tree's own modules,
# importable without a project venv once its src/ is on PYTHONPATH
TREE=$(cd "$(dirname "$0")/.." && pwd)

log() { echo "$(date -u +%H:%M:%S) $*" | tee -a "$GS/phases.log"; }

# the JIT caches this machine built, as one archive for the next session (or their sizes, if too big)
jit_pack() {
  local out=$1 have=() d kib
  for d in $JIT_DIRS; do [ -d "$HOME/$d" ] && have+=("$d"); done
  [ ${#have[@]} -gt 0 ] || { log "jit caches: none of $JIT_DIRS under $HOME"; return 0; }
  log "jit caches: $(cd "$HOME" && du -sk "${have[@]}" | awk '{printf "%s %d MiB; ", $2, $1/1024}')"
  tar czf "$out.part" -C "$HOME" "${have[@]}" 2>/dev/null
  kib=$(du -k "$out.part" | cut -f1)
  if [ "$kib" -gt $(( JIT_MAX_MIB * 1024 )) ]; then
    rm -f "$out.part"; log "jit caches: $(( kib / 1024 )) MiB packed, over ${JIT_MAX_MIB} MiB: not returned"
  else
    mv "$out.part" "$out"; log "jit caches: $(basename "$out") $(( kib / 1024 )) MiB (carry it as $JIT_CARRIED)"
  fi
}
left() { echo $(( $(cat "$GS/end") - $(date +%s) )); }

# seconds each phase needs to be started at all (kernels: the bench's 120 s cap + the GPU tests)
need() { case "$1" in e2e) echo 420 ;; decode8) echo 300 ;; kernels) echo 160 ;; decode4) echo 280 ;; sidegemm) echo 240 ;; recipe48) echo 600 ;; latency48) echo 500 ;; profile48) echo 500 ;; *) echo 0 ;; esac; }
# the least a phase is started with (need() is what the phases before it leave for it): e2e can
# prove something in 240 s (one tiny server, cold: fixtures ~50 s + boot ~190 s); 2026-12-05 a
# 310 s e2e-only session was skipped whole by need()'s 420 s; recipe48 skips the configs that
# do not fit by itself; latency48 measures its servers one after another and keeps each one's rows
# (the 32-layer dir ~16 s, a boot on the carried JIT pack 94-132 s, `--itl-only` ~30 s: one server in
# 220 s; a cold boot takes ~100 s more; 500 is three); profile48 likewise, one server and its four
# scenarios (~60 s, the traces' writing included: an estimate, no run yet) in 220 s
floor() { case "$1" in e2e) echo 240 ;; recipe48) echo 300 ;; latency48|profile48) echo 220 ;; *) need "$1" ;; esac; }

# the e2e tier's deadline: what the budget leaves once the phases asked after it have what they
# need (run37: a fixed 900 s cut 14 wave servers short while 644 s went to later phases), at most
# FLASH_SESSION_E2E_MAX; when that is under 420 s, e2e takes all but 30 s and the later ones skip
e2e_deadline() {
  local after=0 seen="" p d
  for p in ${PHASES//,/ }; do
    [ -n "$seen" ] && after=$(( after + $(need "$p") ))
    [ "$p" = e2e ] && seen=1
  done
  d=$(( $(left) - after - 30 ))
  [ "$d" -lt 420 ] && d=$(( $(left) - 30 ))
  [ "$d" -gt "${FLASH_SESSION_E2E_MAX:-1200}" ] && d=${FLASH_SESSION_E2E_MAX:-1200}
  log "e2e deadline $d s ($after s kept for the phases after it)" >&2
  echo "$d"
}

# name, seconds it needs, command...: run it unless the budget left is too short
phase() {
  local name=$1 need=$2; shift 2
  case ",${PHASES}," in *",$name,"*) ;; *) log "skip $name (not asked)"; return 0 ;; esac
  if [ "$(left)" -lt "$need" ]; then log "skip $name: $(left) s left, needs $need"; return 0; fi
  log "start $name ($(left) s left)"
  "$@" >"$GS/$name.log" 2>&1
  log "end $name rc=$?"
}

# layers, seconds it needs, first port: lab/bench_decode.py's matrix on that layer count
decode_phase() {
  phase "decode$1" "$2" python3 -m lab.bench_decode matrix "$BENCH/L$1" --port "$3" \
    --out "$GS/decode/raw.jsonl" --logs "$GS/decode" --repeats "$DECODE_REPEATS" --tokens "$DECODE_TOKENS" --configs "$DECODE_CONFIGS" \
    --deadline $(( $(left) - 20 < DECODE_SECONDS ? $(left) - 20 : DECODE_SECONDS ))
}

run_phases() {
  cd "$REPO" || exit 1
  set -a; . "$ENV_SH"; set +a
  # the device has no project venv: the lab modules import flash_* from this tree's src/
  export PYTHONPATH="$REPO/src${PYTHONPATH:+:$PYTHONPATH}"
  export PYTHONUNBUFFERED=1 FLASH_E2E_VLLM_ENV="$ENV_SH" FLASH_E2E_COMMIT="$COMMIT"
  # bench model dirs: written beside the e2e boots (disk and CPU only); one table for both counts;
  # only when a decode phase is asked (the table is 4.8 GiB)
  local prep="" prep48=""
  case ",${PHASES}," in *,decode8,*|*,decode4,*)
    ( mkdir -p "$BENCH/L4" && ln -sfn "$BENCH/L8/ple" "$BENCH/L4/ple" &&
      nice -n 5 python3 -m lab.bench_decode prepare "$BENCH/L8" --quant fp8 --ple-rows "$ROWS" --layers 8 &&
      nice -n 5 python3 -m lab.bench_decode prepare "$BENCH/L4" --quant fp8 --ple-rows "$ROWS" --layers 4
    ) >"$GS/prepare.log" 2>&1 &
    prep=$! ;;
  esac
  case ",${PHASES}," in *,recipe48,*|*,latency48,*|*,profile48,*)  # the 48-layer dirs (model/, model-hybrid/, the table)
    ( nice -n 5 python3 -m lab.bench_recipe prepare "$BENCH/L$RECIPE_LAYERS" --layers "$RECIPE_LAYERS" --ple-rows "$ROWS" ) >"$GS/prepare48.log" 2>&1 &
    prep48=$! ;;
  esac

  local p bench_ready=""
  for p in e2e decode8 kernels decode4 sidegemm recipe48 latency48 profile48; do
    case ",${PHASES}," in *",$p,"*) ;; *) log "skip $p (not asked)" ;; esac
  done
  for p in ${PHASES//,/ }; do  # in the order asked
    case "$p" in
      e2e)
        phase e2e "$(floor e2e)" env FLASH_E2E_OUT="$GS/e2e" FLASH_E2E_WORK="$GS/work" FLASH_E2E_BOOT_WAVE="${FLASH_E2E_BOOT_WAVE:-4}" \
          FLASH_E2E_DEADLINE="$(e2e_deadline)" tests/run gpu-e2e -- -k "${E2E_K:-not diag}"
        # the JIT caches the boots built, packed now: a session cut short after e2e still has them
        jit_pack "$GS/jit-cache.tar.gz" ;;
      decode8|kernels|decode4|sidegemm|recipe48|latency48|profile48)
        if [ -z "$bench_ready" ]; then
          bench_ready=1
          if [ -n "$prep" ]; then wait "$prep"; log "prepare rc=$? ($(tail -c 300 "$GS/prepare.log" | tr '\n' ' '))"; fi
          # the plugin as vLLM finds it (an entry point): the dist-info the e2e tier writes
          local site
          site=$(PYTHONPATH="tests/gpu_e2e:tests:$PYTHONPATH" python3 -c "import pathlib; import fleet
print(fleet.plugin_site(fleet.Context(work=pathlib.Path('$GS/work'), out=pathlib.Path('$GS'), python='', base_env={}, snaps={})))")
          export PYTHONPATH="$site:$PYTHONPATH"
          mkdir -p "$GS/decode" "$GS/kernels"
        fi
        case "$p" in recipe48|latency48|profile48)  # the 48-layer dirs, once
          if [ -n "$prep48" ]; then wait "$prep48"; rc48=$?; prep48=""; log "prepare48 rc=$rc48 ($(tail -c 300 "$GS/prepare48.log" | tr '\n' ' '))"; fi ;;
        esac
        case "$p" in
          decode8) decode_phase 8 "$(need decode8)" 18600 ;;
          kernels) phase kernels "$(need kernels)" bash -c "timeout 120 python3 -m lab.bench_step_kernels --out '$GS/kernels/kernels.jsonl';
                     timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu" ;;
          decode4) decode_phase 4 "$(need decode4)" 18610 ;;
          sidegemm) phase sidegemm "$(need sidegemm)" bash -c "timeout 100 python3 -m lab.bench_side_gemm --paths auto,cutlass --out '$GS/kernels/side-gemm.jsonl';
                     timeout 120 python3 -m lab.bench_side_gemm --paths deepgemm,triton,flashinfer --quick --out '$GS/kernels/side-gemm-jit.jsonl'" ;;
          recipe48)
            # shellcheck disable=SC2086 - RECIPE_ARGS is a list of options
            # started with less than need() reserves for it: bench_recipe skips each config its boot and
            # block estimates do not fit (a 600 s floor left a warm 334 s unused, 2026-12-04)
            phase recipe48 "$(floor recipe48)" python3 -m lab.bench_recipe run "$BENCH/L$RECIPE_LAYERS" --configs "$RECIPE_CONFIGS" \
              --out "$GS/decode/raw48.jsonl" --logs "$GS/decode" --deadline $(( $(left) - 90 )) $RECIPE_ARGS ;;
          latency48)
            # shellcheck disable=SC2086 - LATENCY_ARGS is a list of options
            phase latency48 "$(floor latency48)" timeout $(( $(left) - 60 )) python3 -m lab.bench_latency run "$BENCH/L$RECIPE_LAYERS" \
              --configs "$LATENCY_CONFIGS" --out "$GS/decode/latency48.jsonl" --logs "$GS/decode" $LATENCY_ARGS ;;
          profile48)
            # shellcheck disable=SC2086 - PROFILE_ARGS is a list of options
            phase profile48 "$(floor profile48)" timeout $(( $(left) - 60 )) python3 -m lab.bench_profile run "$BENCH/L$RECIPE_LAYERS" \
              --configs "$PROFILE_CONFIGS" --out "$GS/decode/profile48.jsonl" --logs "$GS/decode" $PROFILE_ARGS ;;
        esac ;;
    esac
  done
  jit_pack "$GS/jit-cache.tar.gz"
  log "all phases ended"
  touch "$GS/done"
}

# what a watch call brings back: ONE archive (the device tool returns a handful of files a call:
# 16 loose ones came back as "(count)", left out) of the results so far, server logs capped
collect() {
  local out=${OUT:?OUT is the device tool\'s result folder} tmp
  tmp=$(mktemp -d)
  mkdir -p "$tmp/gs"
  cp -f "$GS"/*.log "$tmp/gs/" 2>/dev/null
  for d in e2e kernels decode; do
    [ -d "$GS/$d" ] || continue
    mkdir -p "$tmp/gs/$d"
    for f in "$GS/$d"/*; do
      [ -f "$f" ] || continue
      case "$f" in *.log) tail -c 3000000 "$f" >"$tmp/gs/$d/$(basename "$f")" ;; *) cp -f "$f" "$tmp/gs/$d/" ;; esac
    done
  done
  tar czf "$out/gs.tar.gz" -C "$tmp" gs
  rm -rf "$tmp"
}

# the newest JIT pack, once, in parts the device tool returns (files of at most 16 MiB, 8 a call:
# a 19 MiB pack in one piece was left out, run38); here: cat jit-cache.tar.gz.* > .payload/jit-cache-RELEASE.tar.gz
return_jit() {
  if [ -f "$GS/jit-cache.tar.gz" ] && [ "$GS/jit-cache.tar.gz" -nt "$GS/jit-returned" ]; then
    split -b 15M -d "$GS/jit-cache.tar.gz" "$OUT/jit-cache.tar.gz." && touch "$GS/jit-returned"
  fi
}

case "${1:-}" in
  start)
    COMMIT=${2:?start COMMIT BUDGET_S [PHASES]}; BUDGET=${3:?start COMMIT BUDGET_S [PHASES]}
    PHASES=${4:-e2e,decode8,kernels,decode4}
    for p in ${PHASES//,/ }; do
      case "$p" in e2e|decode8|kernels|decode4|sidegemm|recipe48|latency48|profile48|none) ;;
        *) echo "gpu_session: unknown phase '$p' (e2e, decode8, kernels, decode4, sidegemm, recipe48, latency48, profile48, or none)" >&2; exit 2 ;; esac
    done
    case "$BUDGET" in ''|*[!0-9]*) echo "gpu_session: BUDGET_S '$BUDGET': give whole seconds" >&2; exit 2 ;; esac
    for v in DECODE_REPEATS DECODE_TOKENS DECODE_SECONDS; do
      case "${!v}" in ''|*[!0-9]*|0*) echo "gpu_session: $v='${!v}': give a positive whole number" >&2; exit 2 ;; esac
    done
    # the servers the matrix knows, from the matrix itself (stdlib only: the device's python3)
    known=$(cd "$TREE" && PYTHONPATH="$TREE/src${PYTHONPATH:+:$PYTHONPATH}" python3 -m lab.bench_decode configs) || { echo "gpu_session: lab/bench_decode.py configs failed" >&2; exit 3; }
    names=${known//,/, } seen=,
    for c in ${DECODE_CONFIGS//,/ } ''; do  # the trailing '' catches an empty list
      case ",$c,:,$known," in
        ,,:*) [ "$seen" != , ] || { echo "gpu_session: DECODE_CONFIGS is empty: give a comma list of $names" >&2; exit 2; } ;;
        *:*",$c,"*)
          case "$seen" in *",$c,"*) echo "gpu_session: DECODE_CONFIGS='$DECODE_CONFIGS': $c twice" >&2; exit 2 ;; esac
          seen="$seen$c," ;;
        *) echo "gpu_session: DECODE_CONFIGS='$DECODE_CONFIGS': unknown config '$c' ($names)" >&2; exit 2 ;;
      esac
    done
    # the rule is lab/decode/model.check_layers' (what bench_recipe prepare applies), asked here first
    (cd "$TREE" && PYTHONPATH="$TREE/src${PYTHONPATH:+:$PYTHONPATH}" python3 -c \
      'import sys; from lab.decode.model import check_layers; check_layers(int(sys.argv[1]))' "$RECIPE_LAYERS") \
      >/dev/null 2>&1 || { echo "gpu_session: RECIPE_LAYERS='$RECIPE_LAYERS': give a multiple of 4 from 4 to 48" >&2; exit 2; }
    case ",${PHASES}," in *,recipe48,*)  # a typo here would cost the session's boots: checked first
      (cd "$TREE" && PYTHONPATH="$TREE/src${PYTHONPATH:+:$PYTHONPATH}" python3 -m lab.bench_recipe configs "$RECIPE_CONFIGS") >/dev/null || exit 2 ;;
    esac
    case ",${PHASES}," in *,latency48,*)
      (cd "$TREE" && PYTHONPATH="$TREE/src${PYTHONPATH:+:$PYTHONPATH}" python3 -m lab.bench_recipe configs "$LATENCY_CONFIGS") >/dev/null || exit 2 ;;
    esac
    case ",${PHASES}," in *,profile48,*)
      (cd "$TREE" && PYTHONPATH="$TREE/src${PYTHONPATH:+:$PYTHONPATH}" python3 -m lab.bench_recipe configs "$PROFILE_CONFIGS") >/dev/null || exit 2 ;;
    esac
    [ -f "$ENV_SH" ] || { echo "gpu_session: $ENV_SH missing: install the payload first (lab/README.md)" >&2; exit 3; }
    first=${PHASES%%,*}
    if [ "$first" != none ] && [ "$BUDGET" -lt "$(floor "$first")" ]; then  # refused here: no call spent on a skip
      echo "gpu_session: a budget of $BUDGET s is under what $first needs to start ($(floor "$first") s): nothing would run" >&2
      exit 2
    fi
    rm -rf "$GS" "$REPO"; mkdir -p "$GS" "$REPO"
    if [ -f "$JIT_CARRIED" ]; then  # a previous session's JIT caches (see the top)
      if tar xzf "$JIT_CARRIED" -C "$HOME"; then log "jit caches restored from $JIT_CARRIED ($(du -k "$JIT_CARRIED" | cut -f1) KiB)"
      else log "jit caches: $JIT_CARRIED did not unpack; starting cold"; fi
    fi
    tar --exclude=./.payload --exclude=./.git --exclude=./.venv -cf - . | tar -xf - -C "$REPO"
    echo $(( $(date +%s) + BUDGET )) >"$GS/end"
    export COMMIT PHASES
    setsid bash -c "$(declare -f log left need floor e2e_deadline jit_pack phase decode_phase run_phases); GS=$GS REPO=$REPO ENV_SH=$ENV_SH BENCH=$BENCH ROWS=$ROWS JIT_DIRS='$JIT_DIRS' JIT_MAX_MIB=$JIT_MAX_MIB JIT_CARRIED=$JIT_CARRIED DECODE_REPEATS=$DECODE_REPEATS DECODE_TOKENS=$DECODE_TOKENS DECODE_SECONDS=$DECODE_SECONDS DECODE_CONFIGS=$DECODE_CONFIGS RECIPE_CONFIGS=$RECIPE_CONFIGS RECIPE_ARGS='$RECIPE_ARGS' RECIPE_LAYERS=$RECIPE_LAYERS LATENCY_CONFIGS=$LATENCY_CONFIGS LATENCY_ARGS='$LATENCY_ARGS' PROFILE_CONFIGS=$PROFILE_CONFIGS PROFILE_ARGS='$PROFILE_ARGS' run_phases" \
      </dev/null >"$GS/driver.log" 2>&1 &
    log "launched (pid $!, budget ${BUDGET}s, phases $PHASES, commit $COMMIT)"
    ;;
  watch)
    SECS=${2:?watch SECONDS}
    t_end=$(( $(date +%s) + SECS )) n=0
    while [ "$(date +%s)" -lt "$t_end" ] && [ ! -f "$GS/done" ]; do
      sleep 20
      # an archive every minute too: a call cut short (the session's device time ran out) still
      # brings back what was done
      n=$(( n + 1 )); [ $(( n % 3 )) -eq 0 ] && collect
      echo "--- $(date -u +%H:%M:%S): $(tail -n 1 "$GS/phases.log" 2>/dev/null)"
      tail -n 3 "$GS"/e2e.log "$GS"/decode8.log "$GS"/decode4.log "$GS"/recipe48.log "$GS"/latency48.log "$GS"/profile48.log 2>/dev/null | cut -c1-220
    done
    collect
    return_jit  # the newest pack (after e2e, at the end, or `jit`'s), once
    echo "=== phases"; cat "$GS/phases.log" 2>/dev/null
    [ -f "$GS/done" ] && echo "=== all phases ended"
    ;;
  jit)
    [ -d "$GS" ] || { echo "gpu_session: no session in $GS: nothing to pack (start one first)" >&2; exit 3; }
    # Triton writes each kernel by rename, so its entries are whole; FlashInfer's and vLLM's
    # compile outputs are not known to be: pack between boots (a bench's measuring blocks), not
    # while a server compiles
    jit_pack "$GS/jit-cache.tar.gz"
    return_jit
    tail -n 2 "$GS/phases.log"
    ;;
  *)
    echo "usage: lab/gpu_session.sh start COMMIT BUDGET_S [PHASES] | watch SECONDS | jit" >&2
    exit 2 ;;
esac
