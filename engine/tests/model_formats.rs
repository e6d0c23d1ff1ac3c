//! Loading the same model from GGUF and from a Hugging Face folder gives the
//! same logits; corrupt, truncated and unsupported files are clear errors
//! that name the file and the tensor, never panics.

mod common;

use baton_engine::model::{export_hf, load_gguf, load_hf_dir, ModelError};
use baton_kernels::{Backend, CpuBackend, KvDtype};

fn last_logits<B: Backend>(backend: &B, model: &baton_engine::model::Model<B>, tokens: &[u32]) -> Vec<f32> {
    common::logits_at(backend, model, tokens, &[tokens.len() - 1], KvDtype::F32).remove(0)
}

#[test]
fn hugging_face_export_loads_to_the_same_model() {
    let Some(path) = common::model_path() else { return };
    let dir = tempfile::tempdir().unwrap();
    export_hf(&path, dir.path()).unwrap();
    let backend = CpuBackend::new(2).unwrap();
    let g = load_gguf(&backend, &path).unwrap();
    let h = load_hf_dir(&backend, dir.path()).unwrap();
    assert_eq!(g.model.config, h.model.config);
    let text = g.template.render(&[baton_engine::chat_template::ChatMessage::new("user", "Héllo wörld 👋, how are you? 12345")], true).unwrap();
    assert_eq!(h.template.render(&[baton_engine::chat_template::ChatMessage::new("user", "Héllo wörld 👋, how are you? 12345")], true).unwrap(), text);
    let ids = g.tokenizer.encode(&text, true).unwrap();
    assert_eq!(h.tokenizer.encode(&text, true).unwrap(), ids, "tokenizer.json gives the same IDs");
    let a = last_logits(&backend, &g.model, &ids);
    let b = last_logits(&backend, &h.model, &ids);
    // Same weights; the GGUF path quantizes activations to 8 bits, the f32
    // path does not, so logits agree closely but not bit for bit.
    // The top token is the same unless the first two are a near-tie (this
    // prompt's are 0.04 apart, within the 8-bit activations' error): then
    // each path's choice is still one of the other's near-tied leaders.
    let argmax = |v: &[f32]| v.iter().enumerate().max_by(|x, y| x.1.total_cmp(y.1)).unwrap().0;
    let lead = |v: &[f32]| {
        let top = v[argmax(v)];
        top - v.iter().copied().filter(|&x| x < top).fold(f32::MIN, f32::max)
    };
    if lead(&a) >= 1.0 {
        assert_eq!(argmax(&a), argmax(&b));
    }
    assert!(a[argmax(&b)] >= a[argmax(&a)] - 0.5, "the f32 path's top token is far down the GGUF path's logits");
    assert!(b[argmax(&a)] >= b[argmax(&b)] - 0.5, "the GGUF path's top token is far down the f32 path's logits");
    let max_diff = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
    let scale = a.iter().map(|x| x.abs()).fold(0f32, f32::max);
    assert!(max_diff < 0.05 * scale, "max |diff| {max_diff} vs scale {scale}");
}

#[test]
fn truncated_and_corrupt_files_are_named_errors() {
    let Some(path) = common::model_path() else { return };
    let bytes = std::fs::read(&path).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let backend = CpuBackend::new(1).unwrap();
    // Cut inside the tensor data: the error names the file and a tensor.
    let cut = dir.path().join("cut.gguf");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    let msg = load_gguf(&backend, &cut).err().expect("truncated file must fail").to_string();
    assert!(msg.contains("cut.gguf"), "{msg}");
    assert!(msg.contains(".weight"), "error should name a tensor: {msg}");
    // Cut inside the metadata.
    let head = dir.path().join("head.gguf");
    std::fs::write(&head, &bytes[..4096]).unwrap();
    let msg = load_gguf(&backend, &head).err().expect("must fail").to_string();
    assert!(msg.contains("head.gguf"), "{msg}");
    // Not a GGUF file at all.
    let junk = dir.path().join("junk.gguf");
    std::fs::write(&junk, b"definitely not a model").unwrap();
    let err = load_gguf(&backend, &junk).err().expect("must fail");
    assert!(matches!(err, ModelError::Gguf(_)), "{err}");
    assert!(err.to_string().contains("junk.gguf"));
    // A missing file.
    let msg = load_gguf(&backend, &dir.path().join("absent.gguf")).err().expect("must fail").to_string();
    assert!(msg.contains("absent.gguf"), "{msg}");
}
