#!/usr/bin/env bash
# One run on the GPU machine: GEMM efficiency table, causal attention, megatron-core layer
# profiles with their comparison to the roofline; or (cost_check.sh) the planner's prices held
# against the GPU: sustained GEMM, grouped and skinny GEMMs, the loss, an MoE layer, one Megatron
# training step.
# Everything lands in $OUT (README.md here).
#
#   bash benchmarks/device/h100_run.sh                        # on the GPU machine, from the repo root
#   OUT=/tmp/out DEVICE_DRY_RUN=1 bash benchmarks/device/h100_run.sh   # locally: CPU, tiny shapes
#
# Each part runs in its own process under a hard time limit, so one that fails or overruns
# still leaves the others' results; the whole run keeps inside DEVICE_TOTAL_S (default 510 s).
# PARTS (default "gemm attention profile") picks parts; GEMM_BUDGET_S, ATTENTION_BUDGET_S
# and PROFILE_SCALE (multiplies each profile's budget) trade them off; GEMM_TOKENS (e.g.
# "2048 16384") picks the GEMM table's token counts, to finish one a first run cut short.
# The cost-check parts (sustained grouped skinny loss moe train) take SUSTAIN_S (per dtype),
# GROUPED_BUDGET_S, SKINNY_BUDGET_S, LOSS_BUDGET_S, MOE_BUDGET_S and TRAIN_LIMIT_S; the in-job
# part (injob: in_job.sh) takes what is left, and MEGATRON_LM (a Megatron-LM checkout) if set.
set -u -o pipefail

START=$(date +%s)
TOTAL_S=${DEVICE_TOTAL_S:-510}
DRY=${DEVICE_DRY_RUN:-0}
PARTS=${PARTS:-gemm attention profile}
GEMM_S=${GEMM_BUDGET_S:-180}
ATTENTION_S=${ATTENTION_BUDGET_S:-35}
PROFILE_SCALE=${PROFILE_SCALE:-1}
PROFILE_SETUP_S=25  # per profile beyond its budget: imports, process group, first compile
SUSTAIN_S=${SUSTAIN_S:-60}
GROUPED_S=${GROUPED_BUDGET_S:-40}
SKINNY_S=${SKINNY_BUDGET_S:-20}
LOSS_S=${LOSS_BUDGET_S:-40}
MOE_S=${MOE_BUDGET_S:-40}
TRAIN_S=${TRAIN_LIMIT_S:-150}
CHECK_SETUP_S=30    # per cost-check part beyond its budget: imports, operands, the JSON
PYTHON=${PYTHON:-python3}
: "${OUT:?set OUT to the folder for the results}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
# One-process jobs: gloo and NCCL talk over loopback (the machine may have no other interface).
export GLOO_SOCKET_IFNAME=lo NCCL_SOCKET_IFNAME=lo
# megatron-core's fused bias-activation and bias-dropout-add are torch.compile'd: should the
# compiler fail there, run them eagerly (the error is logged) rather than lose the profile.
export TORCHDYNAMO_SUPPRESS_ERRORS=1

left() { echo $((START + TOTAL_S - $(date +%s))); }
say() { echo "[$(date -u +%H:%M:%S) +$(($(date +%s) - START))s, $(left)s left] $*"; }
wants() { [[ " $PARTS " == *" $1 "* ]]; }

# Runs "$@" under a hard limit of $1 seconds; a failure is reported, never fatal.
step() {
    local limit=$1; shift
    local t0=$(date +%s)
    timeout -k 10 "$limit" "$@"
    local rc=$?
    say "exit $rc after $(($(date +%s) - t0)) s: ${*:2:4}"
}

