//! Malformed GGUF files, each refused with a message naming the tensor or key at fault; random corruption never panics.

use super::{
    after_string, assert_refused, edited_gguf, get_u64, llama_cfg, put_u32, put_u64, qwen3_cfg, replace_bytes,
    tensor_fields, write_small_gguf,
};
use crate::common::{Rng, Scratch};
use hostembed::Status;
use hostembed::checkpoint::write::{OwnedTensor, synthetic_weights, write_gguf};
use hostembed::checkpoint::{Checkpoint, gguf};
use hostembed::tensor::DType;

// ---------------------------------------------------------------------------------------------
// Malformed GGUF.

#[test]
fn gguf_truncated_after_the_rows() {
    let dir = Scratch::new("gguf-truncated");
    let path = dir.join("cut.gguf");
    write_small_gguf(&path, &llama_cfg(), 1, DType::F16);
    let ckpt = Checkpoint::open(&path).unwrap();
    let rows_end = ckpt.embed().offset + ckpt.embed().bytes;
    drop(ckpt);
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..rows_end]).unwrap();
    assert_refused(Checkpoint::open(&path), Status::BadModel, &["cut.gguf", "run past the end of the file"]);
}

#[test]
fn gguf_header_corruptions_name_what_is_wrong() {
    let dir = Scratch::new("gguf-header");
    let cfg = llama_cfg();
    type Edit = fn(&mut Vec<u8>);
    let cases: [(&str, Edit, Status, &[&str]); 9] = [
        ("magic", |b| b[..4].copy_from_slice(b"GGUX"), Status::BadModel, &["not a GGUF file"]),
        ("version", |b| put_u32(b, 4, 4), Status::BadModel, &["version 4"]),
        ("tensor-count", |b| put_u64(b, 8, 1 << 60), Status::BadModel, &["tensor count"]),
        ("kv-count", |b| put_u64(b, 16, u64::MAX), Status::BadModel, &["metadata count"]),
        // The first key's length.
        ("key-length", |b| put_u64(b, 24, u64::MAX / 2), Status::BadModel, &["metadata entry 0", "string length"]),
        // general.architecture's value: type, then the string's length.
        (
            "value-length",
            |b| {
                let at = after_string(b, "general.architecture");
                put_u64(b, at + 4, 1 << 40);
            },
            Status::BadModel,
            &["key general.architecture", "string length"],
        ),
        (
            "value-type",
            |b| {
                let at = after_string(b, "general.architecture");
                put_u32(b, at, 99);
            },
            Status::BadModel,
            &["key general.architecture", "unknown value type 99"],
        ),
        (
            "alignment",
            |b| {
                let at = after_string(b, "general.alignment");
                put_u32(b, at + 4, 48);
            },
            Status::BadModel,
            &["general.alignment", "power of two"],
        ),
        (
            "dims",
            |b| {
                let (n_dims, ..) = tensor_fields(b, "blk.0.attn_k.weight");
                put_u32(b, n_dims, 5);
            },
            Status::BadModel,
            &["blk.0.attn_k.weight", "5 dimensions"],
        ),
    ];
    for (name, edit, status, needles) in cases {
        let path = edited_gguf(&dir, name, &cfg, DType::F16, edit);
        let mut needles = needles.to_vec();
        let file = format!("{name}.gguf");
        needles.push(&file);
        assert_refused(Checkpoint::open(&path), status, &needles);
    }
}

#[test]
fn gguf_tensor_info_corruptions_name_the_tensor() {
    let dir = Scratch::new("gguf-tensors");
    let cfg = llama_cfg();
    type Edit = fn(&mut Vec<u8>);
    let cases: [(&str, DType, Edit, Status, &[&str]); 8] = [
        (
            "misaligned",
            DType::F16,
            |b| {
                let (.., offset) = tensor_fields(b, "blk.0.attn_k.weight");
                let moved = get_u64(b, offset) + 2;
                put_u64(b, offset, moved);
            },
            Status::BadModel,
            &["blk.0.attn_k.weight", "not a multiple of the alignment 32"],
        ),
        (
            "overlap",
            DType::F16,
            |b| {
                let (.., q) = tensor_fields(b, "blk.0.attn_q.weight");
                let (.., k) = tensor_fields(b, "blk.0.attn_k.weight");
                let q_offset = get_u64(b, q);
                put_u64(b, k, q_offset);
            },
            Status::BadModel,
            &["blk.0.attn_q.weight", "blk.0.attn_k.weight", "overlap"],
        ),
        (
            "beyond-end",
            DType::F16,
            |b| {
                let (.., offset) = tensor_fields(b, "output_norm.weight");
                put_u64(b, offset, 1 << 50);
            },
            Status::BadModel,
            &["output_norm.weight", "run past the end of the file"],
        ),
        (
            // A larger row count than the data holds: it runs into the next tensor.
            "size-vs-shape",
            DType::F16,
            |b| {
                let (_, dim0, ..) = tensor_fields(b, "blk.0.attn_q.weight");
                put_u64(b, dim0 + 8, 128);
            },
            Status::BadModel,
            &["blk.0.attn_q.weight", "overlap"],
        ),
        (
            "partial-q8-block",
            DType::Q8_0,
            |b| {
                let (_, dim0, ..) = tensor_fields(b, "blk.0.attn_q.weight");
                put_u64(b, dim0, 48);
            },
            Status::BadModel,
            &["blk.0.attn_q.weight", "rows of 48 values", "not a whole number of Q8_0 blocks"],
        ),
        (
            "unknown-type",
            DType::F16,
            |b| {
                let (.., ty, _) = tensor_fields(b, "blk.1.ffn_up.weight");
                put_u32(b, ty, 99);
            },
            Status::BadModel,
            &["blk.1.ffn_up.weight", "unknown type 99"],
        ),
        (
            // 64 values a row: a quarter of a Q4_K super-block.
            "partial-q4_k-block",
            DType::F16,
            |b| {
                let (.., ty, _) = tensor_fields(b, "blk.1.ffn_up.weight");
                put_u32(b, ty, 12);
            },
            Status::BadModel,
            &["blk.1.ffn_up.weight", "rows of 64 values", "Q4_K blocks (256 values)"],
        ),
        (
            "iq2_xs",
            DType::F16,
            |b| {
                let (.., ty, _) = tensor_fields(b, "blk.1.ffn_up.weight");
                put_u32(b, ty, 17);
            },
            Status::Unsupported,
            &["blk.1.ffn_up.weight", "type IQ2_XS", "supported: F32, F16, BF16, Q8_0, Q4_0"],
        ),
    ];
    for (name, dtype, edit, status, needles) in cases {
        let path = edited_gguf(&dir, name, &cfg, dtype, edit);
        let file = format!("{name}.gguf");
        let mut needles = needles.to_vec();
        needles.push(&file);
        assert_refused(Checkpoint::open(&path), status, &needles);
    }
}

