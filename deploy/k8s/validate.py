#!/usr/bin/env python3
"""Offline validation of rendered Baton manifests (deploy/check.sh runs it).

  validate.py [--gpu] [--self-test] [--schema-only] RENDERED.yaml

1. Schema: every object of a built-in kind is validated strictly (unknown fields are
   errors) against the Kubernetes OpenAPI schemas shipped by the PyPI package
   kubernetes-validate, for KUBE_VERSION. Objects of CRD kinds (ServiceMonitor,
   cert-manager) are not in those schemas: they are named as skipped and checked against
   the few fields Baton relies on instead. Any other unknown kind is an error.
2. Consistency: selectors select something, named ports exist, probes, resources and
   security settings are present, the decode preStop drain fits in the grace period, the
   autoscaler reads the standard metric, KV transport ports are open to cluster nodes only,
   and (--gpu) GPU/RDMA requests are there.
3. The planner's RBAC (every mode): the ServiceAccount baton-planner is bound to the Role
   baton-planner only, which allows get/patch/update on the scale subresource of the named
   pool workloads (StatefulSet baton-decode, Deployment baton-prefill) and on its Lease
   baton-planner, and nothing else.
--schema-only skips 2 (for partial sets such as deploy/k8s/cert-manager).
--self-test breaks copies of the manifests in known ways and fails unless each is caught
(with --schema-only: the planner's RBAC breakages).
"""
import copy
import re
import sys

import yaml
import kubernetes_validate
from kubernetes_validate.utils import SchemaNotFoundError

KUBE_VERSION = "1.30.0"
CRD_KINDS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): {"spec": ["selector", "endpoints"]},
    ("monitoring.coreos.com/v1", "PrometheusRule"): {"spec": ["groups"]},
    ("cert-manager.io/v1", "Certificate"): {"spec": ["secretName", "issuerRef"]},
    ("cert-manager.io/v1", "Issuer"): {"spec": []},
    ("cert-manager.io/v1", "ClusterIssuer"): {"spec": []},
    ("keda.sh/v1alpha1", "ScaledObject"): {"spec": ["scaleTargetRef", "triggers"]},
}
# Secrets the operator creates (docs/operations.md); everything else must be rendered.
# Created by cert-manager (deploy/k8s/cert-manager) or by hand (docs/operations.md).
EXTERNAL_SECRETS = {"baton-prefill-tls", "baton-decode-tls", "baton-gateway-tls", "baton-coordinator-plane-tls", "baton-gateway-plane-tls", "baton-postgres"}
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet"}
# Served by the gateway pod, but not for the public: Prometheus and probes reach the pod.
PRIVATE_PATHS = ["/metrics", "/healthz", "/debug/routing"]
KV_PORTS = {7202, 7302}
PLANNER = "baton-planner"
# What the planner may do: (apiGroup, resource) -> the names it may touch.
PLANNER_SCALE = {
    ("apps", "statefulsets/scale"): {"baton-decode"},
    ("apps", "deployments/scale"): {"baton-prefill"},
    ("coordination.k8s.io", "leases"): {"baton-planner"},
}
PLANNER_VERBS = {"get", "patch", "update"}
AUTOSCALER_METRICS = {"baton_prefill_queue_depth"}


def matches(selector, labels):
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def duration_s(text):
    m = re.fullmatch(r"(\d+)(ms|s|m|h)?", text)
    if not m:
        return None
    n, unit = int(m.group(1)), m.group(2) or "s"
    return n / 1000 if unit == "ms" else n * {"s": 1, "m": 60, "h": 3600}[unit]


def schema_errors(docs):
    errors, skipped = [], []
    for d in docs:
        name = f"{d.get('kind')}/{d.get('metadata', {}).get('name')}"
        key = (d.get("apiVersion"), d.get("kind"))
        if key in CRD_KINDS:
            skipped.append(name)
            for field in CRD_KINDS[key]["spec"]:
                if field not in d.get("spec", {}):
                    errors.append(f"{name}: spec.{field} is missing")
            continue
        try:
            kubernetes_validate.validate(d, KUBE_VERSION, strict=True)
        except SchemaNotFoundError:
            errors.append(f"{name}: {key[0]} {key[1]} is neither a Kubernetes {KUBE_VERSION} kind nor a known CRD kind")
        except kubernetes_validate.ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            errors.append(f"{name}: {path}: {e.message}")
    return errors, skipped


