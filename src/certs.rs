//! `baton certs`: development certificates for the cluster: a CA and one certificate
//! per process, each naming the identity (role and name) the internal plane and the KV
//! transport authenticate.

use anyhow::{Context, Result};
use clap::Args;
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct CertsArgs {
    /// Folder to write ca.pem and NAME.pem / NAME.key into (mounted by every process).
    #[arg(long, env = "BATON_CERTS_DIR", default_value = "certs")]
    pub out: PathBuf,
    /// Where to keep the CA's private key, which signs new identities (mode 0600). Without
    /// it the key is discarded: keep it out of the folder the processes mount.
    #[arg(long)]
    pub ca_key_out: Option<PathBuf>,
    /// Cluster name (the CA's common name).
    #[arg(long, env = "BATON_CLUSTER", default_value = "baton")]
    pub cluster: String,
    /// One certificate per entry: `ROLE:NAME` (roles: gateway, coordinator, prefill, decode,
    /// operator), or a name starting with its role (`decode-0`, `gateway`), or a full
    /// identity name (`pod-3.decode.baton`).
    #[arg(long, value_delimiter = ',', default_values_t = ["coordinator".to_string(), "gateway".to_string(), "prefill-0".to_string(), "decode-0".to_string(), "operator".to_string()])]
    pub nodes: Vec<String>,
}

pub fn run(a: CertsArgs) -> Result<()> {
    let names: Vec<&str> = a.nodes.iter().map(String::as_str).collect();
    let certs = baton_kv_transport::generate_dev_certs(&a.cluster, &names).context("generating certificates")?;
    certs.write_to_dir(&a.out, false).with_context(|| format!("writing {}", a.out.display()))?;
    for n in &certs.nodes {
        match &n.identity {
            Some(id) => println!("{}: {} ({})", n.name, id.dns_name(), id.role()),
            None => println!("{}: no role (usable on the KV transport only)", n.name),
        }
    }
    if let Some(path) = &a.ca_key_out {
        write_secret(path, &certs.ca_key_pem).with_context(|| format!("writing {}", path.display()))?;
        println!("CA key: {} (keep it private; it signs new identities)", path.display());
    } else {
        println!("CA key discarded (pass --ca-key-out to keep it)");
    }
    println!("wrote a {} cluster CA and {} certificates to {}", a.cluster, names.len(), a.out.display());
    Ok(())
}

fn write_secret(path: &std::path::Path, text: &str) -> std::io::Result<()> {
    use std::io::Write;
    let mut o = std::fs::OpenOptions::new();
    o.write(true).create(true).truncate(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        o.mode(0o600);
    }
    o.open(path)?.write_all(text.as_bytes())
}
