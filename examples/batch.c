/* Decodes several prompts together from one engine: every prompt goes in one engine_step_batch call,
 * then each step advances every unfinished stream by one token in one call. Prints each stream's text
 * and the aggregate decode speed; --check decodes each stream again alone and compares the tokens.
 *
 *   batch MODEL [-p PROMPT]... [-n TOKENS] [--streams K] [--context N] [--temp T] [--min-p P]
 *         [--repeat-penalty R] [--seed S] [--room BYTES] [--backend cpu|cuda|auto] [--check]
 *         [--tensor-cores]
 *
 * Without -p, K built-in prompts (default 4); stream i samples with seed S + i. --tensor-cores sets
 * options.batch_tensor_cores (CUDA: faster with many streams, no longer batch invariant, so not with
 * --check, which truncates each stream to nothing and decodes it again alone).
 */
#define _POSIX_C_SOURCE 200809L
#include "hostembed.h"
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MAX_STREAMS 64

static const char *const DEFAULT_PROMPTS[] = {
    "hostembed moves the embedding rows into host memory, and",
    "A server with one card can serve",
    "The quick brown fox",
    "Once upon a time",
    "In the beginning",
    "Paged attention keeps",
    "The weights are read once for",
    "Every stream has its own",
};
#define N_DEFAULT_PROMPTS (sizeof DEFAULT_PROMPTS / sizeof DEFAULT_PROMPTS[0])

static void usage(const char *program) {
    fprintf(stderr,
            "usage: %s MODEL [-p PROMPT]... [-n TOKENS] [--streams K] [--context N] [--temp T] [--min-p P]\n"
            "       [--repeat-penalty R] [--seed S] [--room BYTES] [--backend cpu|cuda|auto] [--check]\n"
            "       [--tensor-cores]\n",
            program);
}

static double seconds_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int fail(const char *what, engine_status status) {
    fprintf(stderr, "batch: %s: %s: %s\n", what, engine_status_str(status), engine_last_error());
    return 1;
}

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
        fprintf(stderr, "batch: %s wants a non-negative integer, got \"%s\"\n", flag, text);
        return 0;
    }
    return 1;
}

static int parse_float(const char *text, const char *flag, float *out) {
    char *end = NULL;
    double v = strtod(text, &end);
    if (end == text || *end != '\0' || v < 0.0) {
        fprintf(stderr, "batch: %s wants a number >= 0, got \"%s\"\n", flag, text);
        return 0;
    }
    *out = (float)v;
    return 1;
}

/* One stream: its prompt ids, and the tokens it sampled. */
typedef struct {
    const char *prompt;
    int32_t *ids;
    size_t n_ids;
    int32_t *out;
    size_t n_out;
    int done;
} stream_state;

/* Appends the piece of `id` to stdout as raw bytes. */
static int print_piece(const engine *e, int32_t id) {
    char small[64];
    int32_t need = engine_token_piece(e, id, small, sizeof small);
    if (need < 0) return fail("engine_token_piece", (engine_status)-need);
    if ((size_t)need < sizeof small) {
        fwrite(small, 1, (size_t)need, stdout);
        return 0;
    }
    char *big = malloc((size_t)need + 1);
    if (big == NULL) return fail("malloc", ENGINE_STATUS_NO_ROOM);
    int32_t again = engine_token_piece(e, id, big, (size_t)need + 1);
    if (again >= 0) fwrite(big, 1, (size_t)again, stdout);
    free(big);
    return again < 0 ? fail("engine_token_piece", (engine_status)-again) : 0;
}

/* Whether stream s stops after sampling `next`: eos, the token limit, or a full window. */
static int finished(const stream_state *st, int32_t next, int32_t eos, unsigned long long max_tokens,
                    unsigned long long window) {
    return (eos >= 0 && next == eos) || st->n_out >= max_tokens || st->n_ids + st->n_out >= window;
}

