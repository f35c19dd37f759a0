/* Decodes a prompt with hostembed: loads the model where it fits, streams the text as it decodes, and
 * ends with prompt and decode tokens per second. BOS goes first when the model says so; decoding stops
 * at any of the model's end-of-generation tokens. With --chat the prompt is a user message (after an
 * optional --system message) put in the model's own chat template.
 *
 *   decode MODEL [-p PROMPT] [-n TOKENS] [--context N] [--temp T] [--seed S] [--room BYTES]
 *          [--backend cpu|cuda|auto] [--kv TYPE[,VTYPE]] [--chat [--system TEXT]]
 *          [--lookup | --draft DRAFTER] [--json-schema FILE | --regex RE]
 *
 * --kv keeps the KV cache in TYPE (default, bf16, f16, f32, q8_0, fp8_e4m3), K and V alike, or K in
 * TYPE and V in VTYPE: an 8-bit cache halves every stream, so a longer window fits.
 * --json-schema holds the output to one JSON value the schema in FILE accepts, --regex to text the
 * regular expression RE matches whole (engine_set_constraint).
 *
 * --lookup decodes with prompt lookup (ENGINE_DRAFT_NGRAM): each step proposes the tokens that followed
 * the text's last few tokens where they occurred before, the model checks them all in one step, and
 * the output is the same; the end line reports how many proposals were accepted.
 * --draft DRAFTER decodes with a drafter model (ENGINE_DRAFT_MODEL): DRAFTER, a smaller checkpoint or a
 * quantized copy sharing MODEL's vocabulary, loaded beside it, proposes its greedy tokens each step.
 */
#define _POSIX_C_SOURCE 200809L
#include "hostembed.h"
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static void usage(const char *program) {
    fprintf(stderr,
            "usage: %s MODEL [-p PROMPT] [-n TOKENS] [--context N] [--temp T] [--seed S] [--room BYTES]\n"
            "       [--backend cpu|cuda|auto] [--kv TYPE[,VTYPE]] [--chat [--system TEXT]]\n"
            "       [--lookup | --draft DRAFTER] [--json-schema FILE | --regex RE]\n"
            "--draft: DRAFTER (sharing MODEL's vocabulary) proposes tokens that MODEL checks in one step.\n"
            "TYPE is default, bf16, f16, f32, q8_0 or fp8_e4m3 (the KV cache; VTYPE for V apart).\n"
            "--json-schema / --regex hold the output to the JSON schema in FILE / to the regular expression RE.\n"
            "MODEL is an HF folder (config.json + safetensors) or a .gguf file.\n",
            program);
}

static double seconds_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* The whole of the file at `path`, NUL-terminated, its length in *len; NULL (with a message) on failure. */
static char *read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (f == NULL) {
        fprintf(stderr, "decode: cannot open %s: %s\n", path, strerror(errno));
        return NULL;
    }
    size_t cap = 4096, n = 0;
    char *text = malloc(cap);
    while (text != NULL) {
        n += fread(text + n, 1, cap - n - 1, f);
        if (n < cap - 1) break;
        char *grown = realloc(text, cap * 2);
        if (grown == NULL) {
            free(text);
            text = NULL;
            break;
        }
        text = grown;
        cap *= 2;
    }
    int failed = ferror(f);
    fclose(f);
    if (text == NULL || failed) {
        fprintf(stderr, "decode: cannot read %s\n", path);
        free(text);
        return NULL;
    }
    text[n] = '\0';
    *len = n;
    return text;
}

/* Prints the failed call, its status and the library's message; returns 1 for main. */
static int fail(const char *what, engine_status status) {
    fprintf(stderr, "decode: %s: %s: %s\n", what, engine_status_str(status), engine_last_error());
    return 1;
}

/* The library's log lines (the start-up line among them) go to stdout here, beside the text. */
static void log_to_stdout(void *user, const char *line) {
    (void)user;
    printf("%s\n", line);
    fflush(stdout);
}

