#!/usr/bin/env bash
# launch/gpu_check.sh: what only a GPU run confirms, in one command, ending in a table.
#
#   bash launch/install.sh && bash launch/gpu_check.sh [--model-path DIR] [--keep-logs]
#
# 1. the CUDA tests: flashinfer vs float64 attention (head_dim 64/128, GQA 1/3/4/5/7/8, pages
#    1/16, bf16/fp16) and the backend's calls bound to the installed flashinfer's signatures
# 2. host syncs inside the model forward over 100 decode steps (torch.cuda.set_sync_debug_mode);
#    the overlap loop (worker stream, CUDA graphs) at 32 requests: syncs, kernels and launches
#    per decode step, GPU idle fraction (torch.profiler)
# 3. PD parity: 1P1D through pd.sh (--device cuda --attention-backend flashinfer, one GPU per
#    instance when there are two) gives the offline engine's greedy ids, token for token
# 4. the transports UCX chose for the KV (UCX_PROTO_INFO=y): cuda_ipc / rc (GPUDirect RDMA)
#    mean GPU-to-GPU; cuda_copy alone means KV bounced through host memory
# 5. a short serving bench through the router
# Needs: an NVIDIA GPU, `pip install -e '.[cuda]'` (flashinfer), the default model or --model-path.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
MODEL_PATH="" KEEP=0 PORT=${PDSERVE_GPU_CHECK_PORT:-30900}
while (($#)); do
    case $1 in
        --model-path) MODEL_PATH=$2; shift 2 ;;
        --keep-logs) KEEP=1; shift ;;
        -h | --help) sed -n 2,14p "$0"; exit 0 ;;
        *) echo "gpu_check.sh: unknown flag $1" >&2; exit 2 ;;
    esac
done
WORK=$(mktemp -d /tmp/pdserve-gpu-check.XXXXXX)
ROWS=()
row() { ROWS+=("$(printf '%-34s | %-4s | %s' "$1" "$2" "$3")"); }
result_of() { grep '^RESULT ' "$1" | tail -1 | cut -d' ' -f2-; }

NGPU=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
if ((NGPU < 1)); then echo "gpu_check.sh: torch sees no GPU" >&2; exit 1; fi
FI=$("$PY" -c 'import flashinfer; print(flashinfer.__version__)' 2>/dev/null || echo "not installed")
GPU_NAME=$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | head -1)
PEERMEM=no; lsmod 2>/dev/null | grep -q '^nvidia_peermem' && PEERMEM=yes
row "GPUs / flashinfer" "info" "$NGPU x ${GPU_NAME:-?}; flashinfer $FI; nvidia_peermem loaded: $PEERMEM"
[[ -n $MODEL_PATH ]] || MODEL_PATH=$("$PY" -c 'from common.model.default_model import resolve_model_path; print(resolve_model_path(None))')

# 1. CUDA tests
"$PY" -m pytest -q -p no:cacheprovider tests/model/test_flashinfer_backend.py tests/model/test_flashinfer_setup.py \
    -k "cuda or real_signatures" -rs > "$WORK/tests.log" 2>&1
rc=$?
row "cuda tests (flashinfer kernels)" "$( ((rc == 0)) && echo ok || echo FAIL)" "$(tail -1 "$WORK/tests.log")"

# 2. host syncs in the forward
"$PY" bench/gpu_checks.py syncs "$MODEL_PATH" > "$WORK/syncs.log" 2>&1
res=$(result_of "$WORK/syncs.log")
ok=FAIL; [[ $res == *'"syncs_per_step": 0.0'* ]] && ok=ok
row "syncs per decode step (forward)" "$ok" "${res:-$(tail -1 "$WORK/syncs.log")}"

