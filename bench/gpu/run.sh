#!/bin/bash
# GPU bench in one command, from the project root on a GPU host (after bench/gpu/prepare.sh built .gpu/):
#   OUT_DIR=/tmp/gpu-out bash .gpu/bin/run.sh [STEP...]          (bash bench/gpu/run.sh works too)
# Steps (default: all, in this order, the issue's figures first; a step is skipped once BUDGET_S,
# default 540, has under 30 s left):
#   model throughput overlap transfer 8b-throughput 8b-pd pd real agree loops syncs
# HF_COMPARE=1: the 1B throughput step also runs transformers generate (+35 s on an H100).
# Each step writes lines "[seconds] step: ..." to $OUT_DIR/steps.txt; logs go to $OUT_DIR/logs.tgz.
# A step that fails says why there (the tail of its log), never an empty RESULT.
# MODEL, MODEL8, LOG_DIR: where the random checkpoints and the logs go (defaults under /tmp).
# SMOKE=1: tiny models on the CPU (torch backend), to try the flow where no GPU is at hand.
# REAL_MODEL (default /tmp/pdserve-real): the default model's HF dir; if it is missing and REAL_GGUF
# (default /tmp/pdserve-real.gguf) exists, it is converted first. Step `real` is skipped without both.
set -u
ROOT=$(pwd); B=$(cd "$(dirname "$0")" && pwd); G=${GPU_BUNDLE:-$ROOT/.gpu}; OUT=${OUT_DIR:-/tmp/gpu-out}; T0=$(date +%s)
S=/tmp/pdserve-site; L=${LOG_DIR:-/tmp/pdserve-gpu-logs}; mkdir -p "$OUT" $S $L
REAL=${REAL_MODEL:-/tmp/pdserve-real}; REAL_GGUF=${REAL_GGUF:-/tmp/pdserve-real.gguf}
STEPS=${*:-model throughput overlap transfer 8b-throughput 8b-pd pd real agree loops syncs}; BUDGET=${BUDGET_S:-540}
say() { echo "[$(($(date +%s) - T0))s] $*" | tee -a "$OUT/steps.txt"; }
left() { local l=$((BUDGET - ($(date +%s) - T0))); echo $((l < ${1:-9999} ? l : ${1:-9999})); }
# run_py NAME LIMIT ARGS...: python ARGS > $L/NAME.log; echo its RESULT line, else why it failed
run_py() {
  local name=$1 lim=$2 rc; shift 2
  timeout "$(left "$lim")" $PY "$@" > $L/$name.log 2>&1; rc=$?
  local r; r=$(grep -h '^RESULT ' $L/$name.log | tail -1 | cut -c1-1500)
  if [[ -n $r ]]; then echo "$r"; else
    echo "FAILED rc=$rc$( ((rc == 124)) && echo ' (timeout)'): $(grep -v '^\s*$' $L/$name.log | tail -3 | cut -c1-300 | tr '\n' ' ')"; fi
}
if [[ ${SMOKE:-} ]]; then
  DEV=cpu; INST="--device cpu --dtype float32"; INST8=$INST; SHAPE1=tiny; SHAPE8=tiny
  PY=${PYTHON:-python3}; [[ -z ${PYTHON:-} && -x .venv/bin/python ]] && PY=.venv/bin/python  # the dev venv
  M=${MODEL:-/tmp/pdserve-smoke-m1b}; M8=${MODEL8:-/tmp/pdserve-smoke-m8b}; THR="--batch 8 --prompt 32 --new 16"
  SERVE_SMOKE="--num-prompts 12 --random-input-len 256 --random-output-len 16"  # last flag wins: a small load
