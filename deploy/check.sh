#!/usr/bin/env bash
# CI checks of deploy/ (scripts/test.sh runs this before the cargo tests; .ci/run installs
# the tools). Fails on the first problem:
#   1. Kubernetes: render the overlays (and the cert-manager set) with kustomize, validate
#      them offline and strictly against the Kubernetes schemas (PyPI kubernetes-validate)
#      plus Baton's consistency rules, and prove the validator catches known breakages.
#   2. Compose: docker-compose config; Prometheus config, alert rules and their unit tests.
#   3. shellcheck on every shell script of the repository.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${BATON_VENV:-.cache/venv}/bin/python3"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

step() { printf '\n== %s\n' "$*"; }
die() { echo "deploy/check.sh: $*" >&2; exit 1; }
need() { command -v "$1" >/dev/null || die "$1 is not installed ($2)"; }

need shellcheck "apt-get install shellcheck"
need python3 "apt-get install python3"
"$PYTHON" -c 'import kubernetes_validate' 2>/dev/null ||
    die "kubernetes-validate is missing: $PYTHON -m pip install kubernetes-validate (.ci/run does)"

# kustomize: a standalone binary if there is one, else kubectl's built-in one (kubectl 1.20
# ships kustomize v2; the kustomizations are written for v2 through v5).
if command -v kustomize >/dev/null; then
    kustomize_build() { kustomize build "$1"; }
elif command -v kubectl >/dev/null; then
    kustomize_build() { kubectl kustomize "$1"; }
else
    die "neither kustomize nor kubectl is installed (apt-get install kubernetes-client)"
fi
if command -v docker-compose >/dev/null; then
    compose() { docker-compose "$@"; }
elif docker compose version >/dev/null 2>&1; then
    compose() { docker compose "$@"; }
else
    die "docker-compose is not installed (apt-get install docker-compose)"
fi

render() {
    local dir="$1" out="$2"
    # Newer kustomize warns that v2's field names are deprecated; that is expected here.
    if ! kustomize_build "$dir" >"$out" 2>"$tmp/stderr"; then
        cat "$tmp/stderr" >&2
        die "kustomize could not render $dir"
    fi
    grep -v "^# Warning: '[a-zA-Z]*' is deprecated" "$tmp/stderr" >&2 || true
    echo "rendered $dir: $(grep -c '^kind:' "$out") objects"
}

step "Kubernetes manifests (deploy/k8s)"
render deploy/k8s/overlays/cpu "$tmp/cpu.yaml"
render deploy/k8s/overlays/gpu "$tmp/gpu.yaml"
render deploy/k8s/cert-manager "$tmp/cert-manager.yaml"
render deploy/k8s/planner "$tmp/planner.yaml"
"$PYTHON" deploy/k8s/validate.py --self-test "$tmp/cpu.yaml"
"$PYTHON" deploy/k8s/validate.py --self-test --gpu "$tmp/gpu.yaml"
"$PYTHON" deploy/k8s/validate.py --schema-only "$tmp/cert-manager.yaml"
# The planner and the two ways to act on its targets (optional sets, applied by hand).
"$PYTHON" deploy/k8s/validate.py --schema-only --self-test "$tmp/planner.yaml"
"$PYTHON" deploy/k8s/validate.py --schema-only deploy/k8s/planner/autoscalers/hpa.yaml
"$PYTHON" deploy/k8s/validate.py --schema-only deploy/k8s/planner/autoscalers/keda.yaml
"$PYTHON" deploy/k8s/sync-alerts.py --check

# The model the pods fetch is the one scripts/fetch-model.sh fetches.
for key in PKG_VERSION SHA256; do
    value="$(sed -n "s/^$key=\"\(.*\)\"$/\1/p" scripts/fetch-model.sh)"
    [ -n "$value" ] || die "no $key in scripts/fetch-model.sh"
    grep -q -- "$value" deploy/k8s/base/kustomization.yaml ||
        die "deploy/k8s/base/kustomization.yaml does not use the model's $key $value of scripts/fetch-model.sh"
done
echo "model source matches scripts/fetch-model.sh"
# The custom-metric rule serves the metric the prefill autoscaler reads.
"$PYTHON" - deploy/k8s/prometheus-adapter/values.yaml <<'PY'
import sys, yaml
rules = yaml.safe_load(open(sys.argv[1]))["rules"]["custom"]
names = {r["name"]["as"] for r in rules}
if "baton_prefill_queue_depth" not in names:
    sys.exit(f"{sys.argv[1]}: no rule serves baton_prefill_queue_depth (has {sorted(names)})")
print("prometheus-adapter serves baton_prefill_queue_depth")
PY

step "Docker Compose (deploy/docker)"
compose -f deploy/docker/compose.yaml config -q
echo "deploy/docker/compose.yaml: valid"
# Prometheus scrapes every Baton service of the compose file, and only services that exist.
compose -f deploy/docker/compose.yaml config >"$tmp/compose.yaml"
"$PYTHON" - "$tmp/compose.yaml" deploy/docker/prometheus.yml <<'PY'
import sys, yaml
services = yaml.safe_load(open(sys.argv[1]))["services"]
jobs = yaml.safe_load(open(sys.argv[2]))["scrape_configs"]
targets = {t.split(":")[0] for j in jobs for sc in j.get("static_configs", []) for t in sc["targets"]}
baton = {name for name, s in services.items() if s.get("command", [None])[0] in ("coordinator", "prefill", "decode", "gateway")}
unknown = targets - set(services) - {"127.0.0.1"}
missing = baton - targets
if unknown or missing:
    sys.exit(f"prometheus.yml: targets without a compose service: {sorted(unknown)}; Baton services not scraped: {sorted(missing)}")
print(f"prometheus.yml scrapes all {len(baton)} Baton services of the compose file")
PY
[ -f deploy/grafana/baton-dashboard.json ] ||
    echo "note: deploy/grafana/baton-dashboard.json (provisioned into Grafana) does not exist yet"

step "Prometheus (deploy/prometheus, deploy/docker/prometheus.yml)"
if command -v promtool >/dev/null; then
    promtool check rules deploy/prometheus/alerts.yml
    (cd deploy/prometheus && promtool test rules alerts_test.yml)
    # The compose config loads the rules from its container path; check it against ours.
    sed 's#/etc/prometheus/alerts.yml#'"$PWD"'/deploy/prometheus/alerts.yml#' \
        deploy/docker/prometheus.yml >"$tmp/prometheus.yml"
    promtool check config "$tmp/prometheus.yml"
else
    echo "skipped: promtool is not installed (apt-get install prometheus)"
fi

step "shellcheck"
mapfile -t scripts < <(git ls-files --cached --others --exclude-standard -- '*.sh')
scripts+=(.ci/run)
shellcheck "${scripts[@]}"
echo "shellcheck: ${#scripts[@]} scripts clean"

printf '\ndeploy/check.sh: all checks passed\n'
