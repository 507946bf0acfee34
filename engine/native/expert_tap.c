/* Expert telemetry: count the router's choices from inside llama.cpp's graph.
 *
 * llama.cpp names each MoE layer's chosen experts `ffn_moe_topk-<layer>`: an I32 view,
 * n_expert_used x n_tokens, of the router's argsort (rows n_expert apart). In the last
 * layer only the rows that produce logits remain, so its counts cover those tokens.
 * ggml's scheduler asks an eval callback about EVERY graph node of every step it is
 * installed for, so the callback must cost nanoseconds when it does not want a node: a
 * Python callback would take the GIL thousands of times per step. This is that callback,
 * in C, with no link dependency: the three ggml functions it needs come in as pointers
 * from Python (engine/expert_tap.py), taken from the libggml llama.cpp already loaded.
 *
 * Only while `armed` is set (the engine arms one step in every N) does it ask for the
 * topk nodes; ggml then computes up to each of them, synchronises, and this code copies
 * the ids out and adds one to counts[layer][expert] for each pick.
 */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The first fields of ggml.h's struct ggml_tensor, whose layout ggml keeps stable. */
struct tensor_head {
    int32_t type;
    void *buffer;
    int64_t ne[4]; /* elements per dimension */
    size_t nb[4];  /* bytes between elements per dimension */
};

typedef const char *(*get_name_fn)(const void *tensor);
typedef size_t (*nbytes_fn)(const void *tensor);
typedef void (*tensor_get_fn)(const void *tensor, void *data, size_t offset, size_t size);

struct expert_tap {
    get_name_fn get_name;
    nbytes_fn nbytes;
    tensor_get_fn tensor_get;
    int32_t armed;     /* set by the engine thread between decodes only */
    int32_t n_layer;
    int32_t n_expert;
    int32_t buf_len;   /* int32 entries in buf */
    int64_t *counts;   /* [n_layer * n_expert], owned by Python */
    int32_t *buf;      /* scratch for one topk tensor, owned by Python */
    int64_t reads;     /* topk tensors read */
    int64_t skipped;   /* topk tensors too large for buf or naming a bad layer */
    int64_t calls;     /* times the scheduler called in (0 a step when it is taken off) */
};

static const char PREFIX[] = "ffn_moe_topk-";

bool onegpu_expert_tap(void *tensor, bool ask, void *user_data) {
    struct expert_tap *tap = (struct expert_tap *) user_data;
    tap->calls++;
    if (!tap->armed) {
        return !ask; /* ask: not wanted; after a read (cannot happen here): keep computing */
    }
    const char *name = tap->get_name(tensor);
    if (strncmp(name, PREFIX, sizeof(PREFIX) - 1) != 0) {
        return !ask;
    }
    if (ask) {
        return true;
    }
    /* ask == false: the node has been computed. Returning false would stop the graph. */
    int layer = atoi(name + sizeof(PREFIX) - 1);
    size_t nb = tap->nbytes(tensor);
    if (layer < 0 || layer >= tap->n_layer || nb > (size_t) tap->buf_len * sizeof(int32_t)) {
        tap->skipped++;
        return true;
    }
    const struct tensor_head *h = (const struct tensor_head *) tensor;
    tap->tensor_get(tensor, tap->buf, 0, nb); /* the view's span, strides included */
    int64_t *row = tap->counts + (int64_t) layer * tap->n_expert;
    const char *base = (const char *) tap->buf;
    for (int64_t t = 0; t < h->ne[1]; t++) {
        for (int64_t i = 0; i < h->ne[0]; i++) {
            int32_t e = *(const int32_t *) (base + t * h->nb[1] + i * h->nb[0]);
            if (e >= 0 && e < tap->n_expert) {
                row[e]++;
            }
        }
    }
    tap->reads++;
    return true;
}
