/* Perplexity of a model on a text file, computed as llama.cpp's llama-perplexity computes it: the text is
 * tokenized whole and cut into chunks of N tokens (the first token of each replaced by BOS when the model
 * adds one); each chunk runs from an empty stream, and the second half of it is scored: every token from
 * N/2 + 1 on by its log-probability given the chunk's tokens before it. engine_score gives those in one
 * prompt-speed pass a chunk. Prints the running perplexity after each chunk, then the final one.
 *
 *   perplexity MODEL TEXT [--ctx N] [--chunks K] [--backend cpu|cuda|auto] [--room BYTES]
 *
 * N defaults to 512; K to every whole chunk of the text.
 */
#define _POSIX_C_SOURCE 200809L
#include "hostembed.h"
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static void usage(const char *program) {
    fprintf(stderr,
            "usage: %s MODEL TEXT [--ctx N] [--chunks K] [--backend cpu|cuda|auto] [--room BYTES]\n"
            "MODEL is an HF folder (config.json + safetensors) or a .gguf file; TEXT a UTF-8 text file.\n",
            program);
}

static double seconds_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Prints the failed call, its status and the library's message; returns 1 for main. */
static int fail(const char *what, engine_status status) {
    fprintf(stderr, "perplexity: %s: %s: %s\n", what, engine_status_str(status), engine_last_error());
    return 1;
}

/* Log lines go to stderr, so stdout holds the figures alone. */
static void log_to_stderr(void *user, const char *line) {
    (void)user;
    fprintf(stderr, "%s\n", line);
}

static int parse_u64(const char *text, const char *flag, unsigned long long *out) {
    char *end = NULL;
    errno = 0;
    *out = strtoull(text, &end, 10);
    if (errno != 0 || end == text || *end != '\0' || text[0] == '-') {
        fprintf(stderr, "perplexity: %s wants a non-negative integer, got \"%s\"\n", flag, text);
        return 0;
    }
    return 1;
}