else
  DEV=cuda; SERVE_SMOKE=""; SHAPE1=1b; SHAPE8=8b; PY=python3; M=${MODEL:-/tmp/pdserve-m1b}; M8=${MODEL8:-/tmp/pdserve-m8b}
  INST="--device cuda --attention-backend flashinfer --dtype bfloat16 --max-total-tokens 65536"
  # 8B: two instances on one 80 GB GPU: 14 GB weights + 32,768 KV tokens x 128 KiB = 4 GiB each
  INST8="--device cuda --attention-backend flashinfer --dtype bfloat16 --max-total-tokens 32768"
  THR="--batch 64 --prompt 128 --new 256"; [[ ${HF_COMPARE:-} ]] || THR+=" --no-hf"
  say "$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader)"
  if [[ ! -f $S/.stamp ]] || ! diff -q <(ls $G/whl) $S/.stamp > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $S $G/whl/*.whl > $L/pip.log 2>&1 \
      && ls $G/whl > $S/.stamp || say "pip failed: $(tail -2 $L/pip.log)"
    python3 -m zipfile -e $G/nixl_cu13_trim.zip $S
  fi
  export PYTHONPATH=$S:$ROOT
fi
export PYTHONUNBUFFERED=1 DEV
say "$($PY -c 'import torch, nixl._api, msgspec, zmq, fastapi; print("imports ok, torch", torch.__version__)' 2>&1 | tail -1)"
ensure_model() {  # ensure_model DIR SHAPE: a random checkpoint (generated once per host)
  [[ -f $1/config.json ]] && { [[ $step == model ]] && say "model $2: $1 (already there)"; return 0; }
  timeout "$(left 240)" $PY $B/gen_model.py "$1" "$2" > $L/gen-$2.log 2>&1 || rm -rf "$1"
  say "model $2: $(tail -1 $L/gen-$2.log 2>/dev/null | cut -c1-300)"
  [[ -f $1/config.json ]]
}
pd_up() {  # pd_up NAME MODEL "INSTANCE_ARGS" [pd.sh flags...]: on this host, every instance on GPU 0
  local name=$1 model=$2 inst=$3; shift 3
  bash launch/pd.sh --python $PY --model-path "$model" --port 30900 --prefill-port 31000 --decode-port 31100 \
    --bootstrap-port 31200 --log-dir $L/pd-$name --instance-args "$inst" --env UCX_PROTO_INFO=y "$@" > $L/pd-$name.out 2>&1 &
  PD=$!
  for _ in $(seq "$(left 300)"); do
    grep -q 'pd.sh: READY' $L/pd-$name.out 2>/dev/null && return 0; kill -0 $PD 2>/dev/null || break; sleep 1
  done
  say "pd.sh $name not ready: $(tail -3 $L/pd-$name.out | tr '\n' ' ' | cut -c1-400) | $(cat $L/pd-$name/*.log 2>/dev/null \
    | grep -E 'Error|error:|Traceback|CUDA out of memory' | tail -2 | cut -c1-300 | tr '\n' ' ')"
  pd_down; return 1
}
pd_down() { kill -TERM $PD 2>/dev/null; wait $PD 2>/dev/null; sleep 2; }
serve() {  # serve NAME MODEL ARGS...: bench/serving.py against the router, random 1024-token prompts
  local name=$1 model=$2; shift 2
  run_py serve-$name 150 bench/serving.py --base-url http://127.0.0.1:30900 --tokenizer "$model" --dataset random \
    --random-input-len 1024 --disable-tqdm "$@" $SERVE_SMOKE
}
transports() { $PY $B/ucx_transports.py "$@" 2>&1 | tail -1; }
kv_metrics() { curl -s http://127.0.0.1:31000/metrics | grep -E '^pdserve_kv_transfer_(bytes|descriptors|transfers|total_seconds|exposed_seconds|gbps) ' | tr '\n' ' '; }
gpu_only() { [[ $DEV == cuda ]] || { say "$1: skipped (needs a GPU)"; return 1; }; }
for step in $STEPS; do
  if (($(left) < 30)); then say "$step: skipped (budget: $(left) s left of $BUDGET)"; continue; fi
  case $step in
  model) ensure_model $M $SHAPE1 ;;
  syncs) gpu_only syncs && ensure_model $M $SHAPE1 && say "syncs: $(run_py syncs 120 bench/gpu_checks.py syncs $M)" ;;
  throughput) ensure_model $M $SHAPE1 && say "throughput: $(run_py thr 240 $B/throughput.py $M $THR)" ;;
  overlap) gpu_only overlap && ensure_model $M $SHAPE1 && say "overlap: $(run_py overlap 120 bench/gpu_checks.py overlap $M)" ;;
  agree) gpu_only agree && ensure_model $M $SHAPE1 && say "agree: $(run_py agree 200 $B/agree.py $M 16 32)" ;;
  transfer)
    say "transfer: $(UCX_PROTO_INFO=y run_py transfer 120 bench/transfer.py --device $DEV)"
    say "transfer transports: $(transports $L/transfer.log)" ;;
  8b-throughput) ensure_model $M8 $SHAPE8 && say "8b-throughput: $(run_py thr8b 240 $B/throughput.py $M8 ${THR/--new 256/--new 128} --no-hf)" ;;
  8b-pd)
    if ensure_model $M8 $SHAPE8 && pd_up 8b $M8 "$INST8"; then
      say "8b serve rate 8: $(serve 8b-rate8 $M8 --num-prompts 80 --random-output-len 128 --request-rate 8)"
      say "8b kv transports: $(transports $L/pd-8b/*.log)"
      say "8b prefill kv transfer: $(kv_metrics)"
      pd_down
    fi ;;
  pd)
    ensure_model $M $SHAPE1 || continue
    [[ $DEV == cuda ]] && run_py ref 120 bench/gpu_checks.py reference $M $L/ref.json > /dev/null
    if pd_up main $M "$INST"; then
      [[ -f $L/ref.json ]] && say "parity: $(run_py parity 60 bench/gpu_checks.py parity http://127.0.0.1:30900 $L/ref.json)"
      say "kv transports: $(transports $L/pd-main/*.log)"
      say "serve rate 16: $(serve rate16 $M --num-prompts 200 --random-output-len 128 --request-rate 16)"
      say "serve saturated: $(serve saturated $M --num-prompts 256 --random-output-len 256)"
      say "prefill kv transfer: $(kv_metrics)"
      pd_down
    fi ;;
  loops)
    ensure_model $M $SHAPE1 || continue
    for mode in overlap normal; do
      extra=""; [[ $mode == normal ]] && extra="--disable-overlap-schedule"
      if pd_up $mode $M "$INST $extra"; then
        say "loop $mode, concurrency 1: $(serve $mode-c1 $M --num-prompts 16 --max-concurrency 1 --random-output-len 256)"
        say "loop $mode, saturated: $(serve $mode-sat $M --num-prompts 256 --random-output-len 256)"
        pd_down
      fi
    done ;;
  real)
    if [[ ! -f $REAL/config.json && -f $REAL_GGUF ]]; then
      say "real convert: $(run_py convert 120 -c "import sys; from pathlib import Path; from common.model.default_model import convert_gguf
convert_gguf(Path(sys.argv[1]), Path(sys.argv[2])); print('RESULT converted')" "$REAL_GGUF" "$REAL")"
    fi
    [[ -f $REAL/config.json ]] || { say "real: skipped (no $REAL/config.json, no $REAL_GGUF)"; continue; }
    [[ $DEV == cuda ]] && say "real agree: $(run_py real-agree 150 $B/agree.py $REAL 16 32)"
    if pd_up real-colo $REAL "$INST" --colocated 1; then
      say "real colocated: $(run_py real-colo 180 bench/gpu_checks.py record http://127.0.0.1:30900 $REAL $L/real-colo.json --num-prompts 16)"
      pd_down
    fi
    if [[ -f $L/real-colo.json ]] && pd_up real-pd $REAL "$INST"; then
      say "real PD == colocated: $(run_py real-parity 180 bench/gpu_checks.py parity http://127.0.0.1:30900 $L/real-colo.json)"
      pd_down
    fi ;;
  *) say "unknown step $step" ;;
  esac
done
say "done"
tar -czf "$OUT/logs.tgz" -C "$(dirname $L)" "$(basename $L)" 2>/dev/null
