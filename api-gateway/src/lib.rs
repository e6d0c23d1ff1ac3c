//! Baton API gateway: the user-facing edge (OpenAI-compatible API,
//! conversations, auth, limits, store). It talks to token producers only
//! through [`generator::Generator`], so it runs the same in front of one
//! in-process engine or the cluster.

pub mod generator;
