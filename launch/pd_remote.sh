# shellcheck shell=bash
# Sourced by launch/pd.sh: where a role runs and how a command reaches it.
#
#   role_cmd I          builds the shell command of role I (one string; same on every host)
#   on_host I SCRIPT    runs SCRIPT (bash) on role I's host and prints its output:
#                         local role:  bash -s
#                         remote role: <exec prefix with {host} = the role's host> bash -s
#                                      (default prefix: ssh -o BatchMode=yes {host};
#                                       tests: ip netns exec NS-{host})
#   spawn_role I        starts role I in its own session, its output in its log; sets ROLE_PID[I]
#   role_alive I        0: the role's leader process is running (not a zombie); 3: it is gone
#   stop_role I         SIGTERM to the leader, SIGKILL to its process group after STOP_TIMEOUT s
#
# A local role is a child of pd.sh (so pd.sh reaps it); a remote role is detached on its host
# and known by the PID it reported there. Every call is bounded by `timeout`.

ALIVE_AWK='$1 == g && $2 !~ /^Z/ { found = 1 } END { exit !found }'

q() { printf '%q' "$1"; }

role_words() {
    # role_words I: the argv of role I, one word per line (used by role_cmd and --dry-run).
    local i=$1 kind=${ROLE_KIND[$1]} host=${ROLE_HOST[$1]} port=${ROLE_PORT[$1]}
    local -a argv=()
    [[ -n ${ROLE_TASKSET[$i]:-} ]] && argv+=(taskset -c "${ROLE_TASKSET[$i]}")  # off the engines' CPUs
    argv+=("$PY" -m)
    if [[ $kind == router ]]; then
        argv+=(router --model-path "${HOST_MODEL[${ROLE_HOST[$1]}]}" --host "$host" --port "$port")
        local j
        for j in "${!ROLE_KIND[@]}"; do
            case ${ROLE_KIND[$j]} in
                prefill) argv+=(--prefill "http://${ROLE_HOST[$j]}:${ROLE_PORT[$j]}" "${ROLE_BPORT[$j]}") ;;
                decode) argv+=(--decode "http://${ROLE_HOST[$j]}:${ROLE_PORT[$j]}") ;;
                colocated) argv+=(--worker "http://${ROLE_HOST[$j]}:${ROLE_PORT[$j]}") ;;
            esac
        done
        argv+=("${ROUTER_ARGS[@]}" --cluster-secret-file "$ROUTER_KEYS_FILE")
        [[ -n $API_KEY_FILE ]] && argv+=(--api-key-file "$API_KEY_FILE")
        [[ -n $ADMIN_KEY_FILE ]] && argv+=(--admin-api-key-file "$ADMIN_KEY_FILE")
    else
        local module=${kind}_server
        [[ $kind == colocated ]] && module=common.server
        argv+=("$module" --model-path "${HOST_MODEL[$host]}" --host "$host" --port "$port")
        [[ $kind == prefill ]] && argv+=(--disaggregation-bootstrap-port "${ROLE_BPORT[$i]}")
        [[ -n $DTYPE ]] && argv+=(--dtype "$DTYPE")
        [[ -n $PAGE_SIZE ]] && argv+=(--page-size "$PAGE_SIZE")
        [[ -n ${ROLE_GPU[$i]:-} ]] && argv+=(--base-gpu-id "${ROLE_GPU[$i]}")
        [[ -n ${ROLE_CPUS[$i]:-} ]] && argv+=(--cpu-omp-threads-bind "${ROLE_CPUS[$i]}")
        argv+=("${INSTANCE_ARGS[@]}")
        case $kind in
            prefill) argv+=("${PREFILL_ARGS[@]}") ;;
            decode) argv+=("${DECODE_ARGS[@]}") ;;
        esac
        argv+=(--cluster-secret-file "$SECRET_FILE")
    fi
    printf '%s\n' "${argv[@]}"
}