def consistency_errors(docs, gpu):
    errs = []
    by_kind = {}
    for d in docs:
        by_kind.setdefault(d["kind"], []).append(d)
    workloads = [d for d in docs if d["kind"] in WORKLOADS]
    pods = [(w, w["spec"]["template"]) for w in workloads]
    services = by_kind.get("Service", [])
    configmaps = {c["metadata"]["name"] for c in by_kind.get("ConfigMap", [])}
    pvcs = {c["metadata"]["name"] for c in by_kind.get("PersistentVolumeClaim", [])}

    for w, t in pods:
        n = f"{w['kind']}/{w['metadata']['name']}"
        spec = t["spec"]
        if not matches(w["spec"]["selector"]["matchLabels"], t["metadata"].get("labels", {})):
            errs.append(f"{n}: selector does not match its pod template")
        psc = spec.get("securityContext", {})
        if not psc.get("runAsNonRoot"):
            errs.append(f"{n}: pod securityContext.runAsNonRoot is not true")
        for c in spec.get("initContainers", []) + spec["containers"]:
            r = c.get("resources", {})
            if "requests" not in r or "memory" not in r.get("limits", {}):
                errs.append(f"{n}/{c['name']}: needs resource requests and a memory limit")
            if c.get("securityContext", {}).get("allowPrivilegeEscalation") is not False:
                errs.append(f"{n}/{c['name']}: allowPrivilegeEscalation must be false")
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef", {}).get("name")
                if ref and ref not in EXTERNAL_SECRETS:
                    errs.append(f"{n}/{c['name']}: env {e['name']}: Secret {ref} is neither rendered nor documented")
            for e in c.get("envFrom", []):
                ref = e.get("configMapRef", {}).get("name")
                if ref and ref not in configmaps:
                    errs.append(f"{n}/{c['name']}: envFrom ConfigMap {ref} is not rendered")
        for c in spec["containers"]:
            for p in ("readinessProbe", "livenessProbe"):
                if p not in c:
                    errs.append(f"{n}/{c['name']}: no {p}")
        for v in spec.get("volumes", []):
            if "configMap" in v and v["configMap"]["name"] not in configmaps:
                errs.append(f"{n}: volume {v['name']}: ConfigMap {v['configMap']['name']} is not rendered")
            if "secret" in v and v["secret"]["secretName"] not in EXTERNAL_SECRETS:
                errs.append(f"{n}: volume {v['name']}: Secret {v['secret']['secretName']} is neither rendered nor documented")
            if "persistentVolumeClaim" in v and v["persistentVolumeClaim"]["claimName"] not in pvcs:
                errs.append(f"{n}: volume {v['name']}: PVC {v['persistentVolumeClaim']['claimName']} is not rendered")

    def pods_for(selector):
        return [(w, t) for w, t in pods if matches(selector, t["metadata"].get("labels", {}))]

    def port_names(t):
        return {p.get("name") for c in t["spec"]["containers"] for p in c.get("ports", [])}

    for s in services:
        n = f"Service/{s['metadata']['name']}"
        sel = pods_for(s["spec"].get("selector", {}))
        if not sel:
            errs.append(f"{n}: selects no pod template")
        for p in s["spec"]["ports"]:
            tp = p.get("targetPort")
            if isinstance(tp, str) and any(tp not in port_names(t) for _, t in sel):
                errs.append(f"{n}: targetPort {tp} is not a container port of the selected pods")

    for sm in by_kind.get("ServiceMonitor", []):
        n = f"ServiceMonitor/{sm['metadata']['name']}"
        svc = [s for s in services if matches(sm["spec"]["selector"]["matchLabels"], s["metadata"].get("labels", {}))]
        if not svc:
            errs.append(f"{n}: selects no Service")
        for ep in sm["spec"]["endpoints"]:
            if not any(ep["port"] in {p.get("name") for p in s["spec"]["ports"]} for s in svc):
                errs.append(f"{n}: port {ep['port']} is not a port of the selected Services")

    for pdb in by_kind.get("PodDisruptionBudget", []):
        if not pods_for(pdb["spec"]["selector"]["matchLabels"]):
            errs.append(f"PodDisruptionBudget/{pdb['metadata']['name']}: selects no pods")

    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    for h in by_kind.get("HorizontalPodAutoscaler", []):
        n = f"HorizontalPodAutoscaler/{h['metadata']['name']}"
        ref = h["spec"]["scaleTargetRef"]
        if (ref["kind"], ref["name"]) not in names:
            errs.append(f"{n}: scale target {ref['kind']}/{ref['name']} is not rendered")
        for m in h["spec"].get("metrics", []):
            if m["type"] == "Pods" and m["pods"]["metric"]["name"] not in AUTOSCALER_METRICS:
                errs.append(f"{n}: metric {m['pods']['metric']['name']} is not one of {sorted(AUTOSCALER_METRICS)}")

    decode = [w for w in workloads if w["metadata"]["name"] == "baton-decode"]
    if not decode or decode[0]["kind"] != "StatefulSet":
        errs.append("baton-decode must be a StatefulSet")
    else:
        d = decode[0]
        if (("Service", d["spec"]["serviceName"]) not in names):
            errs.append("StatefulSet/baton-decode: serviceName is not a rendered Service")
        spec = d["spec"]["template"]["spec"]
        c = [c for c in spec["containers"] if c["name"] == "decode"][0]
        cmd = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
        if "drain" not in cmd:
            errs.append("StatefulSet/baton-decode: the preStop hook does not run `baton drain`")
        else:
            t = duration_s(cmd[cmd.index("--timeout") + 1]) if "--timeout" in cmd else 60
            grace = spec.get("terminationGracePeriodSeconds", 30)
            if t is None or grace < t + 15:
                errs.append(f"StatefulSet/baton-decode: terminationGracePeriodSeconds {grace} leaves no room after a {t} s drain")
        for probe in ("startupProbe", "readinessProbe"):
            if c.get(probe, {}).get("httpGet", {}).get("path") != "/healthz":
                errs.append(f"StatefulSet/baton-decode: {probe} must be GET /healthz (ready once the model is loaded)")

    # The gateways: at least two, on PostgreSQL (SQLite is one writer), which is rendered.
    gw = [w for w in workloads if w["metadata"]["name"] == "baton-gateway"]
    if gw:
        g = gw[0]
        if not isinstance(g["spec"].get("replicas"), int) or g["spec"]["replicas"] < 2 or g["spec"].get("strategy", {}).get("type") == "Recreate":
            errs.append("Deployment/baton-gateway: needs at least 2 replicas and a rolling update (the PostgreSQL store)")
        c = [c for c in g["spec"]["template"]["spec"]["containers"] if c["name"] == "gateway"][0]
        db = next((e for e in c.get("env", []) if e["name"] == "BATON_DB"), None)
        if not db or db.get("valueFrom", {}).get("secretKeyRef", {}).get("name") != "baton-postgres":
            errs.append("Deployment/baton-gateway: BATON_DB must be the PostgreSQL URL from Secret baton-postgres")
        if ("Service", "baton-postgres") not in names:
            errs.append("Deployment/baton-gateway: its PostgreSQL (Service baton-postgres) is not rendered")

    # KV transport ports: reachable from cluster node pods only.
    kv_peer = {"baton.dev/kv-peer": "true"}
    for w, t in pods:
        if matches(kv_peer, t["metadata"].get("labels", {})) and t["metadata"]["labels"].get("app.kubernetes.io/component") not in ("prefill", "decode"):
            errs.append(f"{w['kind']}/{w['metadata']['name']}: only prefill and decode pods may carry baton.dev/kv-peer")
    open_kv = set()
    for np_ in by_kind.get("NetworkPolicy", []):
        n = f"NetworkPolicy/{np_['metadata']['name']}"
        for rule in np_["spec"].get("ingress", []):
            ports = {p.get("port") for p in rule.get("ports", []) if p.get("protocol") == "UDP"}
            kv = ports & KV_PORTS
            if not kv:
                continue
            peers = rule.get("from", [])
            if not peers or any(set(p) != {"podSelector"} or p["podSelector"].get("matchLabels") != kv_peer for p in peers):
                errs.append(f"{n}: KV transport ports {sorted(kv)} must be open to baton.dev/kv-peer pods only")
            open_kv |= kv
    if open_kv != KV_PORTS:
        errs.append(f"NetworkPolicies: KV transport ports {sorted(KV_PORTS - open_kv)} are not opened to cluster nodes")
    if not any(np_["spec"]["podSelector"] == {} for np_ in by_kind.get("NetworkPolicy", [])):
        errs.append("NetworkPolicies: no default-deny policy for the namespace")

    for ing in by_kind.get("Ingress", []):
        if not ing["spec"].get("tls"):
            errs.append(f"Ingress/{ing['metadata']['name']}: no TLS")
        # The public edge routes the chat page and the API only, never /metrics or /debug.
        for rule in ing["spec"].get("rules", []):
            for p in rule.get("http", {}).get("paths", []):
                path, kind = p.get("path", "/"), p.get("pathType", "Prefix")
                covers = [private for private in PRIVATE_PATHS if (private == path if kind == "Exact" else private.startswith(path.rstrip("/") + "/") or private == path)]
                if covers:
                    errs.append(f"Ingress/{ing['metadata']['name']}: path {path} ({kind}) exposes {covers[0]} publicly")
                port = p.get("backend", {}).get("service", {}).get("port", {})
                if port.get("name") == "admin" or port.get("number") == 9080:
                    errs.append(f"Ingress/{ing['metadata']['name']}: path {path} routes to the gateway's admin listener")

    if gpu:
        for w in workloads:
            if w["metadata"]["name"] not in ("baton-decode", "baton-prefill"):
                continue
            spec = w["spec"]["template"]["spec"]
            main = spec["containers"][0]
            lim = main.get("resources", {}).get("limits", {})
            if "nvidia.com/gpu" not in lim or not any(k.startswith("rdma/") for k in lim):
                errs.append(f"{w['kind']}/{w['metadata']['name']}: GPU overlay needs nvidia.com/gpu and rdma/* limits")
            if not spec.get("nodeSelector") or not spec.get("tolerations"):
                errs.append(f"{w['kind']}/{w['metadata']['name']}: GPU overlay needs a nodeSelector and tolerations")
    return errs


