//! The split a GGUF's `tokenizer.ggml.pre` names: each name llama.cpp's converter writes for a
//! byte-level BPE model, mapped to the regular expressions its model's own tokenizer.json splits the
//! text with before BPE (applied in order, every match and every gap between matches a piece of its
//! own), and to the two vocabulary settings llama.cpp ties to the name.
//!
//! Where llama.cpp rewrites a pattern for its own regex engine, the original pattern of the model's
//! tokenizer.json is kept: the `tokenizers` crate runs Oniguruma, which reads them as written.

/// One family of pre-tokenizer names.
pub struct PreTokenizer {
    /// The `tokenizer.ggml.pre` values that select it.
    pub names: &'static [&'static str],
    /// The patterns, in order; empty: GPT-2's own byte-level split.
    pub splits: &'static [&'static str],
    /// A whole word the vocabulary holds is one token, merges or not (Llama 3, Tekken).
    pub ignore_merges: bool,
    /// BOS is prepended when `tokenizer.ggml.add_bos_token` does not say.
    pub add_bos: bool,
}

/// GPT-2's pattern (the `tokenizers` ByteLevel pre-tokenizer's).
pub const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
/// Llama 3's: a letter run may take one leading symbol, digits in groups of up to three.
pub const LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's: Llama 3's with single digits.
pub const QWEN2: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// BLOOM's: runs of anything but whitespace and a few punctuation marks of several scripts.
const BLOOM: &str = r" ?[^(\s|.,!?\x{2026}\x{3002}\x{FF0C}\x{3001}\x{0964}\x{06D4}\x{060C})]+";
/// Cased letters (Lu, Ll, Lt) as DeepSeek LLM's tokenizer.json lists them, by code point.
const DEEPSEEK_LLM_LETTERS: &str = concat!(
    r"\s?[A-Za-z\x{B5}\x{C0}-\x{D6}\x{D8}-\x{F6}\x{F8}-\x{1BA}\x{1BC}-\x{1BF}\x{1C4}-\x{293}\x{295}-\x{2AF}",
    r"\x{370}-\x{373}\x{376}\x{377}\x{37B}-\x{37D}\x{37F}\x{386}\x{388}-\x{38A}\x{38C}\x{38E}-\x{3A1}",
    r"\x{3A3}-\x{3F5}\x{3F7}-\x{481}\x{48A}-\x{52F}\x{531}-\x{556}\x{10A0}-\x{10C5}\x{13A0}-\x{13F5}",
    r"\x{13F8}-\x{13FD}\x{1C90}-\x{1CBA}\x{1CBD}-\x{1CBF}\x{1D00}-\x{1D2B}\x{1D6B}-\x{1D77}\x{1D79}-\x{1D9A}",
    r"\x{1E00}-\x{1F15}\x{1F18}-\x{1F1D}\x{1F20}-\x{1F45}\x{1F48}-\x{1F4D}\x{1F50}-\x{1F57}\x{1F59}\x{1F5B}",
    r"\x{1F5D}\x{1F5F}-\x{1F7D}\x{1F80}-\x{1FB4}\x{1FB6}-\x{1FBC}\x{1FBE}\x{1FC2}-\x{1FC4}\x{1FC6}-\x{1FCC}",
    r"\x{1FD0}-\x{1FD3}\x{1FD6}-\x{1FDB}\x{1FE0}-\x{1FEC}\x{1FF2}-\x{1FF4}\x{1FF6}-\x{1FFC}\x{2102}\x{2107}",
    r"\x{210A}-\x{2113}\x{2115}\x{2119}-\x{211D}\x{2124}\x{2126}\x{2128}\x{212A}-\x{212D}\x{212F}-\x{2134}",
    r"\x{2139}\x{213C}-\x{213F}\x{2145}-\x{2149}\x{214E}\x{2183}\x{2184}\x{2C00}-\x{2C7B}\x{2C7E}-\x{2CE4}",
    r"\x{2CEB}-\x{2CEE}\x{2CF2}\x{2CF3}\x{A640}-\x{A66D}\x{A680}-\x{A69B}\x{A722}-\x{A76F}\x{A771}-\x{A787}",
    r"\x{A78B}-\x{A78E}\x{AB70}-\x{ABBF}\x{FB00}-\x{FB06}\x{FB13}-\x{FB17}\x{FF21}-\x{FF3A}\x{FF41}-\x{FF5A}",
    r"\x{10400}-\x{1044F}\x{104B0}-\x{104D3}\x{104D8}-\x{104FB}\x{10C80}-\x{10CB2}\x{10CC0}-\x{10CF2}",
    r"\x{118A0}-\x{118DF}\x{1E900}-\x{1E943}]+"
);
/// DeepSeek's CJK and Hangul runs.
const DEEPSEEK_CJK: &str = r"[\x{4E00}-\x{9FA5}\x{0800}-\x{4E00}\x{AC00}-\x{D7FF}]+";
/// The word pattern of DeepSeek V3 and Hunyuan dense: letters with marks, a leading ASCII symbol before
/// ASCII letters.
const DEEPSEEK3_WORDS: &str = r##"[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"##;
/// GPT-2's pattern without its last alternative, as llama.cpp lists it after a first split.
const GPT2_WORDS: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
/// Digits in groups of three from the right: the one to three leading digits, then threes.
const DIGITS_BY_THREE_FROM_RIGHT: &str = r"\p{N}{1,3}(?=(?:\p{N}{3})*(?!\p{N}))";

