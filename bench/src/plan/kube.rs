//! `baton plan --apply kubernetes`: the planner's targets written to the pools' scale
//! subresources through the Kubernetes API.
//!
//! In a pod it reads the service account's token (again for every request: projected
//! tokens rotate), the cluster CA and its namespace from
//! `/var/run/secrets/kubernetes.io/serviceaccount`, and calls the API server at
//! `KUBERNETES_SERVICE_HOST:KUBERNETES_SERVICE_PORT` over HTTPS verified against that CA
//! only (the system roots are off; there is no flag to skip verification). It reads and
//! merge-patches `.../{deployments|statefulsets}/NAME/scale` of its own namespace and
//! nothing else; the Role in `deploy/k8s/planner/rbac.yaml` allows exactly that (get,
//! patch, update on the two named workloads' scale subresource), and
//! `deploy/k8s/validate.py` fails if it allows more. Workload and namespace names are
//! checked as DNS-1123 labels before they enter a URL.

use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};

/// Where a pod's service-account credentials are mounted.
pub const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

/// The kinds of workload a pool may be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkloadKind {
    Deployment,
    StatefulSet,
}

impl WorkloadKind {
    fn plural(self) -> &'static str {
        match self {
            WorkloadKind::Deployment => "deployments",
            WorkloadKind::StatefulSet => "statefulsets",
        }
    }
}

/// One pool's workload: `deployment/NAME` or `statefulset/NAME`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Workload {
    pub kind: WorkloadKind,
    pub name: String,
}

impl std::fmt::Display for Workload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.kind {
            WorkloadKind::Deployment => "deployment",
            WorkloadKind::StatefulSet => "statefulset",
        };
        write!(f, "{kind}/{}", self.name)
    }
}

/// A DNS-1123 label: what Kubernetes accepts as a namespace, and safe inside a URL path.
fn dns_label(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b.iter().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b[0] != b'-'
        && b[b.len() - 1] != b'-'
}

impl FromStr for Workload {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let (kind, name) = s.split_once('/').ok_or("want deployment/NAME or statefulset/NAME")?;
        let kind = match kind.to_ascii_lowercase().as_str() {
            "deployment" => WorkloadKind::Deployment,
            "statefulset" => WorkloadKind::StatefulSet,
            other => return Err(format!("{other}: want deployment or statefulset")),
        };
        if !dns_label(name) {
            return Err(format!("{name:?} is not a Kubernetes name (lowercase letters, digits, '-', at most 63)"));
        }
        Ok(Workload { kind, name: name.to_string() })
    }
}

/// The scale subresources of one namespace's workloads, over the verified API.
pub struct KubeScaler {
    api: String,
    namespace: String,
    token_file: PathBuf,
    client: reqwest::Client,
}

impl KubeScaler {
    /// From the pod's service account and the API server's environment variables.
    pub fn in_cluster() -> Result<KubeScaler> {
        let host = std::env::var("KUBERNETES_SERVICE_HOST").context("KUBERNETES_SERVICE_HOST is not set: --apply kubernetes runs in a pod")?;
        let port = std::env::var("KUBERNETES_SERVICE_PORT").unwrap_or_else(|_| "443".into());
        let host = if host.contains(':') { format!("[{host}]") } else { host };
        let dir = PathBuf::from(SERVICE_ACCOUNT_DIR);
        let ca = std::fs::read(dir.join("ca.crt")).with_context(|| format!("reading {}/ca.crt (is the service account token mounted?)", dir.display()))?;
        let namespace = std::fs::read_to_string(dir.join("namespace")).with_context(|| format!("reading {}/namespace", dir.display()))?;
        KubeScaler::new(&format!("https://{host}:{port}"), namespace.trim(), &ca, dir.join("token"))
    }

