#!/usr/bin/env bash
# Checks the Kubernetes node-identity scheme with real processes on loopback:
#  - certificates made with the openssl commands of docs/operations.md (one CA, one
#    wildcard certificate per pool: *.decode.baton, *.prefill.baton, *.coordinator.baton,
#    *.gateway.baton);
#  - laid out for --certs-dir by base/tls-layout.sh, as the pods' initContainer does;
#  - node names POD_NAME.prefill.baton / POD_NAME.decode.baton, as the pods use, with the
#    coordinator's pool-certificate opt-in (--pool-certificate-names) as base/ sets it.
# A turn whose uncached tail goes to the prefill node must ship its KV blocks over QUIC
# (mutual TLS; the dialler checks the peer's name) with no local fallback; every gRPC call
# runs over the internal plane's mutual TLS (the coordinator and gateway read their Secret
# as mounted). A pod drains itself with its pool certificate (its preStop hook), and a pod
# of another pool may not drain it. Then a decode node holding a certificate for the wrong
# pool must refuse to start, naming the identity it holds.
#
#   bash deploy/k8s/identity-test.sh target/release/baton ~/.cache/baton/models/SmolLM2-135M-Instruct.Q4_1.gguf
set -euo pipefail
bin="$(realpath "${1:?usage: identity-test.sh BATON_BINARY MODEL.gguf}")"
model="$(realpath "${2:?usage: identity-test.sh BATON_BINARY MODEL.gguf}")"
layout="$(realpath "$(dirname "$0")/base/tls-layout.sh")"
work="$(mktemp -d)"
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT
cd "$work"

echo "== certificates (openssl, as in docs/operations.md)"
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 3650 \
    -subj /CN=baton -keyout ca.key -out ca.crt \
    -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign 2>/dev/null
for pool in decode prefill coordinator gateway; do
    openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=$pool.baton" \
        -keyout "$pool.key" -out "$pool.csr" 2>/dev/null
    printf 'subjectAltName=DNS:*.%s.baton\nextendedKeyUsage=serverAuth,clientAuth\nkeyUsage=critical,digitalSignature,keyEncipherment\n' "$pool" >"$pool.ext"
    openssl x509 -req -in "$pool.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days 90 \
        -extfile "$pool.ext" -out "$pool.crt" 2>/dev/null
    # The Secret's keys (kubernetes.io/tls with ca.crt).
    mkdir -p "secret-$pool"
    cp ca.crt "secret-$pool/ca.crt"
    cp "$pool.crt" "secret-$pool/tls.crt"
    cp "$pool.key" "secret-$pool/tls.key"
done

port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# start ROLE NAME SECRET_POOL [FLAGS...]: lays the identity out and starts the node; sets $http.
start_node() {
    local role="$1" name="$2" pool="$3"
    mkdir -p "certs-$name"
    BATON_NODE_NAME="$name" TLS_DIR="secret-$pool" CERTS_DIR="certs-$name" sh "$layout"
    "$bin" "$role" --name "$name" --coordinator "http://$coord" --certs-dir "certs-$name" \
        --model "$model" --listen 127.0.0.1:0 --http-listen 127.0.0.1:0 --kv-listen 127.0.0.1:0 \
        "${@:4}" >"$name.log" 2>&1 &
    pids+=($!)
    for _ in $(seq 600); do
        http="$(sed -n 's/.* http=\([0-9.:]*\).*/\1/p' "$name.log" | head -n 1)"
        if [ -n "$http" ] && curl -fsS "http://$http/healthz" >/dev/null 2>&1; then
            echo "$role $name ready (http $http)"
            return 0
        fi
        sleep 0.2
    done
    cat "$name.log" >&2
    echo "FAIL: $role $name did not become ready" >&2
    exit 1
}

metric() { curl -fsS "http://$1/metrics" | awk -v m="$2" '$1 == m { s += $2 } END { print s + 0 }'; }