"$PY" bench/gpu_checks.py overlap "$MODEL_PATH" > "$WORK/overlap.log" 2>&1
res=$(result_of "$WORK/overlap.log")
ok=FAIL; [[ $res =~ \"syncs_per_step\":\ ([0-9.]+) ]] && awk "BEGIN{exit !(${BASH_REMATCH[1]} <= 1.0)}" && ok=ok
row "overlap loop per decode step" "$ok" "${res:-$(tail -1 "$WORK/overlap.log")}"

# 3-5. PD on GPUs: reference ids first (the offline engine), then pd.sh, parity, transports, bench
"$PY" bench/gpu_checks.py reference "$MODEL_PATH" "$WORK/ref.json" > "$WORK/reference.log" 2>&1 \
    || row "offline reference" "FAIL" "$(tail -1 "$WORK/reference.log")"
GPU_ARGS=(); INSTANCE="--device cuda --attention-backend flashinfer --dtype bfloat16"
if ((NGPU >= 2)); then GPU_ARGS=(--gpus-per-host 2); else INSTANCE+=" --max-total-tokens 65536"; fi
bash launch/pd.sh --model-path "$MODEL_PATH" --port "$PORT" --prefill-port $((PORT + 100)) --decode-port $((PORT + 200)) \
    --bootstrap-port $((PORT + 300)) --log-dir "$WORK/pd" "${GPU_ARGS[@]}" --instance-args "$INSTANCE" \
    --env UCX_PROTO_INFO=y > "$WORK/pd.out" 2>&1 &
PD_PID=$!
for _ in $(seq 600); do
    grep -q 'pd.sh: READY' "$WORK/pd.out" 2>/dev/null && break
    kill -0 "$PD_PID" 2>/dev/null || break
    sleep 1
done
if grep -q 'pd.sh: READY' "$WORK/pd.out"; then
    "$PY" bench/gpu_checks.py parity "http://127.0.0.1:$PORT" "$WORK/ref.json" > "$WORK/parity.log" 2>&1
    res=$(result_of "$WORK/parity.log")
    ok=FAIL; [[ $res =~ \"prompts\":\ ([0-9]+),\ \"identical\":\ ([0-9]+) ]] && [[ ${BASH_REMATCH[1]} == "${BASH_REMATCH[2]}" ]] && ok=ok
    row "PD parity (1P1D, flashinfer)" "$ok" "${res:-$(tail -1 "$WORK/parity.log")}"
    transports=$(cat "$WORK"/pd/prefill-0.log "$WORK"/pd/decode-0.log 2>/dev/null \
        | grep -oE 'cuda_ipc|rc_mlx5|rc_verbs|dc_mlx5|ud_mlx5|gdr_copy|cuda_copy|tcp|cma|posix|sysv' | sort | uniq -c | tr -s ' ' | paste -sd, -)
    ok=info; [[ $transports == *cuda_ipc* || $transports == *rc_* || $transports == *dc_* ]] && ok=ok
    row "UCX transports for the KV" "$ok" "${transports:-none logged (UCX_PROTO_INFO output missing)}"
    "$PY" bench/serving.py --base-url "http://127.0.0.1:$PORT" --tokenizer "$MODEL_PATH" --dataset random \
        --num-prompts 200 --random-input-len 1024 --random-output-len 128 --request-rate 16 --disable-tqdm \
        > "$WORK/serving.log" 2>&1
    res=$(result_of "$WORK/serving.log")
    row "serving bench (200 x 1024/128, 16/s)" "$([[ -n $res ]] && echo ok || echo FAIL)" "${res:-$(tail -1 "$WORK/serving.log")}"
else
    row "pd.sh on GPUs" "FAIL" "$(tail -3 "$WORK/pd.out" | tr '\n' ' ')"
fi
kill -TERM "$PD_PID" 2>/dev/null && wait "$PD_PID" 2>/dev/null

echo
printf '%-34s | %-4s | %s\n' "check" "ok" "detail"
printf '%s\n' "$(printf '%.0s-' {1..100})"
printf '%s\n' "${ROWS[@]}"
if ((KEEP)); then echo "logs: $WORK"; else rm -rf "$WORK"; fi
! printf '%s\n' "${ROWS[@]}" | grep -q '| FAIL |'