static int parse_u64(const char *text, const char *flag, unsigned long long *out) {
    char *end = NULL;
    errno = 0;
    *out = strtoull(text, &end, 10);
    if (errno != 0 || end == text || *end != '\0' || text[0] == '-') {
        fprintf(stderr, "decode: %s wants a non-negative integer, got \"%s\"\n", flag, text);
        return 0;
    }
    return 1;
}

/* The KV cache type a --kv name gives; returns 0 for a name that is none. */
static int parse_kv_type(const char *name, size_t len, engine_kv_type *out) {
    static const struct {
        const char *name;
        engine_kv_type type;
    } types[] = {{"default", ENGINE_KV_DEFAULT}, {"bf16", ENGINE_KV_BF16}, {"f16", ENGINE_KV_F16},
                 {"f32", ENGINE_KV_F32}, {"q8_0", ENGINE_KV_Q8_0}, {"fp8_e4m3", ENGINE_KV_FP8_E4M3},
                 {"fp8", ENGINE_KV_FP8_E4M3}};
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++) {
        if (strlen(types[i].name) == len && strncmp(types[i].name, name, len) == 0) {
            *out = types[i].type;
            return 1;
        }
    }
    return 0;
}

static const char *kv_type_name(engine_kv_type type) {
    switch (type) {
    case ENGINE_KV_DEFAULT: return "default";
    case ENGINE_KV_BF16: return "BF16";
    case ENGINE_KV_F16: return "F16";
    case ENGINE_KV_F32: return "F32";
    case ENGINE_KV_Q8_0: return "Q8_0";
    case ENGINE_KV_FP8_E4M3: return "FP8_E4M3";
    }
    return "?";
}

static const char *placement_name(engine_placement placement) {
    switch (placement) {
    case ENGINE_PLACEMENT_DEVICE: return "on the card";
    case ENGINE_PLACEMENT_HOST_MAPPED: return "in pinned host memory";
    case ENGINE_PLACEMENT_FILE_MAPPED: return "read from the file mapping";
    }
    return "?";
}

/* Writes the piece of `id` to stdout as raw bytes: a byte-level piece may be half a character, and the
 * terminal joins the halves. */
static int print_piece(const engine *e, int32_t id) {
    char small[64];
    int32_t need = engine_token_piece(e, id, small, sizeof small);
    if (need < 0) return fail("engine_token_piece", (engine_status)-need);
    if ((size_t)need < sizeof small) {
        fwrite(small, 1, (size_t)need, stdout);
    } else {
        char *big = malloc((size_t)need + 1);
        if (big == NULL) return fail("malloc", ENGINE_STATUS_NO_ROOM);
        int32_t again = engine_token_piece(e, id, big, (size_t)need + 1);
        if (again < 0) {
            free(big);
            return fail("engine_token_piece", (engine_status)-again);
        }
        fwrite(big, 1, (size_t)again, stdout);
        free(big);
    }
    fflush(stdout);
    return 0;
}

