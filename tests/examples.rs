//! The C example builds with every warning an error against the committed header and prints the
//! seed's plans.

mod native;

/// The seed's 24 GB card at `window` tokens, as examples/fit.c takes it (sizes in MiB where whole).
fn seed_args(window: u32) -> Vec<String> {
    let stream_mib = 564 + window as u64 / 16; // 564 MiB fixed + 64 KiB a token
    [
        "room=22754M".to_string(),
        "weight=14236M".into(),
        format!("embed={}", 248_320u64 * 5_120 * 2),
        "scratch=700M".into(),
        format!("stream={stream_mib}M"),
        "per_token=64K".into(),
        "drafter_weight=1100M".into(),
        "drafter_stream=358M".into(),
        format!("window={window}"),
    ]
    .to_vec()
}

/// examples/fit.c built once for every test in this file.
fn build_fit() -> &'static std::path::Path {
    static EXE: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    EXE.get_or_init(|| {
        let exe = native::scratch("fit-example").join("fit");
        native::build_c_program(&native::repo().join("examples/fit.c"), &exe);
        exe
    })
}

fn run(exe: &std::path::Path, args: &[String]) -> (i32, String, String) {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = native::run(exe, &args);
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status.code().expect("fit exited by a signal"), text(&out.stdout), text(&out.stderr))
}

#[test]
fn fit_example_prints_the_seed_98k_plan() {
    let exe = build_fit();
    let (code, stdout, stderr) = run(exe, &seed_args(98_304));
    assert_eq!(code, 0, "stdout:\n{stdout}\nstderr:\n{stderr}");
    let expected = [
        "placement            host_mapped",
        "streams              1",
        "window               98304",
        "need_bytes           24492638208",
        "on_card_bytes        14272167936",
        "left_bytes           9587130368",
        "stream_bytes         7409238016",
        "embed_host_bytes     2542796800",
        "max_window_on_card   88640",
        "max_window           131536 (host_mapped)",
        "max_window_unmapped  92736",
        "model 13.29 GiB, rows mapped (2.37 GiB in host memory), 1 stream at a 98304-token window, 8.93 GiB left",
    ];
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines, expected, "stdout:\n{stdout}");
}