/* The whole file in a malloc'd buffer (*len bytes), or NULL. */
static char *read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (f == NULL) {
        fprintf(stderr, "perplexity: %s: %s\n", path, strerror(errno));
        return NULL;
    }
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    while (buf != NULL) {
        n += fread(buf + n, 1, cap - n, f);
        if (n < cap) break;
        char *grown = realloc(buf, cap * 2);
        if (grown == NULL) {
            free(buf);
            buf = NULL;
            break;
        }
        buf = grown;
        cap *= 2;
    }
    int bad = ferror(f);
    fclose(f);
    if (buf == NULL || bad) {
        fprintf(stderr, "perplexity: %s: cannot read it\n", path);
        free(buf);
        return NULL;
    }
    *len = n;
    return buf;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        usage(argv[0]);
        return 2;
    }
    const char *model = argv[1], *text_path = argv[2];
    unsigned long long ctx = 512, max_chunks = 0, room = 0;
    engine_backend backend = ENGINE_BACKEND_AUTO;
    for (int i = 3; i < argc; i++) {
        const char *flag = argv[i];
        if (i + 1 >= argc) {
            usage(argv[0]);
            return 2;
        }
        const char *value = argv[++i];
        if (strcmp(flag, "--ctx") == 0) {
            if (!parse_u64(value, flag, &ctx)) return 2;
        } else if (strcmp(flag, "--chunks") == 0) {
            if (!parse_u64(value, flag, &max_chunks)) return 2;
        } else if (strcmp(flag, "--room") == 0) {
            if (!parse_u64(value, flag, &room)) return 2;
        } else if (strcmp(flag, "--backend") == 0) {
            if (strcmp(value, "cpu") == 0) {
                backend = ENGINE_BACKEND_CPU;
            } else if (strcmp(value, "cuda") == 0) {
                backend = ENGINE_BACKEND_CUDA;
            } else if (strcmp(value, "auto") == 0) {
                backend = ENGINE_BACKEND_AUTO;
            } else {
                fprintf(stderr, "perplexity: --backend wants cpu, cuda or auto, got \"%s\"\n", value);
                return 2;
            }
        } else {
            usage(argv[0]);
            return 2;
        }
    }
    if (ctx < 4 || ctx > (1u << 20)) {
        fprintf(stderr, "perplexity: --ctx %llu is outside 4..%u\n", ctx, 1u << 20);
        return 2;
    }
    if (engine_abi_version() != HOSTEMBED_ABI_VERSION) {
        fprintf(stderr, "perplexity: the library's ABI is %u, this program's %u\n", (unsigned)engine_abi_version(),
                (unsigned)HOSTEMBED_ABI_VERSION);
        return 1;
    }

    size_t text_len = 0;
    char *text = read_file(text_path, &text_len);
    if (text == NULL) return 1;

    engine_options opts = engine_default_options();
    opts.backend = backend;
    opts.context = (uint32_t)ctx;
    opts.max_streams = 1;
    opts.room_bytes = room;
    opts.log = log_to_stderr;
    engine *e = NULL;
    engine_status s = engine_init_fit(model, &opts, &e);
    if (s != ENGINE_STATUS_OK) {
        free(text);
        return fail("engine_init_fit", s);
    }
    struct engine_model_info info;
    if ((s = engine_model_info(e, &info)) != ENGINE_STATUS_OK) goto failed;

    size_t n_tokens = 0;
    s = engine_tokenize(e, text, text_len, ENGINE_BOS_NO, NULL, 0, &n_tokens);
    if (s != ENGINE_STATUS_OK) goto failed;
    int32_t *tokens = malloc((n_tokens + 1) * sizeof *tokens);
    int32_t *chunk = malloc(ctx * sizeof *chunk);
    float *logprobs = malloc(ctx * sizeof *logprobs);
    if (tokens == NULL || chunk == NULL || logprobs == NULL) {
        free(tokens);
        free(chunk);
        free(logprobs);
        s = ENGINE_STATUS_NO_ROOM;
        goto failed;
    }
    s = engine_tokenize(e, text, text_len, ENGINE_BOS_NO, tokens, n_tokens + 1, &n_tokens);
    free(text);
    text = NULL;
    if (s != ENGINE_STATUS_OK) {
        free(tokens);
        free(chunk);
        free(logprobs);
        goto failed;
    }

    size_t chunks = n_tokens / ctx;
    if (max_chunks > 0 && max_chunks < chunks) chunks = max_chunks;
    if (chunks == 0) {
        fprintf(stderr, "perplexity: the text is %zu tokens, less than one chunk of %llu\n", n_tokens, ctx);
        free(tokens);
        free(chunk);
        free(logprobs);
        engine_free(e);
        return 1;
    }
    const size_t first = ctx / 2;
    const int bos = info.add_bos && info.bos >= 0;
    double nll = 0.0, nll2 = 0.0;
    size_t scored = 0;
    double started = seconds_now();
    fprintf(stderr, "perplexity: %zu tokens, %zu chunks of %llu, the last %zu of each scored\n", n_tokens, chunks,
            ctx, (size_t)ctx - first - 1);
    for (size_t c = 0; c < chunks; c++) {
        memcpy(chunk, tokens + c * ctx, ctx * sizeof *chunk);
        if (bos) chunk[0] = info.bos;
        if ((s = engine_reset(e, 0)) != ENGINE_STATUS_OK) break;
        if ((s = engine_score(e, 0, chunk, ctx, logprobs)) != ENGINE_STATUS_OK) break;
        for (size_t j = first + 1; j < ctx; j++) {
            double v = -(double)logprobs[j];
            nll += v;
            nll2 += v * v;
            scored++;
        }
        printf("[%zu]%.4f,", c + 1, exp(nll / (double)scored));
        fflush(stdout);
    }
    double elapsed = seconds_now() - started;
    free(tokens);
    free(chunk);
    free(logprobs);
    if (s != ENGINE_STATUS_OK) goto failed;
    printf("\n");
    /* The standard error of the mean log-probability, carried to the perplexity as llama-perplexity does. */
    double mean = nll / (double)scored;
    double var = nll2 / (double)scored - mean * mean;
    double err = scored > 1 && var > 0 ? sqrt(var / (double)(scored - 1)) : 0.0;
    double ppl = exp(mean);
    printf("perplexity %.6f +/- %.6f over %zu tokens (%zu chunks of %llu, %.1f tokens/s)\n", ppl, ppl * err, scored,
           chunks, ctx, (double)(chunks * ctx) / elapsed);
    engine_free(e);
    return 0;

failed:
    free(text);
    fail("perplexity", s);
    engine_free(e);
    return 1;
}