# One cluster: coordinator, a prefill node, a decode node (with the given certificate
# pool), a gateway; one turn with a long new message. Prints shipped and fallbacks.
run_cluster() {
    local decode_pool="$1"
    coord="127.0.0.1:$(port)"
    coord_http="127.0.0.1:$(port)"
    "$bin" coordinator --listen "$coord" --http-listen "$coord_http" \
        --local-prefill-threshold 16 --certs-dir secret-coordinator \
        --pool-certificate-names 16 >coordinator.log 2>&1 &
    pids+=($!)
    prefill_name=baton-prefill-7d9f8-x2kqp.prefill.baton
    decode_name=baton-decode-0.decode.baton
    start_node prefill "$prefill_name" prefill
    prefill_http="$http"
    start_node decode "$decode_name" "$decode_pool"
    decode_http="$http"
    rm -f gw.db
    key="$("$bin" keys --db gw.db create --user identity-test | tail -n 1)"
    gw="127.0.0.1:$(port)"
    "$bin" gateway --listen "$gw" --db gw.db --model "$model" --coordinator "http://$coord" \
        --certs-dir secret-gateway >gateway.log 2>&1 &
    pids+=($!)
    for _ in $(seq 300); do curl -fsS "http://$gw/healthz" >/dev/null 2>&1 && break; sleep 0.2; done
    # A node is healthy before its lease reaches the coordinator: a turn routed before
    # the prefill node registers is prefilled locally (local_no_prefill_nodes).
    for _ in $(seq 300); do
        [ "$(metric "$coord_http" 'baton_coordinator_nodes{role="prefill"}')" -ge 1 ] &&
            [ "$(metric "$coord_http" 'baton_coordinator_nodes{role="decode"}')" -ge 1 ] && break
        sleep 0.2
    done
    if ! curl -fsS "http://$gw/healthz" >/dev/null 2>&1; then
        tail -n 20 gateway.log >&2
        echo "FAIL: the gateway did not become healthy" >&2
        exit 1
    fi
    local message
    message="Summarise this: $(printf 'the relay runner hands the baton to the next runner %.0s' $(seq 12))"
    curl -fsS "http://$gw/v1/chat/completions" -H "Authorization: Bearer $key" \
        -H 'Content-Type: application/json' \
        -d "{\"model\":\"baton\",\"max_tokens\":4,\"messages\":[{\"role\":\"user\",\"content\":\"$message\"}]}" >reply.json
    shipped="$(metric "$prefill_http" baton_prefill_shipped_blocks_total)"
    fallbacks="$(metric "$decode_http" baton_decode_prefill_fallbacks_total)"
    echo "reply: $(head -c 200 reply.json)"
    echo "prefill shipped blocks: $shipped; decode fallbacks: $fallbacks"
    curl -fsS "http://$coord_http/metrics" | grep '^baton_coordinator_routing_decisions_total' | grep -v ' 0$' || true
    # The preStop hook: a pod drains itself with its own pool certificate, from loopback;
    # a pod of another pool may not drain it.
    local prefill_grpc
    prefill_grpc="$(sed -n 's/^prefill grpc=\([0-9.:]*\).*/\1/p' "$prefill_name.log" | head -n 1)"
    if BATON_NODE_NAME="$decode_name" "$bin" drain --node "$prefill_grpc" --certs-dir "certs-$decode_name" --timeout 10s >drain-other.log 2>&1; then
        echo "FAIL: a decode pod drained a prefill pod" >&2
        exit 1
    fi
    grep -q "PermissionDenied\|may not call" drain-other.log || { cat drain-other.log >&2; echo "FAIL: the refusal is not a permission error" >&2; exit 1; }
    BATON_NODE_NAME="$prefill_name" "$bin" drain --node "$prefill_grpc" --certs-dir "certs-$prefill_name" --timeout 10s
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    pids=()
}

echo "== wildcard identities: the prefill node ships KV to the decode node"
run_cluster decode
if [ "${shipped%.*}" -le 0 ] || [ "${fallbacks%.*}" -ne 0 ]; then
    echo "FAIL: expected KV shipped over QUIC and no fallback" >&2
    tail -n 20 ./*.log >&2
    exit 1
fi

echo "== a decode node with the prefill pool's certificate refuses to start"
name=baton-decode-1.decode.baton
mkdir -p "certs-$name"
BATON_NODE_NAME="$name" TLS_DIR=secret-prefill CERTS_DIR="certs-$name" sh "$layout"
if "$bin" decode --name "$name" --coordinator "http://127.0.0.1:9" --certs-dir "certs-$name" \
    --model "$model" --listen 127.0.0.1:0 --http-listen 127.0.0.1:0 --kv-listen 127.0.0.1:0 >wrong-pool.log 2>&1; then
    echo "FAIL: a decode node started with the prefill pool's certificate" >&2
    exit 1
fi
if ! grep -q "names prefill" wrong-pool.log; then
    cat wrong-pool.log >&2
    echo "FAIL: the refusal does not name the certificate's identity" >&2
    exit 1
fi
echo "refused: $(grep -o 'the certificate of.*' wrong-pool.log | head -n 1)"
echo "identity-test: ok"
