//! Chat templates against transformers' renderings, with tools and tool calls, and through the C ABI.

use super::{CpuEngine, asset, data, reference_gguf, tiny_config};
use crate::common::Scratch;
use hostembed::Status;
use hostembed::abi::engine_chat_message;
use hostembed::checkpoint::gguf::GgufValue;
use hostembed::checkpoint::write::{synthetic_weights, write_hf_folder};
use hostembed::ffi::{engine_chat_template, engine_chat_template_json};
use hostembed::tensor::DType;
use hostembed::tokenizer::chat;
use hostembed::tokenizer::chat::ChatMessage;
use std::ffi::CString;
use std::os::raw::c_char;
use std::path::Path;

// ---------------------------------------------------------------------------------------------
// Chat templates

fn template(name: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/tokenizer/templates").join(name);
    std::fs::read_to_string(path).unwrap()
}

/// Llama 3, Llama 3.1, Qwen2.5 and SmolLM2 templates render what transformers' apply_chat_template
/// renders.
#[test]
fn chat_templates_match_transformers() {
    let cases = data("chat_expected.json");
    let cases = cases.as_array().unwrap();
    assert_eq!(cases.len(), 32);
    let today = chat::render("{{ strftime_now('%d %b %Y') }}", &[], false, "", "").unwrap();
    let mut dated = 0;
    let mut names = std::collections::BTreeSet::new();
    for case in cases {
        let name = case["template"].as_str().unwrap();
        names.insert(name);
        let messages: Vec<ChatMessage> = case["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| ChatMessage { role: m["role"].as_str().unwrap(), content: m["content"].as_str().unwrap() })
            .collect();
        let generation = case["add_generation_prompt"].as_bool().unwrap();
        let got = chat::render(
            &template(name),
            &messages,
            generation,
            case["bos_token"].as_str().unwrap(),
            case["eos_token"].as_str().unwrap(),
        )
        .unwrap_or_else(|e| panic!("{name}: {e}"));
        // Llama 3.1 writes the date it renders on: the reference's, here today's.
        let date = case["date"].as_str().unwrap();
        let want = case["text"].as_str().unwrap();
        dated += want.contains(&format!("Today Date: {date}")) as usize;
        let want = want.replace(&format!("Today Date: {date}"), &format!("Today Date: {today}"));
        assert_eq!(got, want, "{name}, {} messages, generation {generation}", messages.len());
    }
    assert_eq!(names.len(), 4);
    assert_eq!(dated, 4, "the Llama 3.1 cases with a system message carry a date");
}

/// What templates use beyond plain Jinja: raise_exception, loop controls, Python string methods,
/// tojson as Python writes it, strftime_now.
#[test]
fn chat_template_functions() {
    let m = [ChatMessage { role: "user", content: "  Hi \"you\"\n" }];
    let render = |t: &str| chat::render(t, &m, false, "<s>", "</s>");
    let e = render("{{ raise_exception('roles must alternate') }}").unwrap_err();
    assert_eq!(e.status, Status::InvalidArgument);
    assert!(e.message.contains("roles must alternate"), "{e}");
    assert_eq!(render("{% for i in [1,2,3,4] %}{% if i == 2 %}{% continue %}{% endif %}{% if i == 4 %}{% break %}{% endif %}{{ i }}{% endfor %}").unwrap(), "13");
    assert_eq!(
        render("{{ messages[0].content.strip() }}|{{ messages[0]['role'].upper() }}|{{ 'a,b'.split(',') | length }}")
            .unwrap(),
        "Hi \"you\"|USER|2"
    );
    // Keys in the message's own order, as Python's json.dumps writes a dict (transformers does not sort them).
    assert_eq!(render("{{ messages[0] | tojson }}").unwrap(), r#"{"role": "user", "content": "  Hi \"you\"\n"}"#);
    assert_eq!(
        render("{{ messages[0] | tojson(sort_keys=true) }}").unwrap(),
        r#"{"content": "  Hi \"you\"\n", "role": "user"}"#
    );
    assert_eq!(
        render("{{ [1, 'é', none, true] | tojson(indent=2) }}").unwrap(),
        "[\n  1,\n  \"é\",\n  null,\n  true\n]"
    );
    assert_eq!(
        render("{{ bos_token }}{{ eos_token }}{{ tools is none }}").unwrap(),
        "<s></s>True",
        "Python's spelling"
    );
    let year = render("{{ strftime_now('%Y') }}").unwrap();
    assert!(year.len() == 4 && year.starts_with("20"), "{year}");
    let e = render("{% if %}").unwrap_err();
    assert_eq!(e.status, Status::BadModel, "{e}");
}

/// Tools and a tool-calling conversation given as JSON reach the template as transformers passes them:
/// Qwen2.5's prints each tool with `tojson` (keys in the caller's order), an assistant's call with its
/// arguments object, and a tool's result as a `<tool_response>`; plain messages render as
/// `render` renders them; JSON that is not an array of objects is refused.
#[test]
fn chat_templates_take_tools_and_tool_calls_as_json() {
    let qwen = template("qwen2.5.jinja");
    let tools = r#"[{"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}}, "required": ["city"]}}}]"#;
    let messages = r#"[{"role": "user", "content": "Paris?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"unit": "c", "city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21"}]"#;
    let got = chat::render_json(&qwen, messages, Some(tools), true, "", "<|im_end|>").unwrap();
    let want = concat!(
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.\n\n# Tools\n\n",
        "You may call one or more functions to assist with the user query.\n\nYou are provided with function ",
        "signatures within <tools></tools> XML tags:\n<tools>\n",
        r#"{"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}}, "required": ["city"]}}}"#,
        "\n</tools>\n\nFor each function call, return a json object with function name and arguments within ",
        "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}",
        "\n</tool_call><|im_end|>\n",
        "<|im_start|>user\nParis?<|im_end|>\n",
        "<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"unit\": \"c\", \"city\": \"Paris\"}}\n</tool_call><|im_end|>\n",
        "<|im_start|>user\n<tool_response>\n21\n</tool_response><|im_end|>\n",
        "<|im_start|>assistant\n",
    );
    assert_eq!(got, want);
    // Without tools the template takes its other branch; plain messages render as `render` does.
    let plain = r#"[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello é"}]"#;
    for name in ["qwen2.5.jinja", "llama3.1.jinja", "smollm2.jinja"] {
        let t = template(name);
        let want = chat::render(
            &t,
            &[ChatMessage { role: "system", content: "Be brief." }, ChatMessage { role: "user", content: "Hello é" }],
            true,
            "<s>",
            "</s>",
        )
        .unwrap();
        assert_eq!(chat::render_json(&t, plain, None, true, "<s>", "</s>").unwrap(), want, "{name}");
    }
    for (messages, tools, why) in [
        ("{", None, "not valid JSON"),
        (r#"{"role": "user"}"#, None, "not a JSON array"),
        ("[1]", None, "messages[0] is not a JSON object"),
        (plain, Some("{}"), "tools is not a JSON array"),
    ] {
        let e = chat::render_json(&qwen, messages, tools, true, "", "").unwrap_err();
        assert_eq!(e.status, Status::InvalidArgument);
        assert!(e.message.contains(why), "{e}");
    }

    // Through C: the GGUF's template, NULL tools, the snprintf contract and NULLs refused.
    let dir = Scratch::new("chat-json-c");
    let gguf = reference_gguf(&dir, "chat.gguf", vec![("tokenizer.chat_template".into(), GgufValue::String(qwen))]);
    let e = CpuEngine::open(&gguf);
    let (m, t) = (CString::new(messages).unwrap(), CString::new(tools).unwrap());
    // SAFETY: a live engine and NUL-terminated JSON; a NULL buffer of 0 is never written.
    let need = unsafe { engine_chat_template_json(e.0, m.as_ptr(), t.as_ptr(), true, std::ptr::null_mut(), 0) };
    assert!(need > 0, "{need}: {}", hostembed::status::last_error());
    let mut buf = vec![0x55 as c_char; need as usize + 1];
    // SAFETY: a live engine, NUL-terminated JSON and buf.len() chars to write.
    let again = unsafe { engine_chat_template_json(e.0, m.as_ptr(), t.as_ptr(), true, buf.as_mut_ptr(), buf.len()) };
    assert_eq!(again, need);
    let text = String::from_utf8(buf[..need as usize].iter().map(|&c| c as u8).collect()).unwrap();
    assert!(
        text.starts_with("<|im_start|>system\nYou are Qwen") && text.contains("<tools>\n{\"type\": \"function\""),
        "{text}"
    );
    // SAFETY: a live engine, NUL-terminated JSON and NULL tools.
    let none = unsafe { engine_chat_template_json(e.0, m.as_ptr(), std::ptr::null(), true, std::ptr::null_mut(), 0) };
    assert!(none > 0 && none < need, "{none} {need}");
    // SAFETY: NULL messages are refused before anything is read.
    let s = unsafe { engine_chat_template_json(e.0, std::ptr::null(), t.as_ptr(), true, std::ptr::null_mut(), 0) };
    assert_eq!(s, -(Status::InvalidArgument as i32));
    // SAFETY: a NULL engine is refused before anything is read.
    let s =
        unsafe { engine_chat_template_json(std::ptr::null(), m.as_ptr(), t.as_ptr(), true, std::ptr::null_mut(), 0) };
    assert_eq!(s, -(Status::InvalidArgument as i32));
}

fn chat_through_c(e: &CpuEngine, messages: &[(&CString, &CString)], generation: bool) -> Result<String, i32> {
    let raw: Vec<engine_chat_message> =
        messages.iter().map(|(r, c)| engine_chat_message { role: r.as_ptr(), content: c.as_ptr() }).collect();
    // SAFETY: a live engine and raw.len() messages of live NUL-terminated strings; a NULL buffer of 0 is never written.
    let need = unsafe { engine_chat_template(e.0, raw.as_ptr(), raw.len(), generation, std::ptr::null_mut(), 0) };
    if need < 0 {
        return Err(need);
    }
    // Too small a buffer: truncated like snprintf, the full length still returned.
    let mut small = vec![0x55 as c_char; 5];
    // SAFETY: a live engine, raw.len() messages of live NUL-terminated strings, and 5 chars to write.
    let again = unsafe { engine_chat_template(e.0, raw.as_ptr(), raw.len(), generation, small.as_mut_ptr(), 5) };
    assert_eq!(again, need);
    assert_eq!(small[4], 0);
    let mut buf = vec![0x55 as c_char; need as usize + 1];
    // SAFETY: a live engine, raw.len() messages of live NUL-terminated strings, and buf.len() chars to write.
    let again = unsafe { engine_chat_template(e.0, raw.as_ptr(), raw.len(), generation, buf.as_mut_ptr(), buf.len()) };
    assert_eq!(again, need);
    assert_eq!(buf[need as usize], 0);
    assert_eq!(&small[..4], &buf[..4]);
    Ok(String::from_utf8(buf[..need as usize].iter().map(|&c| c as u8).collect()).unwrap())
}

/// engine_chat_template renders the GGUF's tokenizer.chat_template and an HF folder's
/// tokenizer_config.json template with the model's BOS text; models without one are UNSUPPORTED.
#[test]
fn c_abi_renders_the_models_chat_template() {
    let dir = Scratch::new("chat-c");
    let llama3 = template("llama3.jinja");
    let gguf =
        reference_gguf(&dir, "chat.gguf", vec![("tokenizer.chat_template".into(), GgufValue::String(llama3.clone()))]);
    let (system, user) = (CString::new("system").unwrap(), CString::new("user").unwrap());
    let (be_brief, hello) = (CString::new("Be brief.").unwrap(), CString::new("Hello é").unwrap());
    let e = CpuEngine::open(&gguf);
    let text = chat_through_c(&e, &[(&system, &be_brief), (&user, &hello)], true).unwrap();
    let want = chat::render(
        &llama3,
        &[ChatMessage { role: "system", content: "Be brief." }, ChatMessage { role: "user", content: "Hello é" }],
        true,
        "<|bos|>",
        "<|eos|>",
    )
    .unwrap();
    assert_eq!(text, want);
    assert!(text.starts_with("<|bos|><|start_header_id|>system"), "{text}");
    assert!(text.ends_with("<|start_header_id|>assistant<|end_header_id|>\n\n"), "{text}");
    // NULLs and bad text are refused by name.
    let bad = engine_chat_message { role: std::ptr::null(), content: hello.as_ptr() };
    // SAFETY: a live engine; the NULL role is refused before anything is written.
    let s = unsafe { engine_chat_template(e.0, &bad, 1, true, std::ptr::null_mut(), 0) };
    assert_eq!(s, -(Status::InvalidArgument as i32));
    assert!(hostembed::status::last_error().contains("messages[0].role"), "{}", hostembed::status::last_error());
    // SAFETY: a live engine; NULL messages with a count of 2 are refused before anything is read.
    let s = unsafe { engine_chat_template(e.0, std::ptr::null(), 2, true, std::ptr::null_mut(), 0) };
    assert_eq!(s, -(Status::InvalidArgument as i32));
    // SAFETY: a NULL engine is refused before anything is read.
    let s = unsafe { engine_chat_template(std::ptr::null(), std::ptr::null(), 0, true, std::ptr::null_mut(), 0) };
    assert_eq!(s, -(Status::InvalidArgument as i32));
    let latin1 = [0xe9u8, 0];
    let bad = engine_chat_message { role: user.as_ptr(), content: latin1.as_ptr() as *const c_char };
    // SAFETY: a live engine and one message of NUL-terminated strings (not UTF-8, which is refused).
    let s = unsafe { engine_chat_template(e.0, &bad, 1, true, std::ptr::null_mut(), 0) };
    assert_eq!(s, -(Status::InvalidArgument as i32));
    drop(e);

    // HF folder: the template and the BOS text from tokenizer_config.json.
    let cfg = tiny_config();
    let hf = dir.0.join("hf");
    std::fs::create_dir_all(&hf).unwrap();
    write_hf_folder(&hf, &cfg, &synthetic_weights(&cfg, 5, DType::F32), 1).unwrap();
    std::fs::copy(asset("tokenizer.json"), hf.join("tokenizer.json")).unwrap();
    let e = CpuEngine::open(&hf);
    assert_eq!(chat_through_c(&e, &[(&user, &hello)], true), Err(-(Status::Unsupported as i32)));
    drop(e);
    let config = serde_json::json!({"chat_template": template("smollm2.jinja"), "bos_token": "<|bos|>"});
    std::fs::write(hf.join("tokenizer_config.json"), config.to_string()).unwrap();
    let e = CpuEngine::open(&hf);
    let text = chat_through_c(&e, &[(&user, &hello)], false).unwrap();
    assert_eq!(
        text,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nHello é<|im_end|>\n"
    );
    // chat_template.jinja beside the weights wins, as transformers reads it.
    std::fs::write(hf.join("chat_template.jinja"), "{{ bos_token }}{{ messages | length }}").unwrap();
    drop(e);
    let e = CpuEngine::open(&hf);
    assert_eq!(chat_through_c(&e, &[(&user, &hello), (&user, &hello)], false).unwrap(), "<|bos|>2");
}