    /// `api`: `https://host:port`; `ca_pem`: the only roots trusted for it.
    pub fn new(api: &str, namespace: &str, ca_pem: &[u8], token_file: PathBuf) -> Result<KubeScaler> {
        if !api.starts_with("https://") {
            bail!("the Kubernetes API must be https, not {api}");
        }
        if !dns_label(namespace) {
            bail!("namespace {namespace:?} is not a Kubernetes name");
        }
        let ca = reqwest::Certificate::from_pem(ca_pem).context("the cluster CA is not a PEM certificate")?;
        let client = reqwest::Client::builder()
            .tls_built_in_root_certs(false)
            .add_root_certificate(ca)
            .https_only(true)
            .timeout(Duration::from_secs(10))
            .build()?;
        Ok(KubeScaler { api: api.trim_end_matches('/').to_string(), namespace: namespace.to_string(), token_file, client })
    }

    fn url(&self, w: &Workload) -> String {
        format!("{}/apis/apps/v1/namespaces/{}/{}/{}/scale", self.api, self.namespace, w.kind.plural(), w.name)
    }

    fn token(&self) -> Result<String> {
        let t = std::fs::read_to_string(&self.token_file).with_context(|| format!("reading the service-account token {}", self.token_file.display()))?;
        let t = t.trim();
        if t.is_empty() || t.contains(char::is_whitespace) {
            bail!("the service-account token {} is empty or malformed", self.token_file.display());
        }
        Ok(t.to_string())
    }

    /// The namespace the planner runs in (its service account's).
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// One call to `path` under the API with the current token: its status and JSON body,
    /// whatever the status (the Lease election reads 404 and 409 as answers).
    pub(crate) async fn raw(&self, method: reqwest::Method, path: &str, body: Option<&serde_json::Value>) -> Result<(reqwest::StatusCode, serde_json::Value)> {
        let mut req = self.client.request(method, format!("{}{path}", self.api)).bearer_auth(self.token()?);
        if let Some(b) = body {
            req = req.header(reqwest::header::CONTENT_TYPE, "application/json").body(b.to_string());
        }
        let resp = req.send().await.context("calling the Kubernetes API")?;
        let status = resp.status();
        Ok((status, resp.json().await.unwrap_or(serde_json::Value::Null)))
    }

    async fn call(&self, req: reqwest::RequestBuilder, what: &str) -> Result<serde_json::Value> {
        let resp = req.bearer_auth(self.token()?).send().await.with_context(|| format!("{what}: calling the Kubernetes API"))?;
        let status = resp.status();
        let body: serde_json::Value = resp.json().await.unwrap_or(serde_json::Value::Null);
        if !status.is_success() {
            bail!("{what}: the Kubernetes API answered {status}: {}", body["message"].as_str().unwrap_or("(no message)"));
        }
        Ok(body)
    }

    /// The workload's replica count now.
    pub async fn replicas(&self, w: &Workload) -> Result<u32> {
        let v = self.call(self.client.get(self.url(w)), &format!("reading the scale of {w}")).await?;
        let n = v["spec"]["replicas"].as_u64().ok_or_else(|| anyhow!("the scale of {w} has no spec.replicas"))?;
        u32::try_from(n).map_err(|_| anyhow!("the scale of {w} is {n}"))
    }

    /// Sets the workload to `n` replicas; the count before, or `None` when it already was `n`.
    pub async fn set(&self, w: &Workload, n: u32) -> Result<Option<u32>> {
        let now = self.replicas(w).await?;
        if now == n {
            return Ok(None);
        }
        let patch = serde_json::json!({ "spec": { "replicas": n } });
        let req = self.client.patch(self.url(w)).header(reqwest::header::CONTENT_TYPE, "application/merge-patch+json").body(patch.to_string());
        let v = self.call(req, &format!("scaling {w} to {n}")).await?;
        if v["spec"]["replicas"].as_u64() != Some(n as u64) {
            bail!("scaling {w} to {n}: the API answered spec.replicas {}", v["spec"]["replicas"]);
        }
        Ok(Some(now))
    }
}

#[cfg(test)]
#[path = "kube_tests.rs"]
mod tests;
