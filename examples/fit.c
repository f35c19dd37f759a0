/* Prints the fit rule's plan and start-up line for figures given on the command line.
 * Build: cc -std=c99 -Wall -Wextra -Werror -pedantic -Iinclude examples/fit.c -Ltarget/release -lhostembed */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hostembed.h"

static const char usage[] =
    "usage: fit room=SIZE weight=SIZE embed=SIZE stream=SIZE window=TOKENS [scratch=SIZE]\n"
    "           [per_token=SIZE] [drafter_weight=SIZE] [drafter_stream=SIZE] [reserve=SIZE]\n"
    "           [max_streams=N] [unified] [tied] [mmap_rows]\n"
    "  SIZE is bytes, or a number with a K, M or G suffix (KiB, MiB, GiB); reserve defaults to 256M.\n"
    "  Exit status: 0 when a stream starts, 2 when the plan refuses (no room), 1 for bad arguments.\n";

/* Parses "123", "564M", "2G" into bytes; 0 on a malformed or overflowing figure. */
static int parse_size(const char *text, uint64_t *out) {
    char *end = NULL;
    uint64_t value, shift = 0;
    if (*text < '0' || *text > '9') return 0;
    errno = 0;
    value = strtoull(text, &end, 10);
    if (errno != 0) return 0;
    if (*end == 'K') shift = 10, end++;
    else if (*end == 'M') shift = 20, end++;
    else if (*end == 'G') shift = 30, end++;
    if (*end != '\0' || (shift && value > (UINT64_MAX >> shift))) return 0;
    *out = value << shift;
    return 1;
}

static const char *placement_name(engine_placement placement) {
    switch (placement) {
        case ENGINE_PLACEMENT_DEVICE: return "device";
        case ENGINE_PLACEMENT_HOST_MAPPED: return "host_mapped";
        case ENGINE_PLACEMENT_FILE_MAPPED: return "file_mapped";
    }
    return "?";
}

int main(int argc, char **argv) {
    struct { const char *key; uint64_t *field; } sizes[9];
    engine_fit_inputs in = engine_fit_default_inputs();
    engine_plan plan;
    engine_status status;
    uint64_t window = 0, max_streams = 0;
    int seen_room = 0, seen_weight = 0, seen_stream = 0, seen_window = 0;
    char line[512];
    size_t n;
    int a;

    sizes[0].key = "room", sizes[0].field = &in.room_bytes;
    sizes[1].key = "weight", sizes[1].field = &in.weight_bytes;
    sizes[2].key = "embed", sizes[2].field = &in.embed_bytes;
    sizes[3].key = "scratch", sizes[3].field = &in.scratch_bytes;
    sizes[4].key = "stream", sizes[4].field = &in.stream_bytes;
    sizes[5].key = "per_token", sizes[5].field = &in.stream_bytes_per_token;
    sizes[6].key = "drafter_weight", sizes[6].field = &in.drafter_weight_bytes;
    sizes[7].key = "drafter_stream", sizes[7].field = &in.drafter_stream_bytes;
    sizes[8].key = "reserve", sizes[8].field = &in.reserve_bytes;

    for (a = 1; a < argc; a++) {
        const char *arg = argv[a];
        const char *eq = strchr(arg, '=');
        size_t key_len = eq ? (size_t)(eq - arg) : strlen(arg);
        int known = 0, k;
        if (!eq) {
            if (strcmp(arg, "unified") == 0) in.unified = true, known = 1;
            else if (strcmp(arg, "tied") == 0) in.embed_tied = true, known = 1;
            else if (strcmp(arg, "mmap_rows") == 0) in.mmap_rows = true, known = 1;
        } else if (key_len == 6 && strncmp(arg, "window", 6) == 0) {
            known = parse_size(eq + 1, &window) && window <= UINT32_MAX;
            seen_window = 1;
        } else if (key_len == 11 && strncmp(arg, "max_streams", 11) == 0) {
            known = parse_size(eq + 1, &max_streams) && max_streams <= UINT32_MAX;
        } else {
            for (k = 0; k < 9; k++) {
                if (strlen(sizes[k].key) == key_len && strncmp(arg, sizes[k].key, key_len) == 0) {
                    known = parse_size(eq + 1, sizes[k].field);
                    seen_room |= k == 0, seen_weight |= k == 1, seen_stream |= k == 4;
                }
            }
        }
        if (!known) {
            fprintf(stderr, "fit: bad argument '%s'\n%s", arg, usage);
            return 1;
        }
    }
    if (!seen_room || !seen_weight || !seen_stream || !seen_window) {
        fprintf(stderr, "%s", usage);
        return 1;
    }
    in.window = (uint32_t)window;
    in.max_streams = (uint32_t)max_streams;

    status = engine_fit_plan(&in, &plan);
    if (status != ENGINE_STATUS_OK && status != ENGINE_STATUS_NO_ROOM) {
        fprintf(stderr, "fit: %s: %s\n", engine_status_str(status), engine_last_error());
        return 1;
    }
    printf("placement            %s\n", placement_name(plan.placement));
    printf("streams              %" PRIu32 "\n", plan.streams);
    printf("window               %" PRIu32 "\n", plan.window);
    printf("need_bytes           %" PRIu64 "\n", plan.need_bytes);
    printf("on_card_bytes        %" PRIu64 "\n", plan.on_card_bytes);
    printf("left_bytes           %" PRIu64 "\n", plan.left_bytes);
    printf("stream_bytes         %" PRIu64 "\n", plan.stream_bytes);
    printf("embed_host_bytes     %" PRIu64 "\n", plan.embed_host_bytes);
    printf("max_window_on_card   %" PRIu32 "\n", plan.max_window_on_card);
    printf("max_window           %" PRIu32 " (%s)\n", plan.max_window, placement_name(plan.max_window_placement));
    printf("max_window_unmapped  %" PRIu32 "\n", plan.max_window_unmapped);

    n = engine_plan_describe(&plan, line, sizeof line);
    if (n == 0 || n >= sizeof line) {
        fprintf(stderr, "fit: engine_plan_describe returned %lu: %s\n", (unsigned long)n, engine_last_error());
        return 1;
    }
    printf("%s\n", line);
    if (status == ENGINE_STATUS_NO_ROOM) {
        printf("refused: %s\n", engine_last_error());
        return 2;
    }
    return 0;
}