#[test]
fn gguf_missing_tensor_key_and_unknown_architecture() {
    let dir = Scratch::new("gguf-missing");
    let cfg = llama_cfg();
    let path = edited_gguf(&dir, "no-up", &cfg, DType::F16, |b| {
        replace_bytes(b, b"blk.1.ffn_up.weight", b"blk.1.ffn_uq.weight")
    });
    assert_refused(
        Checkpoint::open(&path),
        Status::BadModel,
        &["no-up.gguf", "model.layers.1.mlp.up_proj.weight", "missing"],
    );

    let path = edited_gguf(&dir, "twice", &cfg, DType::F16, |b| {
        replace_bytes(b, b"blk.0.ffn_up.weight", b"blk.1.ffn_up.weight")
    });
    assert_refused(Checkpoint::open(&path), Status::BadModel, &["twice.gguf", "blk.1.ffn_up.weight", "appears twice"]);

    let path = edited_gguf(&dir, "no-key", &cfg, DType::F16, |b| {
        replace_bytes(b, b"llama.embedding_length", b"llama.embedding_lengtX")
    });
    assert_refused(
        Checkpoint::open(&path),
        Status::BadModel,
        &["no-key.gguf", "key llama.embedding_length is missing"],
    );

    let path = edited_gguf(&dir, "key-type", &cfg, DType::F16, |b| {
        let at = after_string(b, "llama.block_count");
        put_u32(b, at, 6); // u32 -> f32, same width
    });
    assert_refused(Checkpoint::open(&path), Status::BadModel, &["key-type.gguf", "llama.block_count", "integer"]);

    let path = edited_gguf(&dir, "arch", &cfg, DType::F16, |b| {
        replace_bytes(b, b"\x05\0\0\0\0\0\0\0llama", b"\x05\0\0\0\0\0\0\0mamba")
    });
    assert_refused(Checkpoint::open(&path), Status::Unsupported, &["arch.gguf", "\"mamba\""]);

    // A tensor of the wrong shape: named with both shapes.
    let mut tensors = synthetic_weights(&cfg, 1, DType::F16);
    let k = tensors.iter_mut().find(|t| t.name == "model.layers.1.self_attn.k_proj.weight").unwrap();
    *k = OwnedTensor::from_f32(&k.name, DType::F16, &[64, 64], &vec![0.5; 64 * 64]).unwrap();
    let path = dir.join("shape.gguf");
    write_gguf(&path, &cfg, &tensors, &[]).unwrap();
    assert_refused(
        Checkpoint::open(&path),
        Status::BadModel,
        &["shape.gguf", "model.layers.1.self_attn.k_proj.weight", "[64, 64]", "[32, 64]"],
    );

    assert_refused(Checkpoint::open(&dir.join("absent.gguf")), Status::IoError, &["absent.gguf"]);
    std::fs::write(dir.join("empty.gguf"), b"").unwrap();
    assert_refused(Checkpoint::open(&dir.join("empty.gguf")), Status::BadModel, &["empty.gguf", "not a GGUF file"]);
}

/// Truncation at every header length and random byte flips: the reader returns, never panics, and a
/// refusal always names the file.
#[test]
fn gguf_random_corruption_never_panics() {
    let mut rng = Rng::fresh("gguf_random_corruption_never_panics");
    let dir = Scratch::new("gguf-fuzz");
    let good = dir.join("good.gguf");
    write_small_gguf(&good, &qwen3_cfg(), 2, DType::Q8_0);
    let bytes = std::fs::read(&good).unwrap();
    let header_end = gguf::parse(&bytes, "good").unwrap().data_start;
    let path = dir.join("bad.gguf");
    let check = |mutated: &[u8]| {
        std::fs::write(&path, mutated).unwrap();
        if let Err(e) = Checkpoint::open(&path) {
            assert!(e.message.contains("bad.gguf"), "{e}");
            assert!(matches!(e.status, Status::BadModel | Status::Unsupported), "{e}");
        }
    };
    for cut in (0..header_end).step_by(7).chain([bytes.len() - 1]) {
        check(&bytes[..cut]);
    }
    for _ in 0..300 {
        let mut mutated = bytes.clone();
        for _ in 0..1 + rng.below(4) {
            let at = rng.below(header_end as u64) as usize;
            mutated[at] = rng.next_u64() as u8;
        }
        check(&mutated);
    }
}
