//! `baton certs`: development certificates for the KV transport's mutual
//! TLS: a cluster CA and one certificate per node, written to a folder.

use anyhow::{Context, Result};
use clap::Args;
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct CertsArgs {
    /// Folder to write ca.pem, ca.key and NODE.pem / NODE.key into.
    #[arg(long, env = "BATON_CERTS_DIR", default_value = "certs")]
    pub out: PathBuf,
    /// Cluster name (the CA's common name).
    #[arg(long, env = "BATON_CLUSTER", default_value = "baton")]
    pub cluster: String,
    /// Node names (each gets a certificate valid for that DNS name).
    #[arg(long, value_delimiter = ',', default_values_t = ["coordinator".to_string(), "prefill-0".to_string(), "decode-0".to_string()])]
    pub nodes: Vec<String>,
}

pub fn run(a: CertsArgs) -> Result<()> {
    let names: Vec<&str> = a.nodes.iter().map(String::as_str).collect();
    let certs = baton_kv_transport::generate_dev_certs(&a.cluster, &names).context("generating certificates")?;
    certs.write_to_dir(&a.out).with_context(|| format!("writing {}", a.out.display()))?;
    println!("wrote a {} cluster CA and {} node certificates to {}", a.cluster, names.len(), a.out.display());
    println!("these are development certificates: keep ca.key private and rotate them for production");
    Ok(())
}
