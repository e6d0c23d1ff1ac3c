#!/bin/sh
# initContainer of the prefill and decode pods: lay the node's TLS identity out the way
# `baton prefill|decode --certs-dir` reads it (ca.pem, NAME.pem, NAME.key).
# /tls is a kubernetes.io/tls Secret (ca.crt, tls.crt, tls.key), as cert-manager writes
# it; its certificate holds a wildcard DNS name (*.decode.baton or *.prefill.baton) that
# covers every node name of the pool ($BATON_NODE_NAME = POD_NAME.decode.baton), so pods
# created by the autoscaler need no certificate of their own. /certs is an in-memory emptyDir.
set -eu
: "${BATON_NODE_NAME:?}"
tls="${TLS_DIR:-/tls}"
certs="${CERTS_DIR:-/certs}"
for f in ca.crt tls.crt tls.key; do
    if [ ! -s "$tls/$f" ]; then
        echo "tls: $tls/$f is missing: the Secret needs ca.crt, tls.crt and tls.key (docs/operations.md)" >&2
        exit 1
    fi
done
cp "$tls/ca.crt" "$certs/ca.pem"
cp "$tls/tls.crt" "$certs/$BATON_NODE_NAME.pem"
cp "$tls/tls.key" "$certs/$BATON_NODE_NAME.key"
chmod 0600 "$certs/$BATON_NODE_NAME.key"
echo "tls: identity $BATON_NODE_NAME laid out in $certs"