main() {
    say "start; dry run: $DRY; parts: $PARTS"
    if [[ $DRY == 1 ]]; then
        DEVICE=cpu QUICK=--quick GPU_NAME=H100-80GB   # the catalog GPU the CPU profile is compared as
        export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
    else
        DEVICE=cuda QUICK=
        GPU_NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)   # "NVIDIA H200": its catalog entry
        nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,power.limit \
            --format=csv || true
        if compgen -G ".whl/*.whl" >/dev/null; then
            "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
                --target /tmp/site .whl/*.whl || say "wheel install failed"
        fi
        export PYTHONPATH=/tmp/site:$PWD
        # What `pip install` of this package ships (setup.py): the .pth that adds --auto-parallel to
        # unmodified Megatron scripts. PYTHONPATH folders are not site folders, so it goes into the
        # interpreter's own (the machine is bare and given back after the run).
        if wants injob; then
            cp megatron_pipette_autoload.pth "$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/" \
                || say "the autoload .pth could not be installed: --auto-parallel will be refused"
        fi
    fi
    "$PYTHON" - <<'EOF'
import platform, torch
print(f"python {platform.python_version()}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"GPU {torch.cuda.get_device_name() if torch.cuda.is_available() else None}")
try:
    import megatron.core
    print(f"megatron-core {megatron.core.__version__} from {megatron.core.__file__}")
except Exception as e:  # the profiles then fail one by one and say why
    print(f"megatron-core does not import: {type(e).__name__}: {e}")
EOF

    if wants gemm; then
        say "GEMM efficiency table (budget ${GEMM_S} s)"
        step $((GEMM_S + 60)) "$PYTHON" -m benchmarks.calibration.gemm_efficiency $QUICK --budget-s "$GEMM_S" \
            ${GEMM_TOKENS:+--tokens $GEMM_TOKENS} --out "$OUT/gemm_efficiency.json"
    fi
    if wants attention; then
        say "causal attention (budget ${ATTENTION_S} s)"
        step $((ATTENTION_S + 60)) "$PYTHON" -m benchmarks.calibration.attention_efficiency $QUICK --budget-s "$ATTENTION_S" \
            --out "$OUT/attention.json"
    fi
    if wants profile; then
        # model | budget s | profile flags | flags that shrink it for the dry run
        local runs=(
            "gpt3-1.3b|50|--tp 1 2 4 --mbs 1 2 4|--hidden-size 64 --num-attention-heads 4"
            "llama3-8b|80|--tp 1 2 4 8 --mbs 1 2|--hidden-size 256 --num-attention-heads 16 --ffn-hidden-size 512"
            "gpt3-13b|40|--tp 2 4 8 --mbs 1|--hidden-size 64 --num-attention-heads 8"
        )
        local tiny_common="--seq-length 64 --vocab-size 1000"
        local cmp=$(mktemp -d) i=0
        for run in "${runs[@]}"; do
            IFS='|' read -r model budget flags tiny <<<"$run"
            i=$((i + 1))
            [[ $DRY == 1 ]] && flags="$flags $tiny $tiny_common"
            budget=$(awk -v b="$budget" -v s="$PROFILE_SCALE" 'BEGIN { printf "%d", b * s }')
            # Keep the setup time of this profile and the ones after it, and 20 s for the recap.
            local room=$(($(left) - PROFILE_SETUP_S * (${#runs[@]} - i + 1) - 20))
            ((budget > room)) && budget=$room
            if ((budget < 10)); then
                say "profile $model skipped: ${room} s of room"
                continue
            fi
            say "layer profile $model (budget ${budget} s)"
            step $((budget + PROFILE_SETUP_S + 60)) "$PYTHON" -m megatron_pipette profile --model "$model" $flags \
                --device "$DEVICE" --budget-s "$budget" --out "$OUT/profile_$model.json"
            [[ -f $OUT/profile_$model.json ]] || continue
            "$PYTHON" -m megatron_pipette compare "$OUT/profile_$model.json" --gpu "$GPU_NAME"
            "$PYTHON" -m megatron_pipette compare "$OUT/profile_$model.json" --gpu "$GPU_NAME" --json \
                >"$cmp/$model.json"
        done
        "$PYTHON" - "$cmp" "$OUT/compare.json" <<'EOF'
import json, pathlib, sys
rows = {p.stem: json.loads(p.read_text()) for p in sorted(pathlib.Path(sys.argv[1]).glob("*.json")) if p.stat().st_size}
pathlib.Path(sys.argv[2]).write_text(json.dumps(rows, indent=1) + "\n")
EOF
        rm -rf "$cmp"
    fi
    local check="-m benchmarks.validation.cost_check" window=5 dry_flag=
    [[ $DRY == 1 ]] && { SUSTAIN_S=3 window=1 dry_flag=--dry-run; }
    if wants sustained; then
        say "sustained GEMM (${SUSTAIN_S} s per dtype)"
        step $((2 * SUSTAIN_S + CHECK_SETUP_S)) "$PYTHON" $check sustained $dry_flag --duration-s "$SUSTAIN_S" \
            --window-s $window --out "$OUT/sustained.json"
    fi
    if wants grouped; then
        say "grouped GEMMs (budget ${GROUPED_S} s)"
        step $((GROUPED_S + CHECK_SETUP_S)) "$PYTHON" $check grouped $dry_flag --budget-s "$GROUPED_S" \
            --out "$OUT/grouped.json"
    fi
    if wants skinny; then
        say "skinny GEMMs (budget ${SKINNY_S} s)"
        step $((SKINNY_S + CHECK_SETUP_S)) "$PYTHON" $check skinny $dry_flag --budget-s "$SKINNY_S" \
            --out "$OUT/skinny.json"
    fi
    if wants loss; then
        say "cross-entropy (budget ${LOSS_S} s)"
        step $((LOSS_S + CHECK_SETUP_S + 60)) "$PYTHON" $check loss $dry_flag --budget-s "$LOSS_S" \
            --out "$OUT/loss.json"
    fi
    if wants moe; then
        say "MoE layer (budget ${MOE_S} s)"
        step $((MOE_S + CHECK_SETUP_S)) "$PYTHON" $check moe $dry_flag --budget-s "$MOE_S" --out "$OUT/moe.json"
    fi
    if wants train; then
        local limit=$TRAIN_S room=$(($(left) - 20))   # 20 s for the recap
        ((limit > room)) && limit=$room
        say "one Megatron training step (limit ${limit} s)"
        # Megatron gets the limit less the time to price, parse and write around it.
        step "$limit" "$PYTHON" $check train $dry_flag --budget-s $((limit - 20)) --out "$OUT/train.json"
    fi
    if wants injob; then
        local room=$(($(left) - 20))   # 20 s for the recap
        local starts=${INJOB_STARTS:-3}
        say "the in-job path: $starts starts under --auto-parallel (limit ${room} s)"
        # Each start gets its share of the room; the script's own limit per start keeps it inside.
        # INJOB_ARGS: more of in_job.py's options (--first-only, --pick-check MBS ...; INJOB_STARTS to match).
        step "$room" "$PYTHON" -m benchmarks.validation.in_job $dry_flag --out "$OUT/in_job" \
            --limit-s $(((room - 10) / starts)) ${MEGATRON_LM:+--megatron-lm "$MEGATRON_LM"} ${INJOB_ARGS:-}
    fi
    say "recap"
    "$PYTHON" -m benchmarks.device.recap "$OUT"
    say "done"
}

main 2>&1 | tee "$OUT/log.txt"