def planner_rbac_errors(docs):
    """The planner scales its two pools and does nothing else."""
    errs = []
    binds_planner = lambda b: any(s.get("kind") == "ServiceAccount" and s.get("name") == PLANNER for s in b.get("subjects") or [])
    for b in docs:
        if b["kind"] in ("RoleBinding", "ClusterRoleBinding") and binds_planner(b):
            ref = b.get("roleRef", {})
            if b["kind"] == "ClusterRoleBinding" or ref.get("kind") != "Role" or ref.get("name") != PLANNER:
                errs.append(f"{b['kind']}/{b['metadata']['name']}: binds the planner to {ref.get('kind')}/{ref.get('name')}, not Role/{PLANNER}")
    for r in docs:
        if r["kind"] == "ClusterRole" and r["metadata"]["name"] == PLANNER:
            errs.append(f"ClusterRole/{PLANNER}: the planner gets no cluster-wide role")
        if r["kind"] != "Role" or r["metadata"]["name"] != PLANNER:
            continue
        for i, rule in enumerate(r.get("rules") or []):
            where = f"Role/{PLANNER} rule {i}"
            if rule.get("nonResourceURLs"):
                errs.append(f"{where}: nonResourceURLs")
            extra_verbs = set(rule.get("verbs") or []) - PLANNER_VERBS
            if extra_verbs or not rule.get("verbs"):
                errs.append(f"{where}: verbs {sorted(extra_verbs) or 'none'} beyond get/patch/update")
            names = set(rule.get("resourceNames") or [])
            if not names:
                errs.append(f"{where}: no resourceNames (every workload of the kind)")
            for group in rule.get("apiGroups") or [""]:
                for res in rule.get("resources") or []:
                    allowed = PLANNER_SCALE.get((group, res))
                    if allowed is None:
                        errs.append(f"{where}: {group or 'core'}/{res} is not a pool's scale subresource")
                    elif names - allowed:
                        errs.append(f"{where}: {res} of {sorted(names - allowed)} is not a pool of Baton's")
    return errs