int main(int argc, char **argv) {
    const char *model = NULL;
    const char *prompts[MAX_STREAMS];
    size_t n_prompts = 0;
    unsigned long long max_tokens = 32, n_streams = 4, context = 0, seed = 0, room = 0;
    int check = 0;
    engine_options opts = engine_default_options();
    engine_sampling sampling = engine_default_sampling();

    for (int i = 1; i < argc; i++) {
        const char *arg = argv[i];
        const char *value = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(arg, "-h") == 0 || strcmp(arg, "--help") == 0) {
            usage(argv[0]);
            return 0;
        }
        if (strcmp(arg, "--check") == 0) {
            check = 1;
            continue;
        }
        if (strcmp(arg, "--tensor-cores") == 0) {
            opts.batch_tensor_cores = ENGINE_TRISTATE_YES;
            continue;
        }
        if (arg[0] != '-') {
            if (model != NULL) {
                fprintf(stderr, "batch: one MODEL only (got \"%s\" and \"%s\")\n", model, arg);
                return 2;
            }
            model = arg;
            continue;
        }
        if (value == NULL) {
            fprintf(stderr, "batch: %s needs a value\n", arg);
            return 2;
        }
        int ok = 1;
        if (strcmp(arg, "-p") == 0) {
            if (n_prompts == MAX_STREAMS) {
                fprintf(stderr, "batch: at most %d prompts\n", MAX_STREAMS);
                return 2;
            }
            prompts[n_prompts++] = value;
        } else if (strcmp(arg, "-n") == 0) {
            ok = parse_u64(value, arg, &max_tokens);
        } else if (strcmp(arg, "--streams") == 0) {
            ok = parse_u64(value, arg, &n_streams);
        } else if (strcmp(arg, "--context") == 0) {
            ok = parse_u64(value, arg, &context);
        } else if (strcmp(arg, "--seed") == 0) {
            ok = parse_u64(value, arg, &seed);
        } else if (strcmp(arg, "--room") == 0) {
            ok = parse_u64(value, arg, &room);
        } else if (strcmp(arg, "--temp") == 0) {
            ok = parse_float(value, arg, &sampling.temperature);
        } else if (strcmp(arg, "--min-p") == 0) {
            ok = parse_float(value, arg, &sampling.min_p);
        } else if (strcmp(arg, "--repeat-penalty") == 0) {
            ok = parse_float(value, arg, &sampling.repeat_penalty);
        } else if (strcmp(arg, "--backend") == 0) {
            if (strcmp(value, "cpu") == 0) {
                opts.backend = ENGINE_BACKEND_CPU;
            } else if (strcmp(value, "cuda") == 0) {
                opts.backend = ENGINE_BACKEND_CUDA;
            } else if (strcmp(value, "auto") == 0) {
                opts.backend = ENGINE_BACKEND_AUTO;
            } else {
                fprintf(stderr, "batch: --backend is cpu, cuda or auto, not \"%s\"\n", value);
                return 2;
            }
        } else {
            fprintf(stderr, "batch: unknown option %s\n", arg);
            usage(argv[0]);
            return 2;
        }
        if (!ok) return 2;
        i++;
    }
    if (model == NULL) {
        usage(argv[0]);
        return 2;
    }
    if (check && opts.batch_tensor_cores == ENGINE_TRISTATE_YES) {
        fprintf(stderr, "batch: --check compares with stepping alone, which --tensor-cores gives up\n");
        return 2;
    }
    if (n_prompts > 0) n_streams = n_prompts;
    if (n_streams == 0 || n_streams > MAX_STREAMS || context > UINT32_MAX) {
        fprintf(stderr, "batch: --streams is 1..%d and --context at most %lu\n", MAX_STREAMS,
                (unsigned long)UINT32_MAX);
        return 2;
    }
    for (size_t s = n_prompts; s < n_streams; s++) prompts[s] = DEFAULT_PROMPTS[s % N_DEFAULT_PROMPTS];

    opts.context = (uint32_t)context;
    opts.room_bytes = (uint64_t)room;
    opts.max_streams = (uint32_t)n_streams;
    opts.log = log_to_stdout;
    opts.log_user = NULL;

    engine *e = NULL;
    engine_status s = engine_init_fit(model, &opts, &e);
    if (s != ENGINE_STATUS_OK) return fail("engine_init_fit", s);

    int rc = 1;
    stream_state streams[MAX_STREAMS];
    engine_batch_item items[MAX_STREAMS];
    memset(streams, 0, sizeof streams);
    struct engine_model_info info;
    s = engine_model_info(e, &info);
    if (s != ENGINE_STATUS_OK) {
        fail("engine_model_info", s);
        goto done;
    }
    if (info.streams < n_streams) {
        fprintf(stderr, "batch: the engine admits %u streams, %llu asked\n", info.streams, n_streams);
        goto done;
    }
    uint64_t pool_total = 0, pool_free = 0;
    s = engine_kv_stats(e, &pool_total, &pool_free);
    if (s != ENGINE_STATUS_OK) {
        fail("engine_kv_stats", s);
        goto done;
    }
    printf("model: vocab %u, %u layers, window %u, %llu streams over a KV pool of %llu tokens\n", info.vocab,
           info.layers, info.window, n_streams, (unsigned long long)pool_total);

    for (size_t i = 0; i < n_streams; i++) {
        stream_state *st = &streams[i];
        st->prompt = prompts[i];
        size_t n = 0;
        bool add_bos = info.bos >= 0;
        s = engine_tokenize(e, st->prompt, strlen(st->prompt), add_bos, NULL, 0, &n);
        if (s != ENGINE_STATUS_OK || n == 0 || n >= info.window) {
            if (s != ENGINE_STATUS_OK) fail("engine_tokenize", s);
            else fprintf(stderr, "batch: prompt %zu gives %zu tokens for a %u-token window\n", i, n, info.window);
            goto done;
        }
        st->ids = malloc(n * sizeof *st->ids);
        st->out = malloc((max_tokens + 1) * sizeof *st->out);
        if (st->ids == NULL || st->out == NULL) {
            fprintf(stderr, "batch: no memory for stream %zu\n", i);
            goto done;
        }
        s = engine_tokenize(e, st->prompt, strlen(st->prompt), add_bos, st->ids, n, &n);
        if (s != ENGINE_STATUS_OK) {
            fail("engine_tokenize", s);
            goto done;
        }
        st->n_ids = n;
        engine_sampling mine = sampling;
        mine.seed = seed + i;
        s = engine_set_sampling(e, (uint32_t)i, &mine);
        if (s != ENGINE_STATUS_OK) {
            fail("engine_set_sampling", s);
            goto done;
        }
    }

    /* Every prompt in one call. */
    for (size_t i = 0; i < n_streams; i++) {
        items[i] = (engine_batch_item){.stream = (uint32_t)i, .tokens = streams[i].ids, .n = streams[i].n_ids};
    }
    double start = seconds_now();
    s = engine_step_batch(e, items, n_streams);
    double prompt_seconds = seconds_now() - start;
    if (s != ENGINE_STATUS_OK) {
        fail("engine_step_batch (prompts)", s);
        goto done;
    }
    size_t prompt_tokens = 0;
    for (size_t i = 0; i < n_streams; i++) {
        if (items[i].status != ENGINE_STATUS_OK) {
            fprintf(stderr, "batch: stream %zu's prompt: %s\n", i, engine_status_str(items[i].status));
            goto done;
        }
        stream_state *st = &streams[i];
        prompt_tokens += st->n_ids;
        st->out[st->n_out++] = items[i].next;
        st->done = finished(st, items[i].next, info.eos, max_tokens, info.window);
    }

    /* One token for every unfinished stream per call; finished streams leave the batch. */
    unsigned long long decoded = 0, calls = 0;
    size_t widest = 0;
    start = seconds_now();
    for (;;) {
        size_t k = 0;
        for (size_t i = 0; i < n_streams; i++) {
            stream_state *st = &streams[i];
            if (st->done) continue;
            items[k++] = (engine_batch_item){.stream = (uint32_t)i, .tokens = &st->out[st->n_out - 1], .n = 1};
        }
        if (k == 0) break;
        if (k > widest) widest = k;
        s = engine_step_batch(e, items, k);
        if (s != ENGINE_STATUS_OK) {
            fail("engine_step_batch", s);
            goto done;
        }
        calls++;
        for (size_t j = 0; j < k; j++) {
            stream_state *st = &streams[items[j].stream];
            if (items[j].status != ENGINE_STATUS_OK) {
                fprintf(stderr, "batch: stream %u: %s: %s\n", items[j].stream, engine_status_str(items[j].status),
                        engine_last_error());
                goto done;
            }
            st->out[st->n_out++] = items[j].next;
            decoded++;
            st->done = finished(st, items[j].next, info.eos, max_tokens, info.window);
        }
    }
    double decode_seconds = seconds_now() - start;

    for (size_t i = 0; i < n_streams; i++) {
        stream_state *st = &streams[i];
        printf("\n[stream %zu] %s", i, st->prompt);
        size_t shown = st->n_out;
        if (info.eos >= 0 && shown > 0 && st->out[shown - 1] == info.eos) shown--;
        for (size_t t = 0; t < shown; t++) {
            if (print_piece(e, st->out[t]) != 0) goto done;
        }
        printf("\n");
    }
    printf("\nprompts: %zu tokens of %llu streams in one call, %.2f ms, %.1f tok/s\n", prompt_tokens, n_streams,
           prompt_seconds * 1e3, prompt_seconds > 0 ? (double)prompt_tokens / prompt_seconds : 0.0);
    printf("batch: %llu streams, %llu tokens in %llu calls (up to %zu a call), %.2f ms, %.1f tok/s aggregate\n",
           n_streams, decoded, calls, widest, decode_seconds * 1e3,
           decode_seconds > 0 && decoded > 0 ? (double)decoded / decode_seconds : 0.0);

    if (check) {
        /* Each stream again, alone, truncated to nothing: the same tokens. */
        for (size_t i = 0; i < n_streams; i++) {
            stream_state *st = &streams[i];
            uint32_t len = 1;
            if ((s = engine_truncate(e, (uint32_t)i, 0)) != ENGINE_STATUS_OK ||
                (s = engine_stream_len(e, (uint32_t)i, &len)) != ENGINE_STATUS_OK) {
                fail("engine_truncate", s);
                goto done;
            }
            if (len != 0) {
                fprintf(stderr, "batch: check: stream %zu holds %u positions after truncating to 0\n", i, len);
                goto done;
            }
            int32_t next = -1;
            s = engine_step(e, (uint32_t)i, st->ids, st->n_ids, &next);
            for (size_t t = 0; s == ENGINE_STATUS_OK && t < st->n_out; t++) {
                if (next != st->out[t]) {
                    fprintf(stderr, "batch: check: stream %zu token %zu is %d alone, %d in the batch\n", i, t, next,
                            st->out[t]);
                    goto done;
                }
                if (t + 1 < st->n_out) s = engine_step(e, (uint32_t)i, &st->out[t], 1, &next);
            }
            if (s != ENGINE_STATUS_OK) {
                fail("engine_step (check)", s);
                goto done;
            }
        }
        for (size_t i = 0; i < n_streams; i++) {
            if ((s = engine_reset(e, (uint32_t)i)) != ENGINE_STATUS_OK) {
                fail("engine_reset", s);
                goto done;
            }
        }
        if ((s = engine_kv_stats(e, &pool_total, &pool_free)) != ENGINE_STATUS_OK) {
            fail("engine_kv_stats", s);
            goto done;
        }
        if (pool_free != pool_total) {
            fprintf(stderr, "batch: check: %llu of %llu pool tokens free after the resets\n",
                    (unsigned long long)pool_free, (unsigned long long)pool_total);
            goto done;
        }
        printf("check: every stream's tokens match stepping it alone; the pool is whole after the resets\n");
    }
    rc = 0;

done:
    for (size_t i = 0; i < n_streams; i++) {
        free(streams[i].ids);
        free(streams[i].out);
    }
    engine_free(e);
    return rc;
}
