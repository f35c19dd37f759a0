//! Chat templates: the model's own Jinja template (GGUF `tokenizer.chat_template`, an HF folder's
//! tokenizer_config.json `chat_template` or chat_template.jinja) rendered with `minijinja` the way
//! transformers' `apply_chat_template` renders it: blocks trimmed and left-stripped, `break` and
//! `continue`, `raise_exception`, `strftime_now`, a `tojson` that writes what Python's `json.dumps`
//! writes, Python's string and dict methods, and `bos_token` / `eos_token` in the context. Messages
//! come as roles and texts, or as JSON with the tools (`render_json`) for templates that call tools.

use crate::status::{Error, Result, Status};
use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, ErrorKind};
/// One message of a conversation.
#[derive(Clone, Copy, Debug)]
pub struct ChatMessage<'a> {
    pub role: &'a str,
    pub content: &'a str,
}

/// The text the template makes of `messages`; with `add_generation_prompt`, ending where the
/// assistant's reply begins. BAD_MODEL for a template that does not parse, INVALID_ARGUMENT for
/// messages the template refuses (its `raise_exception`) or fails on.
pub fn render(
    template: &str,
    messages: &[ChatMessage],
    add_generation_prompt: bool,
    bos_token: &str,
    eos_token: &str,
) -> Result<String> {
    let messages =
        messages.iter().map(|m| minijinja::context! { role => m.role, content => m.content }).collect::<Vec<_>>();
    render_values(template, Value::from(messages), Value::from(()), add_generation_prompt, bos_token, eos_token)
}

/// As `render`, with the messages and the tools given as JSON the way transformers'
/// `apply_chat_template(messages, tools=tools)` receives them: `messages` an array of message objects
/// passed to the template as they are (an assistant's `tool_calls`, a tool message's `tool_call_id`,
/// any other field), `tools` an array (OpenAI's `{"type": "function", "function": {...}}` objects)
/// or None for the template's `tools` being none. Objects keep their keys' order. INVALID_ARGUMENT
/// for JSON that does not parse or is not an array (of objects, for the messages).
pub fn render_json(
    template: &str,
    messages: &str,
    tools: Option<&str>,
    add_generation_prompt: bool,
    bos_token: &str,
    eos_token: &str,
) -> Result<String> {
    let parse = |json: &str, what: &str| -> Result<Value> {
        let v: Value = serde_json::from_str(json)
            .map_err(|e| Error::new(Status::InvalidArgument, format!("{what} is not valid JSON: {e}")))?;
        if v.kind() != minijinja::value::ValueKind::Seq {
            return Err(Error::new(Status::InvalidArgument, format!("{what} is not a JSON array")));
        }
        Ok(v)
    };
    let messages = parse(messages, "messages")?;
    for (i, m) in messages.try_iter().map_err(|e| Error::new(Status::InvalidArgument, e.to_string()))?.enumerate() {
        if m.kind() != minijinja::value::ValueKind::Map {
            return Err(Error::new(Status::InvalidArgument, format!("messages[{i}] is not a JSON object")));
        }
    }
    let tools = match tools {
        Some(json) => parse(json, "tools")?,
        None => Value::from(()),
    };
    render_values(template, messages, tools, add_generation_prompt, bos_token, eos_token)
}

fn render_values(
    template: &str,
    messages: Value,
    tools: Value,
    add_generation_prompt: bool,
    bos_token: &str,
    eos_token: &str,
) -> Result<String> {
    let mut env = Environment::new();
    let syntax = minijinja::syntax::SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .build()
        .map_err(|e| Error::new(Status::BadModel, format!("chat template syntax: {e}")))?;
    env.set_syntax(syntax);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime_now);
    env.add_filter("tojson", tojson);
    let compiled = env.template_from_str(template).map_err(|e| {
        Error::new(Status::BadModel, format!("the model's chat template does not parse: {}", describe(&e)))
    })?;
    let context = minijinja::context! {
        messages => messages,
        add_generation_prompt => add_generation_prompt,
        bos_token => bos_token,
        eos_token => eos_token,
        tools => tools,
        documents => Value::from(()),
    };
    compiled
        .render(context)
        .map_err(|e| Error::new(Status::InvalidArgument, format!("the model's chat template failed: {}", describe(&e))))
}