/// Every supported name; the first family is GPT-2's, which a missing or unknown name falls back to.
pub const PRE_TOKENIZERS: &[PreTokenizer] = &[
    PreTokenizer {
        names: &[
            "gpt-2",
            "gpt2",
            "phi-2",
            "jina-es",
            "jina-de",
            "gigachat",
            "jina-v2-es",
            "jina-v2-de",
            "a.x-4.0",
            "mellum",
            "jina-v1-en",
            "jina-v2-code",
            "roberta-bpe",
            "exaone4",
            "mpt",
            "olmo",
            "jais",
            "trillion",
            "granite-docling",
        ],
        splits: &[],
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizer {
        names: &["default"],
        splits: &[r"[\p{P}\$\+<=>\^~\|]+", GPT2_WORDS, r"\p{N}+", r"[0-9][0-9][0-9]"],
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizer {
        names: &["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"],
        splits: &[LLAMA3],
        ignore_merges: true,
        add_bos: true,
    },
    PreTokenizer {
        names: &["dbrx", "smaug-bpe", "glm4", "chatglm-bpe"],
        splits: &[LLAMA3],
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizer {
        names: &["qwen2", "deepseek-r1-qwen", "kormo", "megrez", "stablelm2", "hunyuan", "grok-2"],
        splits: &[QWEN2],
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizer {
        names: &["starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b"],
        splits: &[r"\p{N}", GPT2],
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizer {
        names: &["deepseek-llm"],
        splits: &[
            r"[\r\n]",
            DEEPSEEK_LLM_LETTERS,
            r"\s?[!-/:-~\x{FF01}-\x{FF0F}\x{FF1A}-\x{FF5E}\x{2018}-\x{201F}\x{3000}-\x{3002}]+",
            r"\s+$",
            DEEPSEEK_CJK,
            r"\p{N}+",
        ],
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizer {
        names: &["deepseek-v3", "hunyuan-dense"],
        splits: &[r"\p{N}{1,3}", r"[\x{4E00}-\x{9FA5}\x{3040}-\x{309F}\x{30A0}-\x{30FF}]+", DEEPSEEK3_WORDS],
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizer {
        names: &["deepseek-coder"],
        splits: &[r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", DEEPSEEK_CJK, r"\p{N}"],
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizer {
        names: &["falcon"],
        splits: &[r"[\p{P}\$\+<=>\^~\|`]+", GPT2_WORDS, r"[0-9][0-9][0-9]"],
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizer {
        names: &["poro-chat", "bloom", "gpt3-finnish"],
        splits: &[BLOOM],
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizer { names: &["viking"], splits: &[BLOOM, r"\p{N}"], ignore_merges: false, add_bos: false },
    PreTokenizer {
        names: &["tekken"],
        splits: &[
            r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        ],
        ignore_merges: true,
        add_bos: true,
    },
    PreTokenizer {
        names: &["chameleon"],
        splits: &[
            r"<sentinel:[0-9]+>",
            r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
            r"([\t\n]|    |  )",
            r"\p{N}",
            r"[\p{P}!-/:-@\[-`{-~]",
            GPT2_WORDS,
        ],
        ignore_merges: false,
        add_bos: true,
    },
    PreTokenizer {
        names: &["gpt-4o", "llama4", "minimax-m2"],
        splits: &[
            r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        ],
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizer {
        names: &["kimi-k2"],
        splits: &[concat!(
            r"[\p{Han}]+",
            r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
            r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
            r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
        )],
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizer {
        names: &["superbpe"],
        splits: &[r"\p{N}+", DIGITS_BY_THREE_FROM_RIGHT],
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizer {
        names: &["bailingmoe", "bailingmoe2", "llada-moe"],
        splits: &[
            r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
        ],
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizer {
        names: &["seed-coder"],
        splits: &[
            r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+",
        ],
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizer {
        names: &["afmoe"],
        splits: &[
            DIGITS_BY_THREE_FROM_RIGHT,
            concat!(
                r"[\x{4E00}-\x{9FFF}\x{3400}-\x{4DBF}\x{F900}-\x{FAFF}\x{3040}-\x{309F}\x{30A0}-\x{30FF}\x{FF65}-\x{FF9F}",
                r"\x{2F00}-\x{2FDF}\x{0E00}-\x{0E7F}\x{0E80}-\x{0EFF}\x{1780}-\x{17FF}\x{1000}-\x{109F}\x{AA60}-\x{AA7F}",
                r"\x{A9E0}-\x{A9FF}\x{AC00}-\x{D7AF}\x{1100}-\x{11FF}]+"
            ),
            DEEPSEEK3_WORDS,
        ],
        ignore_merges: false,
        add_bos: false,
    },
];

/// The family of `name`, None for a name no family lists.
pub fn find(name: &str) -> Option<&'static PreTokenizer> {
    PRE_TOKENIZERS.iter().find(|p| p.names.contains(&name))
}

/// What a missing or unknown name gets: GPT-2's split.
pub const FALLBACK: &PreTokenizer = &PRE_TOKENIZERS[0];
