//! Where model files are cached: the folder scripts/fetch-model.sh fills, found the same
//! way by the binary (its default `--model`) and by every test that needs a real model.

use std::path::PathBuf;

/// `BATON_MODEL_CACHE`, else `$XDG_CACHE_HOME/baton/models`, else
/// `~/.cache/baton/models`; `None` when none of those variables is set.
pub fn model_cache_dir() -> Option<PathBuf> {
    std::env::var_os("BATON_MODEL_CACHE").map(PathBuf::from).or_else(|| {
        std::env::var_os("XDG_CACHE_HOME")
            .map(|x| PathBuf::from(x).join("baton/models"))
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/baton/models")))
    })
}