#[test]
fn fit_example_reports_the_seed_163k_refusal() {
    let exe = build_fit();
    let (code, stdout, stderr) = run(exe, &seed_args(163_840));
    assert_eq!(code, 2, "a refusal exits 2; stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(stdout.contains("streams              0\n"), "{stdout}");
    assert!(
        stdout.contains(
            "model 13.29 GiB, rows mapped (2.37 GiB in host memory), refuses: a 10.90 GiB stream, 8.93 GiB left\n"
        ),
        "{stdout}"
    );
    assert!(stdout.ends_with("refused: a 10.90 GiB stream, 8.93 GiB left\n"), "{stdout}");
}

#[test]
fn fit_example_rejects_bad_arguments() {
    let exe = build_fit();
    let (code, _, stderr) = run(exe, &[]);
    assert_eq!(code, 1);
    assert!(stderr.starts_with("usage: fit room=SIZE"), "{stderr}");
    let mut args = seed_args(98_304);
    args[0] = "room=22754X".into();
    let (code, _, stderr) = run(exe, &args);
    assert_eq!(code, 1);
    assert!(stderr.contains("bad argument 'room=22754X'"), "{stderr}");
    let mut args = seed_args(98_304);
    args[1] = format!("weight={}", u64::MAX);
    args[3] = "scratch=1".into();
    let (code, _, stderr) = run(exe, &args);
    assert_eq!(code, 1);
    assert!(stderr.contains("invalid argument") && stderr.contains("overflows 64 bits"), "{stderr}");
}

/// A random tiny Llama in BF16 with the repo's tokenizer beside it, written under `dir`: the model folder
/// the C examples take. Its heads are `hidden / heads` wide; bos and eos are the tokenizer's own.
fn tiny_model(dir: &std::path::Path, heads: usize, kv_heads: usize, max_position: usize, seed: u64) -> String {
    use hostembed::checkpoint::write::write_synthetic_hf;
    use hostembed::model::ModelConfig;
    use hostembed::tensor::DType;
    use hostembed::tokenizer::Tokenizer;

    let tokenizer_json = native::repo().join("assets/tokenizer.json");
    let tokenizer = Tokenizer::from_json(&tokenizer_json).unwrap();
    let special = |t: &str| tokenizer.token_id(t).unwrap_or_else(|| panic!("no token {t}"));
    let cfg = ModelConfig {
        rope_theta: 10000.0,
        max_position,
        bos: Some(special("<|bos|>")),
        eos: Some(special("<|eos|>")),
        ..ModelConfig::llama(64, 2, heads, kv_heads, 128, tokenizer.vocab_size())
    };
    let model = dir.join("tiny");
    write_synthetic_hf(&model, &cfg, seed, DType::Bf16).unwrap();
    std::fs::copy(&tokenizer_json, model.join("tokenizer.json")).unwrap();
    model.display().to_string()
}

/// examples/batch.c decodes five prompts together on the CPU backend from a tiny model with the repo's
/// tokenizer, each stream with its own seed, min-p and a repetition penalty, and its --check finds every
/// stream's tokens equal to stepping it alone and the pool whole after the resets.
#[test]
fn batch_example_decodes_streams_together_and_checks_them() {
    let dir = native::scratch("batch-example");
    let exe = dir.join("batch");
    native::build_c_program(&native::repo().join("examples/batch.c"), &exe);
    let model = tiny_model(&dir, 4, 2, 256, 7);
    let args = [
        model.as_str(),
        "--backend",
        "cpu",
        "--streams",
        "5",
        "-n",
        "24",
        "--temp",
        "0.9",
        "--min-p",
        "0.05",
        "--repeat-penalty",
        "1.3",
        "--seed",
        "11",
        "--check",
    ];
    let out = native::run(&exe, &args);
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(stdout.contains("KV pool of"), "the start-up line gives the pool: {stdout}");
    for s in 0..5 {
        assert!(stdout.contains(&format!("[stream {s}] ")), "stream {s}'s text: {stdout}");
    }
    assert!(stdout.contains("prompts: ") && stdout.contains("of 5 streams in one call"), "{stdout}");
    let speed = stdout.lines().find(|l| l.starts_with("batch: 5 streams, ")).unwrap_or_else(|| panic!("{stdout}"));
    assert!(speed.ends_with("tok/s aggregate") && speed.contains("up to 5 a call"), "{speed}");
    assert!(stdout.contains("check: every stream's tokens match stepping it alone"), "{stdout}");

    let (code, bad) = (native::run(&exe, &[model.as_str(), "--streams", "0"]), "--streams 0");
    assert_eq!(code.status.code(), Some(2), "{bad}");
    let out = native::run(&exe, &[model.as_str(), "--backend", "tpu"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--backend is cpu, cuda or auto"));
    let out = native::run(&exe, &[model.as_str(), "--tensor-cores", "--check"]);
    assert_eq!(out.status.code(), Some(2), "--check needs batch invariance");
    // The CPU backend is batch invariant whatever the option says.
    let out = native::run(&exe, &[model.as_str(), "--backend", "cpu", "--streams", "3", "-n", "4", "--tensor-cores"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

/// examples/decode.c's --kv: the KV cache type reaches the engine (engine_model_info and the start-up
/// line name it), K and V apart with a comma, and a name that is no type is refused before anything loads.
#[test]
fn decode_example_takes_a_kv_cache_type() {
    let dir = native::scratch("decode-kv");
    let exe = dir.join("decode");
    native::build_c_program(&native::repo().join("examples/decode.c"), &exe);
    // Heads of 32 values: whole blocks of the 8-bit types.
    let model = tiny_model(&dir, 2, 1, 256, 7);
    for (kv, info, pool) in [
        ("q8_0", "KV cache K Q8_0 V Q8_0", "tokens in Q8_0 ("),
        ("fp8_e4m3,f16", "KV cache K FP8_E4M3 V F16", "tokens in K FP8_E4M3, V F16 ("),
        ("default", "KV cache K F32 V F32", "tokens in F32 ("),
    ] {
        let out = native::run(&exe, &[model.as_str(), "--backend", "cpu", "-n", "4", "--kv", kv]);
        let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "--kv {kv}: stdout:\n{stdout}\nstderr:\n{stderr}");
        assert!(stdout.contains(info), "--kv {kv}: {stdout}");
        assert!(stdout.contains("KV pool of") && stdout.contains(pool), "--kv {kv}: {stdout}");
    }
    let out = native::run(&exe, &[model.as_str(), "--backend", "cpu", "--kv", "q4_0"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--kv is default, bf16"), "{:?}", out);
}

/// examples/decode.c's --draft: the drafter is named at start-up, its proposals (the model drafting for
/// itself) are all accepted, the text is the text without it, and --lookup with --draft is refused.
#[test]
fn decode_example_drafts_with_a_model() {
    let dir = native::scratch("decode-draft");
    let exe = dir.join("decode");
    native::build_c_program(&native::repo().join("examples/decode.c"), &exe);
    let model = tiny_model(&dir, 2, 1, 256, 7);
    let text = |out: &std::process::Output| {
        let stdout = String::from_utf8_lossy(&out.stdout).to_string();
        assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{}", String::from_utf8_lossy(&out.stderr));
        stdout
    };
    let args = [model.as_str(), "--backend", "cpu", "-n", "24", "-p", "one two three one two three one two"];
    let plain = text(&native::run(&exe, &args));
    let drafted = text(&native::run(&exe, &[&args[..], &["--draft", model.as_str()]].concat()));
    assert!(drafted.contains("drafter ") && drafted.contains("vocabulary"), "{drafted}");
    let generated = |s: &str| s.lines().skip_while(|l| !l.starts_with("one two")).next().unwrap_or("").to_string();
    assert_eq!(generated(&drafted), generated(&plain), "plain:\n{plain}\ndrafted:\n{drafted}");
    let counts = drafted.lines().find(|l| l.starts_with("drafter: ")).unwrap_or_else(|| panic!("{drafted}"));
    assert!(counts.contains("(100%)"), "{counts}");
    let out = native::run(&exe, &[&args[..], &["--lookup", "--draft", model.as_str()]].concat());
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not both"), "{out:?}");
}

/// examples/decode.c's --regex and --json-schema: a random tiny model's output is held to the regex, or
/// is one JSON value the schema accepts, and ends there; a regex llguidance refuses fails with its message.
#[test]
fn decode_example_holds_its_output_to_a_regex_or_a_schema() {
    let dir = native::scratch("decode-constraint");
    let exe = dir.join("decode");
    native::build_c_program(&native::repo().join("examples/decode.c"), &exe);
    let model = tiny_model(&dir, 2, 1, 512, 11);
    // The text decode prints after the prompt, up to its closing "[end of text ...]" line.
    let output = |args: &[&str]| -> String {
        let mut all = vec![model.as_str(), "--backend", "cpu", "-p", "Answer:", "-n", "200", "--temp", "0.9"];
        all.extend_from_slice(args);
        let out = native::run(&exe, &all);
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(out.status.success(), "{args:?}: {stdout}\n{}", String::from_utf8_lossy(&out.stderr));
        let text = stdout.split_once("Answer:").unwrap().1;
        let (text, rest) = text.split_once("\n\n[").unwrap();
        assert!(rest.starts_with("end of text"), "{args:?}: no end of generation: {stdout}");
        text.to_string()
    };
    let re = "[0-9]{3}-[a-z]{2,4}";
    let text = output(&["--regex", re]);
    let full = regex::Regex::new(&format!("^{re}$")).unwrap();
    assert!(full.is_match(&text), "--regex {re}: {text:?}");
    let schema = dir.join("schema.json");
    std::fs::write(
        &schema,
        r#"{"type":"object","properties":{"n":{"type":"integer","minimum":0,"maximum":99},"ok":{"type":"boolean"}},"required":["n","ok"],"additionalProperties":false}"#,
    )
    .unwrap();
    let text = output(&["--json-schema", schema.to_str().unwrap(), "--seed", "3"]);
    let value: serde_json::Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text:?}"));
    let object = value.as_object().unwrap();
    assert!(object.len() == 2 && object["n"].as_u64().is_some_and(|n| n <= 99) && object["ok"].is_boolean(), "{text}");

    let out = native::run(&exe, &[model.as_str(), "--backend", "cpu", "--regex", "(unclosed"]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("engine_set_constraint (--regex): invalid argument") && stderr.contains("unclosed"),
        "{stderr}"
    );
    let out = native::run(&exe, &[model.as_str(), "--regex", "a", "--json-schema", "s.json"]);
    assert_eq!(out.status.code(), Some(2));
}

/// examples/gen_tiny writes the demo's files; its Q4_K_M file holds llama.cpp's mix (Q4_K matrices, Q6_K
/// for the head and for the attn_v and ffn_down of the layers the recipe picks, F32 norms), every
/// tensor in the format `Recipe::Q4KM` gives it, and the CPU engine decodes it with its tokenizer.
#[test]
fn gen_tiny_writes_a_q4_k_m_mix_that_decodes() {
    use hostembed::checkpoint::Checkpoint;
    use hostembed::checkpoint::write::Recipe;
    use hostembed::tensor::DType;

    let exe = native::profile_dir().join("examples/gen_tiny");
    assert!(exe.is_file(), "{} is missing: cargo test builds the examples", exe.display());
    let dir = native::scratch("gen-tiny");
    let out = native::run(&exe, &[dir.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    for file in ["tiny/model.safetensors", "tiny/tokenizer.json", "tiny.gguf", "tiny-q8_0.gguf", "tiny-q4_k_m.gguf"] {
        assert!(dir.join(file).is_file(), "gen_tiny wrote no {file}");
    }

    let ckpt = Checkpoint::open(&dir.join("tiny-q4_k_m.gguf")).unwrap();
    let mut counts = std::collections::BTreeMap::new();
    for t in ckpt.tensors.values().filter(|t| t.name != hostembed::checkpoint::ROPE_FREQS) {
        assert_eq!(t.dtype, Recipe::Q4KM.dtype(&ckpt.config, &t.name, &t.shape), "{}", t.name);
        *counts.entry(t.dtype.name()).or_insert(0) += 1;
    }
    println!("tiny-q4_k_m.gguf: {counts:?}");
    let head = &ckpt.tensors[hostembed::model::names::LM_HEAD];
    assert_eq!(head.dtype, DType::Q6_K, "the head is Q6_K in Q4_K_M");
    assert!(counts.get("Q4_K").is_some_and(|&n| n > 0), "{counts:?}");
    assert!(counts.get("Q6_K").is_some_and(|&n| n > 1), "Q6_K beyond the head: {counts:?}");
    let q6_in_layers =
        |suffix: &str| ckpt.tensors.values().filter(|t| t.name.ends_with(suffix) && t.dtype == DType::Q6_K).count();
    assert!(q6_in_layers("v_proj.weight") > 0 && q6_in_layers("down_proj.weight") > 0, "{counts:?}");
    assert!(q6_in_layers("v_proj.weight") < ckpt.config.layers, "only some layers' attn_v take Q6_K: {counts:?}");

    let decode = dir.join("decode");
    native::build_c_program(&native::repo().join("examples/decode.c"), &decode);
    let model = dir.join("tiny-q4_k_m.gguf");
    let out = native::run(&decode, &[model.to_str().unwrap(), "-p", "hostembed moves", "-n", "8", "--backend", "cpu"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.lines().any(|l| l.starts_with("decode: ") && l.contains(" tokens in ")), "{stdout}");
}

/// examples/perplexity.c builds with every warning an error, refuses bad arguments with its usage, and
/// scores two chunks of README.md on a tiny model with the repo's tokenizer: running figures, then a
/// finite perplexity.
#[test]
fn perplexity_example_scores_chunks_of_a_text() {
    let dir = native::scratch("perplexity-example");
    let exe = dir.join("perplexity");
    native::build_c_program(&native::repo().join("examples/perplexity.c"), &exe);
    let model = tiny_model(&dir, 4, 2, 256, 7);
    let text = native::repo().join("README.md").display().to_string();

    let out = native::run(&exe, &[model.as_str()]);
    assert_eq!(out.status.code(), Some(2), "too few arguments");
    assert!(String::from_utf8_lossy(&out.stderr).starts_with("usage: "));
    let out = native::run(&exe, &[model.as_str(), text.as_str(), "--ctx", "3"]);
    assert_eq!(out.status.code(), Some(2), "a chunk of 3");

    let args = [model.as_str(), text.as_str(), "--ctx", "64", "--chunks", "2", "--backend", "cpu"];
    let out = native::run(&exe, &args);
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(stdout.starts_with("[1]") && stdout.contains(",[2]"), "{stdout}");
    let line = stdout.lines().find(|l| l.starts_with("perplexity ")).unwrap_or_else(|| panic!("{stdout}"));
    assert!(line.contains("over 62 tokens (2 chunks of 64"), "{line}");
    let ppl: f64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    assert!(ppl.is_finite() && ppl > 1.0, "{line}");
}