int main(int argc, char **argv) {
    const char *model = NULL;
    const char *prompt = "hostembed moves the embedding rows into host memory, and";
    const char *system_message = NULL;
    const char *schema_path = NULL, *regex = NULL;
    int chat = 0, lookup = 0;
    const char *drafter = NULL;
    unsigned long long max_tokens = 32, context = 0, seed = 0, room = 0;
    double temperature = 0.0;
    engine_options opts = engine_default_options();

    for (int i = 1; i < argc; i++) {
        const char *arg = argv[i];
        const char *value = i + 1 < argc ? argv[i + 1] : NULL;
        int takes_value = strcmp(arg, "-p") == 0 || strcmp(arg, "-n") == 0 || strcmp(arg, "--context") == 0 ||
                          strcmp(arg, "--temp") == 0 || strcmp(arg, "--seed") == 0 || strcmp(arg, "--room") == 0 ||
                          strcmp(arg, "--backend") == 0 || strcmp(arg, "--system") == 0 || strcmp(arg, "--kv") == 0 ||
                          strcmp(arg, "--draft") == 0 || strcmp(arg, "--json-schema") == 0 || strcmp(arg, "--regex") == 0;
        if (strcmp(arg, "-h") == 0 || strcmp(arg, "--help") == 0) {
            usage(argv[0]);
            return 0;
        }
        if (strcmp(arg, "--chat") == 0) {
            chat = 1;
            continue;
        }
        if (strcmp(arg, "--lookup") == 0) {
            lookup = 1;
            continue;
        }
        if (takes_value && value == NULL) {
            fprintf(stderr, "decode: %s needs a value\n", arg);
            return 2;
        }
        if (strcmp(arg, "-p") == 0) {
            prompt = value;
        } else if (strcmp(arg, "--system") == 0) {
            system_message = value;
        } else if (strcmp(arg, "--json-schema") == 0) {
            schema_path = value;
        } else if (strcmp(arg, "--regex") == 0) {
            regex = value;
        } else if (strcmp(arg, "-n") == 0) {
            if (!parse_u64(value, arg, &max_tokens)) return 2;
        } else if (strcmp(arg, "--context") == 0) {
            if (!parse_u64(value, arg, &context)) return 2;
        } else if (strcmp(arg, "--seed") == 0) {
            if (!parse_u64(value, arg, &seed)) return 2;
        } else if (strcmp(arg, "--draft") == 0) {
            drafter = value;
        } else if (strcmp(arg, "--room") == 0) {
            if (!parse_u64(value, arg, &room)) return 2;
        } else if (strcmp(arg, "--temp") == 0) {
            char *end = NULL;
            temperature = strtod(value, &end);
            if (end == value || *end != '\0' || temperature < 0.0) {
                fprintf(stderr, "decode: --temp wants a number >= 0, got \"%s\"\n", value);
                return 2;
            }
        } else if (strcmp(arg, "--backend") == 0) {
            if (strcmp(value, "cpu") == 0) {
                opts.backend = ENGINE_BACKEND_CPU;
            } else if (strcmp(value, "cuda") == 0) {
                opts.backend = ENGINE_BACKEND_CUDA;
            } else if (strcmp(value, "auto") == 0) {
                opts.backend = ENGINE_BACKEND_AUTO;
            } else {
                fprintf(stderr, "decode: --backend is cpu, cuda or auto, not \"%s\"\n", value);
                return 2;
            }
        } else if (strcmp(arg, "--kv") == 0) {
            const char *comma = strchr(value, ',');
            size_t k_len = comma != NULL ? (size_t)(comma - value) : strlen(value);
            const char *v_name = comma != NULL ? comma + 1 : value;
            if (!parse_kv_type(value, k_len, &opts.kv_type_k) ||
                !parse_kv_type(v_name, strlen(v_name), &opts.kv_type_v)) {
                fprintf(stderr, "decode: --kv is default, bf16, f16, f32, q8_0 or fp8_e4m3 (or K,V), not \"%s\"\n",
                        value);
                return 2;
            }
        } else if (arg[0] == '-') {
            fprintf(stderr, "decode: unknown option %s\n", arg);
            usage(argv[0]);
            return 2;
        } else if (model == NULL) {
            model = arg;
            continue;
        } else {
            fprintf(stderr, "decode: one MODEL only (got \"%s\" and \"%s\")\n", model, arg);
            return 2;
        }
        i++;
    }
    if (model == NULL) {
        usage(argv[0]);
        return 2;
    }
    if (system_message != NULL && !chat) {
        fprintf(stderr, "decode: --system goes with --chat\n");
        return 2;
    }
    if (schema_path != NULL && regex != NULL) {
        fprintf(stderr, "decode: --json-schema or --regex, not both\n");
        return 2;
    }
    if (lookup && drafter != NULL) {
        fprintf(stderr, "decode: --lookup or --draft, not both\n");
        return 2;
    }

    if (context > UINT32_MAX) {
        fprintf(stderr, "decode: --context %llu is more than %lu tokens\n", context, (unsigned long)UINT32_MAX);
        return 2;
    }
    opts.context = (uint32_t)context;
    opts.room_bytes = (uint64_t)room;
    opts.temperature = (float)temperature;
    opts.seed = (uint64_t)seed;
    opts.log = log_to_stdout;
    opts.draft_model = drafter;
    opts.log_user = NULL;

    engine *e = NULL;
    engine_status s = engine_init_fit(model, &opts, &e);
    if (s != ENGINE_STATUS_OK) return fail("engine_init_fit", s);

    int rc = 1;
    int32_t *ids = NULL;
    char *chat_text = NULL, *schema = NULL;
    struct engine_model_info info;
    s = engine_model_info(e, &info);
    if (s != ENGINE_STATUS_OK) {
        fail("engine_model_info", s);
        goto done;
    }
    printf("model: vocab %llu, %llu layers, hidden %llu, window %llu, %llu streams, rows %s, KV cache K %s V %s\n",
           (unsigned long long)info.vocab, (unsigned long long)info.layers, (unsigned long long)info.hidden,
           (unsigned long long)info.window, (unsigned long long)info.streams, placement_name(info.placement),
           kv_type_name(info.kv_type_k), kv_type_name(info.kv_type_v));

    /* The constraint holds from the stream's next step on: the first token the prompt's step samples. */
    if (schema_path != NULL) {
        size_t len = 0;
        schema = read_file(schema_path, &len);
        if (schema == NULL) goto done;
        s = engine_set_constraint(e, 0, ENGINE_CONSTRAINT_JSON_SCHEMA, schema, len);
        if (s != ENGINE_STATUS_OK) {
            fail("engine_set_constraint (--json-schema)", s);
            goto done;
        }
    } else if (regex != NULL) {
        s = engine_set_constraint(e, 0, ENGINE_CONSTRAINT_REGEX, regex, strlen(regex));
        if (s != ENGINE_STATUS_OK) {
            fail("engine_set_constraint (--regex)", s);
            goto done;
        }
    }

    /* With --chat, the model's template turns the messages into the prompt; it writes BOS itself when
     * the model wants one, so the text is tokenized as it stands. */
    int32_t add_bos = ENGINE_BOS_MODEL;
    if (chat) {
        engine_chat_message messages[2];
        size_t count = 0;
        if (system_message != NULL) {
            messages[count].role = "system";
            messages[count++].content = system_message;
        }
        messages[count].role = "user";
        messages[count++].content = prompt;
        int32_t need = engine_chat_template(e, messages, count, true, NULL, 0);
        if (need < 0) {
            fail("engine_chat_template", (engine_status)-need);
            goto done;
        }
        chat_text = malloc((size_t)need + 1);
        if (chat_text == NULL) {
            fprintf(stderr, "decode: no memory for a %d-byte chat prompt\n", need);
            goto done;
        }
        int32_t again = engine_chat_template(e, messages, count, true, chat_text, (size_t)need + 1);
        if (again != need) {
            fail("engine_chat_template", again < 0 ? (engine_status)-again : ENGINE_STATUS_INVALID_ARGUMENT);
            goto done;
        }
        prompt = chat_text;
        add_bos = ENGINE_BOS_NO;
    }

    /* Ask for the count first, then tokenize into a buffer of that size. */
    size_t n = 0;
    s = engine_tokenize(e, prompt, strlen(prompt), add_bos, NULL, 0, &n);
    if (s != ENGINE_STATUS_OK) {
        fail("engine_tokenize", s);
        goto done;
    }
    if (n == 0) {
        fprintf(stderr, "decode: the prompt gives no tokens\n");
        goto done;
    }
    ids = malloc(n * sizeof *ids);
    if (ids == NULL) {
        fprintf(stderr, "decode: no memory for %zu prompt tokens\n", n);
        goto done;
    }
    s = engine_tokenize(e, prompt, strlen(prompt), add_bos, ids, n, &n);
    if (s != ENGINE_STATUS_OK) {
        fail("engine_tokenize", s);
        goto done;
    }
    if ((unsigned long long)n >= (unsigned long long)info.window) {
        fprintf(stderr, "decode: the prompt's %zu tokens leave no room in a %llu-token window\n", n,
                (unsigned long long)info.window);
        goto done;
    }

    printf("%s", prompt);
    fflush(stdout);

    int32_t next = -1;
    double start = seconds_now();
    s = engine_step(e, 0, ids, n, &next);
    double prompt_seconds = seconds_now() - start;
    if (s != ENGINE_STATUS_OK) {
        printf("\n");
        fail("engine_step (prompt)", s);
        goto done;
    }

    engine_speculation spec = engine_default_speculation();
    int speculating = lookup || drafter != NULL;
    if (speculating) {
        spec.draft = lookup ? ENGINE_DRAFT_NGRAM : ENGINE_DRAFT_MODEL;
        s = engine_set_speculation(e, 0, &spec);
        if (s != ENGINE_STATUS_OK) {
            printf("\n");
            fail("engine_set_speculation", s);
            goto done;
        }
    }

    /* Each step's tokens are printed, and its last fed back, until an end-of-generation token (eos, end
     * of turn), -n tokens, or the window is full. With --lookup or --draft a step may produce several tokens: the
     * proposals the model accepted, then its own. */
    int32_t out[ENGINE_SPECULATION_MAX_TOKENS + 1];
    int32_t produced[ENGINE_SPECULATION_MAX_TOKENS + 1];
    size_t n_produced = 1;
    produced[0] = next;
    unsigned long long generated = 0, steps = 0, decoded = 0;
    unsigned long long position = n;
    const char *stop = "token limit";
    start = seconds_now();
    for (;;) {
        int finished = 0;
        for (size_t k = 0; k < n_produced && !finished; k++) {
            if (engine_is_eog(e, produced[k])) {
                stop = "end of text";
                finished = 1;
                break;
            }
            if (print_piece(e, produced[k]) != 0) goto done;
            generated++;
            finished = generated >= max_tokens;
        }
        if (finished) break;
        if (position >= (unsigned long long)info.window) {
            stop = "window full";
            break;
        }
        int32_t token = next;
        engine_batch_item item = {.stream = 0, .tokens = &token, .n = 1};
        if (speculating) {
            item.out = out;
            item.out_cap = (size_t)spec.max_tokens + 1;
        }
        s = engine_step_batch(e, &item, 1);
        if (s == ENGINE_STATUS_OK) s = item.status;
        if (s != ENGINE_STATUS_OK) {
            printf("\n");
            fail("engine_step_batch", s);
            goto done;
        }
        steps++;
        decoded += item.n_out;
        position += item.n_out;
        next = item.next;
        n_produced = speculating ? item.n_out : 1;
        if (speculating) {
            memcpy(produced, out, item.n_out * sizeof *out);
        } else {
            produced[0] = next;
        }
    }
    double decode_seconds = seconds_now() - start;

    printf("\n\n[%s after %llu tokens]\n", stop, generated);
    printf("prompt: %zu tokens in %.2f ms, %.1f tok/s\n", n, prompt_seconds * 1e3,
           prompt_seconds > 0 ? (double)n / prompt_seconds : 0.0);
    printf("decode: %llu tokens in %llu steps, %.2f ms, %.1f tok/s\n", decoded, steps, decode_seconds * 1e3,
           decode_seconds > 0 && decoded > 0 ? (double)decoded / decode_seconds : 0.0);
    if (speculating) {
        uint64_t proposed = 0, accepted = 0;
        if (engine_speculation_stats(e, 0, &proposed, &accepted) == ENGINE_STATUS_OK) {
            printf("%s: %llu of %llu proposed tokens accepted (%.0f%%)\n", lookup ? "lookup" : "drafter",
                   (unsigned long long)accepted,
                   (unsigned long long)proposed, proposed > 0 ? 100.0 * (double)accepted / (double)proposed : 0.0);
        }
    }
    rc = 0;

done:
    free(schema);
    free(chat_text);
    free(ids);
    engine_free(e);
    return rc;
}
