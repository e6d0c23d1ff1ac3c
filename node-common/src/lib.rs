//! What the prefill and decode nodes share, so each lives once: the node
//! process shell ([`shell`]: flags, listeners, the internal plane, membership,
//! `/healthz` and `/metrics`, `NodeControl`, shutdown), the engine flags and
//! model loading, the node's side of the KV transport, pulling a warm prefix
//! from a decode node, conversions between `node.proto` and the engine's
//! types, and the engine's series in each node's metrics. A library of the
//! node crates, not a service.

// `Error` is a start-up error, returned once per process (flags, model, listeners), so
// its size costs nothing; boxing every variant would only hide what each one holds.
#![allow(clippy::result_large_err)]
pub mod convert;
pub mod engine_args;
pub mod engine_metrics;
pub mod error;
pub mod http;
pub mod in_flight;
pub mod kv;
pub mod prefix_pull;
pub mod shell;

pub use error::{Error, Result};

/// Declares what a role crate exports besides its role type:
/// `node_role!(Decode, "decode", "DECODE", "72")` makes `Args` and `Config` (the
/// shell's over `Decode`) and `Defaults`: named `decode-0`, listening on 127.0.0.1:7200
/// (gRPC), :7201 (HTTP) and :7202 (KV), each overridable by `BATON_DECODE_LISTEN`,
/// `BATON_DECODE_HTTP_LISTEN`, `BATON_DECODE_KV_LISTEN`.
#[macro_export]
macro_rules! node_role {
    ($role_ty:ident, $role:literal, $env:literal, $port_hundreds:literal) => {
        #[doc = concat!("Flags of `baton ", $role, "`: the node shell's, then [`", stringify!($role_ty), "`]'s.")]
        pub type Args = $crate::shell::Args<$role_ty>;
        #[doc = concat!("A validated ", $role, " node configuration.")]
        pub type Config = $crate::shell::Config<$role_ty>;
        /// This role's defaults of the node shell's flags.
        #[derive(Clone, Debug)]
        pub struct Defaults;
        impl $crate::shell::RoleDefaults for Defaults {
            const NAME: &'static str = concat!($role, "-0");
            const LISTEN_ENV: &'static str = concat!("BATON_", $env, "_LISTEN");
            const LISTEN: &'static str = concat!("127.0.0.1:", $port_hundreds, "00");
            const HTTP_LISTEN_ENV: &'static str = concat!("BATON_", $env, "_HTTP_LISTEN");
            const HTTP_LISTEN: &'static str = concat!("127.0.0.1:", $port_hundreds, "01");
            const KV_LISTEN_ENV: &'static str = concat!("BATON_", $env, "_KV_LISTEN");
            const KV_LISTEN: &'static str = concat!("127.0.0.1:", $port_hundreds, "02");
        }
    };
}
