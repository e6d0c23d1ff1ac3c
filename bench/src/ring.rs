//! The consistent-hash ring with bounded loads, shared with the coordinator.
//!
//! The ring lives in `baton-coordinator` (`routing::ring`), where the cluster routes
//! decode turns with it; the simulator uses the same code so that what `baton simulate`
//! predicts is what the coordinator does. Its tests (including the 4-node, 1,000-key
//! bound and the fifth-node move share) run in that crate.

pub use baton_coordinator::routing::ring::{Loads, Ring, RingError, Slot};

impl From<RingError> for crate::error::BenchError {
    fn from(e: RingError) -> Self {
        let name = match e {
            RingError::NoVnodes => "vnodes",
            RingError::LoadFactor(_) => "load_factor",
        };
        crate::error::BenchError::InvalidInput { name, why: e.to_string() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::BenchError;

    #[test]
    fn ring_errors_become_invalid_input() {
        let e: BenchError = Ring::new(0, 1.25).unwrap_err().into();
        assert_eq!(e.label(), "invalid_input");
        let e: BenchError = Ring::new(8, 0.5).unwrap_err().into();
        assert!(e.to_string().contains("load_factor"));
    }
}