role_cmd() {
    local cmd word
    cmd="cd $(q "$REPO_REMOTE") && "
    [[ -n $SECRET_ENV_FILE ]] && cmd+="set -a && . $(q "$SECRET_ENV_FILE") && set +a && "
    cmd+="exec env"
    for word in "${ROLE_ENV[@]}"; do cmd+=" $(q "$word")"; done
    while IFS= read -r word; do cmd+=" $(q "$word")"; done < <(role_words "$1")
    printf '%s' "$cmd"
}

host_prefix() {
    # host_prefix I: the words that reach role I's host (none for a local role), one per line.
    [[ ${ROLE_REMOTE[$1]} == 1 ]] || return 0
    local -a words
    read -r -a words <<< "${EXEC_PREFIX_TEMPLATE//\{host\}/${ROLE_HOST[$1]}}"
    printf '%s\n' "${words[@]}"
}

on_host() {
    # on_host I SCRIPT [TIMEOUT_S]
    local -a prefix
    mapfile -t prefix < <(host_prefix "$1")
    timeout "${3:-$CMD_TIMEOUT}" "${prefix[@]}" bash -s <<< "$2"
}

spawn_role() {
    local i=$1 cmd log=${ROLE_LOG[$1]} out
    cmd=$(role_cmd "$i")
    if [[ ${ROLE_REMOTE[$i]} == 1 ]]; then
        out=$(on_host "$i" "mkdir -p $(q "$LOG_DIR") && { setsid bash -c $(q "$cmd") >$(q "$log") 2>&1 </dev/null & echo \$!; }")
        out=${out##*$'\n'}
        [[ $out =~ ^[0-9]+$ ]] || { echo "pd.sh: could not start ${ROLE_NAME[$i]} on ${ROLE_HOST[$i]}: $out" >&2; return 1; }
        ROLE_PID[$i]=$out
    else
        setsid bash -c "$cmd" >"$log" 2>&1 </dev/null &
        ROLE_PID[$i]=$!
    fi
    printf '%s %s %s %s\n' "${ROLE_NAME[$i]}" "${ROLE_HOST[$i]}" "${ROLE_PID[$i]}" "$log" >> "$LOG_DIR/pids"
}

leader_alive_script() {
    printf 's=$(ps -o stat= -p %d 2>/dev/null) && [ -n "$s" ] && [ "${s#Z}" = "$s" ]' "$1"
}

role_alive() {
    # role_alive I: 0 = running, 3 = gone, anything else = could not tell (host unreachable).
    [[ -n ${ROLE_PID[$1]:-} ]] || return 3
    on_host "$1" "$(leader_alive_script "${ROLE_PID[$1]}") || exit 3"
}

probe_role() {
    # probe_role I: 0 = /health answered 200, 3 = the role's process is gone, else not ready yet.
    local url="http://${ROLE_HOST[$1]}:${ROLE_PORT[$1]}/health"
    on_host "$1" "$(leader_alive_script "${ROLE_PID[$1]}") || exit 3
if command -v curl >/dev/null 2>&1; then curl -sf --noproxy '*' -m 5 -o /dev/null $(q "$url")
else python3 -c 'import sys, urllib.request as u; u.build_opener(u.ProxyHandler({})).open(sys.argv[1], timeout=5)' $(q "$url") 2>/dev/null; fi"
}

stop_role() {
    local i=$1 pid=${ROLE_PID[$1]:-}
    [[ -n $pid ]] || return 0
    on_host "$i" "alive() { ps -e -o pgid=,stat= | awk -v g=$pid '$ALIVE_AWK'; }
alive || exit 0
if $(leader_alive_script "$pid"); then kill -TERM $pid; else kill -TERM -- -$pid; fi 2>/dev/null
n=0; while alive && [ \$n -lt $((STOP_TIMEOUT * 5)) ]; do sleep 0.2; n=\$((n + 1)); done
alive || exit 0
kill -KILL -- -$pid 2>/dev/null; sleep 0.5; echo \"killed process group $pid after ${STOP_TIMEOUT}s\"" \
        $((STOP_TIMEOUT + 30))
    [[ ${ROLE_REMOTE[$i]} == 1 ]] || wait "$pid" 2>/dev/null
    return 0
}

log_tail() {
    on_host "$1" "tail -n ${2:-40} $(q "${ROLE_LOG[$1]}") 2>&1"
}
