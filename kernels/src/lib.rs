//! Compute kernels.
