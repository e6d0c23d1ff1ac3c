#!/usr/bin/env python3
"""Writes base/prometheusrule.yaml (a PrometheusRule for the Prometheus Operator) from
deploy/prometheus/alerts.yml, the one source of Baton's alert rules.
With --check it writes nothing and fails when the file is out of date (deploy/check.sh)."""
import os
import sys

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "..", "prometheus", "alerts.yml")
TARGET = os.path.join(HERE, "base", "prometheusrule.yaml")
HEADER = (
    "# Generated from deploy/prometheus/alerts.yml by deploy/k8s/sync-alerts.py;\n"
    "# deploy/check.sh fails when the two differ. Edit alerts.yml, then run the script.\n"
)


class Dumper(yaml.SafeDumper):
    pass


def _str(dumper, s):
    return dumper.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s else None)


Dumper.add_representer(str, _str)


def render():
    with open(SOURCE) as f:
        groups = yaml.safe_load(f)["groups"]
    doc = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {
            "name": "baton-alerts",
            "labels": {"app.kubernetes.io/part-of": "baton", "release": "kube-prometheus-stack"},
        },
        "spec": {"groups": groups},
    }
    return HEADER + yaml.dump(doc, Dumper=Dumper, sort_keys=False, width=200)


def main():
    text = render()
    if "--check" in sys.argv[1:]:
        with open(TARGET) as f:
            if f.read() != text:
                print(f"{TARGET} is out of date with {SOURCE}: run python3 deploy/k8s/sync-alerts.py", file=sys.stderr)
                return 1
        print("PrometheusRule baton-alerts matches deploy/prometheus/alerts.yml")
        return 0
    with open(TARGET, "w") as f:
        f.write(text)
    print(f"wrote {TARGET}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