/// The error with its causes, on one line.
fn describe(e: &minijinja::Error) -> String {
    let mut text = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// What templates call to refuse a conversation (e.g. roles out of order).
fn raise_exception(message: String) -> std::result::Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
}

/// The local time now, formatted by C's strftime (Llama 3.1 writes today's date with it).
fn strftime_now(format: String) -> std::result::Result<String, minijinja::Error> {
    let bad = |why: &str| minijinja::Error::new(ErrorKind::InvalidOperation, format!("strftime_now: {why}"));
    let format = std::ffi::CString::new(format).map_err(|_| bad("the format holds a NUL"))?;
    // SAFETY: time with a NULL argument only returns the time.
    let now = unsafe { libc::time(std::ptr::null_mut()) };
    // SAFETY: an all-zero tm is a valid value for localtime_r to overwrite.
    let mut local: libc::tm = unsafe { std::mem::zeroed() };
    // SAFETY: both pointers are to live locals; localtime_r is the thread-safe form.
    if unsafe { libc::localtime_r(&now, &mut local) }.is_null() {
        return Err(bad("no local time"));
    }
    let mut buf = vec![0u8; 256];
    // SAFETY: buf holds buf.len() bytes, the format is NUL-terminated, local was filled above.
    let n = unsafe { libc::strftime(buf.as_mut_ptr() as *mut libc::c_char, buf.len(), format.as_ptr(), &local) };
    buf.truncate(n);
    String::from_utf8(buf).map_err(|_| bad("the result is not UTF-8"))
}

/// Python's `json.dumps(value, ensure_ascii=False, indent=indent, sort_keys=sort_keys)`, which is
/// what transformers' `tojson` runs: ", " and ": " between items without an indent, one item a line
/// with one.
fn tojson(value: Value, indent: Option<Value>, kwargs: Kwargs) -> std::result::Result<String, minijinja::Error> {
    let indent = match indent.or(kwargs.get::<Option<Value>>("indent")?) {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => Some(usize::try_from(v.clone()).map_err(|_| {
            minijinja::Error::new(ErrorKind::InvalidOperation, format!("tojson: indent {v} is not a count"))
        })?),
    };
    let sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(&value)
        .map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let mut out = String::new();
    write_python_json(&json, indent, sort_keys, 0, &mut out);
    Ok(out)
}

fn write_python_json(v: &serde_json::Value, indent: Option<usize>, sort_keys: bool, depth: usize, out: &mut String) {
    use serde_json::Value as J;
    let newline = |out: &mut String, depth: usize| {
        if let Some(width) = indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', width * depth));
        }
    };
    let separator = if indent.is_some() { "," } else { ", " };
    match v {
        J::Null => out.push_str("null"),
        J::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        J::Number(n) => out.push_str(&python_number(n)),
        J::String(s) => write_python_string(s, out),
        J::Array(items) if items.is_empty() => out.push_str("[]"),
        J::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(separator);
                }
                newline(out, depth + 1);
                write_python_json(item, indent, sort_keys, depth + 1, out);
            }
            newline(out, depth);
            out.push(']');
        }
        J::Object(map) if map.is_empty() => out.push_str("{}"),
        J::Object(map) => {
            let mut entries: Vec<_> = map.iter().collect();
            if sort_keys {
                entries.sort_by(|a, b| a.0.cmp(b.0));
            }
            out.push('{');
            for (i, (key, item)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push_str(separator);
                }
                newline(out, depth + 1);
                write_python_string(key, out);
                out.push_str(": ");
                write_python_json(item, indent, sort_keys, depth + 1, out);
            }
            newline(out, depth);
            out.push('}');
        }
    }
}

/// Python writes whole floats with ".0" and other floats by their shortest round trip, as Rust does.
fn python_number(n: &serde_json::Number) -> String {
    match n.as_f64() {
        Some(f) if n.is_f64() && f.is_finite() && f.fract() == 0.0 && f.abs() < 1e16 => format!("{f:.1}"),
        _ => n.to_string(),
    }
}

fn write_python_string(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}