def check(docs, gpu, schema_only=False):
    errors, skipped = schema_errors(docs)
    errors += planner_rbac_errors(docs)
    if schema_only:
        return errors, skipped
    return errors + consistency_errors(docs, gpu), skipped


def rbac_self_test(docs):
    def role(d):
        return next(o for o in d if o["kind"] == "Role" and o["metadata"]["name"] == PLANNER)

    def bind(d):
        return next(o for o in d if o["kind"] == "RoleBinding" and o["metadata"]["name"] == PLANNER)

    breakages = {
        "planner may list": lambda d: role(d)["rules"][0]["verbs"].append("list"),
        "planner reads secrets": lambda d: role(d)["rules"].append({"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]}),
        "planner scales any StatefulSet": lambda d: role(d)["rules"][0].pop("resourceNames"),
        "planner scales the gateway": lambda d: role(d)["rules"][1]["resourceNames"].append("baton-gateway"),
        "planner edits the workload": lambda d: role(d)["rules"][1].__setitem__("resources", ["deployments"]),
        "planner renews any Lease": lambda d: role(d)["rules"][2].pop("resourceNames"),
        "planner creates Leases": lambda d: role(d)["rules"][2]["verbs"].append("create"),
        "planner bound to a ClusterRole": lambda d: bind(d)["roleRef"].update({"kind": "ClusterRole", "name": "edit"}),
        "planner cluster-wide": lambda d: d.append({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": "p"},
                                                     "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "view"},
                                                     "subjects": [{"kind": "ServiceAccount", "name": PLANNER, "namespace": "baton"}]}),
    }
    missed = []
    for what, breakage in breakages.items():
        broken = copy.deepcopy(docs)
        breakage(broken)
        errors = planner_rbac_errors(broken)
        print(f"  self-test: {what}: {'caught: ' + errors[0] if errors else 'NOT CAUGHT'}")
        if not errors:
            missed.append(what)
    return missed


def self_test(docs, gpu):
    def find(objs, kind, name):
        return next(o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name)

    def decode_container(d):
        return d["spec"]["template"]["spec"]["containers"][0]

    breakages = {
        "unknown field": lambda d: find(d, "StatefulSet", "baton-decode")["spec"].__setitem__("replica", 2),
        "wrong type": lambda d: find(d, "Deployment", "baton-gateway")["spec"].__setitem__("replicas", "one"),
        "one gateway": lambda d: find(d, "Deployment", "baton-gateway")["spec"].__setitem__("replicas", 1),
        "gateway on SQLite": lambda d: find(d, "Deployment", "baton-gateway")["spec"]["template"]["spec"]["containers"][0]["env"].__setitem__(0, {"name": "BATON_DB", "value": "/data/baton-gateway.db"}),
        "no PostgreSQL": lambda d: d.remove(find(d, "Service", "baton-postgres")),
        "unknown kind": lambda d: d.append({"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}}),
        "no readiness probe": lambda d: decode_container(find(d, "StatefulSet", "baton-decode")).pop("readinessProbe"),
        "no preStop drain": lambda d: decode_container(find(d, "StatefulSet", "baton-decode")).pop("lifecycle"),
        "short grace period": lambda d: find(d, "StatefulSet", "baton-decode")["spec"]["template"]["spec"].__setitem__("terminationGracePeriodSeconds", 30),
        "service selects nothing": lambda d: find(d, "Service", "baton-gateway")["spec"]["selector"].__setitem__("app.kubernetes.io/component", "gw"),
        "KV port open to all": lambda d: find(d, "NetworkPolicy", "baton-decode")["spec"]["ingress"][0].pop("from"),
        "HPA metric renamed": lambda d: find(d, "HorizontalPodAutoscaler", "baton-prefill")["spec"]["metrics"][0]["pods"]["metric"].__setitem__("name", "queue"),
        "ServiceMonitor port": lambda d: find(d, "ServiceMonitor", "baton-decode")["spec"]["endpoints"][0].__setitem__("port", "metrics"),
        "admin listener on the public edge": lambda d: find(d, "Ingress", "baton-gateway")["spec"]["rules"][0]["http"]["paths"][1]["backend"]["service"]["port"].update({"name": "admin"}),
        "metrics on the public edge": lambda d: find(d, "Ingress", "baton-gateway")["spec"]["rules"][0]["http"]["paths"][0].update({"path": "/", "pathType": "Prefix"}),
    }
    if gpu:
        breakages["no GPU request"] = lambda d: decode_container(find(d, "StatefulSet", "baton-decode"))["resources"]["limits"].pop("nvidia.com/gpu")
    missed = []
    for what, breakage in breakages.items():
        broken = copy.deepcopy(docs)
        breakage(broken)
        errors, _ = check(broken, gpu)
        print(f"  self-test: {what}: {'caught: ' + errors[0] if errors else 'NOT CAUGHT'}")
        if not errors:
            missed.append(what)
    return missed


def main(argv):
    gpu = "--gpu" in argv
    selftest = "--self-test" in argv
    schema_only = "--schema-only" in argv
    files = [a for a in argv if not a.startswith("--")]
    if len(files) != 1:
        sys.exit(__doc__)
    with open(files[0]) as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    errors, skipped = check(docs, gpu, schema_only)
    kinds = sorted({d["kind"] for d in docs})
    print(f"{files[0]}: {len(docs)} objects ({', '.join(kinds)})")
    print(f"  strict schema check against Kubernetes {KUBE_VERSION}: {len(docs) - len(skipped)} objects")
    if skipped:
        print(f"  not in the Kubernetes schemas (CRD kinds; required fields checked only): {', '.join(skipped)}")
    for e in errors:
        print(f"  error: {e}")
    if errors:
        return 1
    if selftest:
        missed = rbac_self_test(docs) if schema_only else self_test(docs, gpu)
        if missed:
            print(f"  self-test failed: not caught: {', '.join(missed)}")
            return 1
    print("  ok")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
