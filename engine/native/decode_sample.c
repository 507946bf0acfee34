/* One engine step in native code: llama_decode, wait for the device, sample every row.
 *
 * Why C, not Python: (1) the whole step runs in one ctypes call, so the engine thread
 * gives up Python's GIL once per step and asks for it back once, instead of after each of
 * decode, synchronise and every sampler; a server's event loop thread (HTTP, streaming)
 * holds the GIL in between, and each time the engine thread asks it can wait up to the
 * interpreter's switch interval. The time the step finished is written here, so Python
 * can see how long it then waited for the GIL. (2) Sampling is a scan over each row of
 * logits (150K-260K floats): llama.cpp's sampler chains first copy a row into an array of
 * (id, logit, p) structs and sort parts of it, ~0.5 ms a row; the scans below read it once
 * or twice and split rows over threads, so 32 rows cost about what one chain did.
 *
 * Semantics follow llama.cpp's chain top_k -> top_p -> min_p -> temperature -> dist (the
 * order llama-server uses), each applied to what the previous one kept: top_p and min_p
 * see probabilities at temperature 1, the temperature only shapes the final draw. Greedy
 * is the first index of the largest logit (numpy's argmax). Draws come from a per-slot
 * splitmix64 counter, one draw per token, so a seeded request's tokens depend on nothing
 * but its own logits, and skipping n draws is adding n * GAMMA to the state.
 *
 * Before a row is sampled its slot's logit_bias entries are added to it and, while
 * min_tokens is not reached, its end-of-generation tokens are set to -inf.
 *
 * Constrained sequences (a JSON schema, a tool call) come with a token bitmask per slot,
 * written by a Python thread while llama_decode runs (engine/sampling.py): after the
 * device finishes, the step waits for `mask_ready`, then every masked row has its
 * disallowed logits set to -inf in place, so whatever reads the row next (these scans,
 * a llama.cpp chain, the logprobs) sees only allowed tokens.
 *
 * No link dependency: the llama.cpp functions come in as pointers from Python, taken from
 * the libllama llama-cpp-python already loaded (engine/native_step.py).
 */
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* llama.h's struct llama_batch, passed by value to llama_decode. */
struct llama_batch_c {
    int32_t n_tokens;
    int32_t *token;
    float *embd;
    int32_t *pos;
    int32_t *n_seq_id;
    int32_t **seq_id;
    int8_t *logits;
};

typedef int32_t (*decode_fn)(void *ctx, struct llama_batch_c batch);
typedef void (*sync_fn)(void *ctx);
typedef float *(*logits_fn)(void *ctx);

enum { ROW_PYTHON = 0, ROW_GREEDY = 1, ROW_SAMPLE = 2 };

/* Sampling settings per sequence slot; arrays of n_slots owned by Python. */
struct slot_params {
    int32_t *mode; /* ROW_*: ROW_PYTHON rows are left to Python (penalty chains, device) */
    int32_t *top_k; /* 0 = off */
    float *top_p; /* 1 = off */
    float *min_p; /* 0 = off */
    float *temperature; /* > 0 for ROW_SAMPLE */
    uint64_t *rng; /* splitmix64 state, advanced once per sampled token */
    int32_t *masked; /* 1: the slot's row of `mask` applies to its logits */
    const uint32_t *mask; /* n_slots rows of mask_words: bit t%32 of word t/32 = allowed */
    int32_t *bias_n; /* logit_bias entries of the slot (at most MAX_BIAS) */
    const int32_t *bias_id; /* n_slots rows of MAX_BIAS token ids ... */
    const float *bias_val; /* ... and the values added to their logits */
    int32_t *ban_eog; /* 1: end-of-generation tokens are not allowed yet (min_tokens) */
};

#define MAX_BIAS 1024

struct step_call {
    decode_fn decode;
    sync_fn sync;
    logits_fn get_logits;
    void *ctx;
    const struct llama_batch_c *batch;
    struct slot_params slots;
    int32_t n_vocab;
    int32_t n_threads; /* at most this many sampling threads */
    float *scratch; /* n_threads * SCRATCH(n_vocab) floats, owned by Python */
    void *pool; /* sampling threads, started on first use; NULL until then */
    double t_decoded; /* CLOCK_MONOTONIC seconds: the device finished the graph */
    double t_sampled; /* ... every native row was sampled */
    int32_t mask_words;
    int32_t *mask_ready; /* set to 1 (release) once this step's masks are written */
    double t_masked; /* ... the masks were ready */
    int32_t n_eog;
    const int32_t *eog; /* the vocabulary's end-of-generation tokens */
};

#define BLOCK 128
#define GAMMA 0x9E3779B97F4A7C15ULL
/* Per thread: candidate values, candidate ids, weights, block maxima and a heap. */
#define SCRATCH(v) (4 * (int64_t) (v) + 2 * BLOCK)
#define HIST 1024 /* top_p without top_k: buckets of logit distance from the maximum */
#define HIST_SPAN 16.0f /* ... over [0, 16): e^-16 of the maximum's weight and beyond */

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double) ts.tv_sec + 1e-9 * (double) ts.tv_nsec;
}

static double next_uniform(uint64_t *state) { /* splitmix64 -> [0, 1) */
    uint64_t z = (*state += GAMMA);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    z ^= z >> 31;
    return (double) (z >> 11) * 0x1.0p-53;
}

/* Eight floats at a time through GCC's vector extensions (SSE, AVX or NEON as the
 * target has): plain C reductions over floats do not vectorise without reassociation. */
typedef float f8 __attribute__((vector_size(32)));
typedef int32_t i8 __attribute__((vector_size(32)));

static inline f8 load8(const float *p) {
    f8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline f8 splat(float x) { return (f8){x, x, x, x, x, x, x, x}; }

static inline f8 select8(i8 mask, f8 a, f8 b) { /* mask ? a : b */
    return (f8) (((i8) a & mask) | ((i8) b & ~mask));
}

static inline f8 vmax8(f8 a, f8 b) { return select8(b > a, b, a); }

static inline float fmax2(float a, float b) { return b > a ? b : a; }

static inline float hmax8(f8 v) {
    float m = v[0];
    for (int k = 1; k < 8; k++) m = fmax2(m, v[k]);
    return m;
}

/* Maximum of each BLOCK-long block into bm; returns the index of the block holding the
 * first largest value, or -1 when the row holds a NaN (the vector max drops NaNs, so they
 * are looked for on the side). */
static int32_t block_maxima(const float *x, int32_t n, float *bm) {
    int32_t nb = (n + BLOCK - 1) / BLOCK, best = 0;
    i8 nan = {0};
    int scalar_nan = 0;
    for (int32_t b = 0; b < nb; b++) {
        const float *p = x + (int64_t) b * BLOCK;
        int32_t len = b == nb - 1 ? n - b * BLOCK : BLOCK;
        float v;
        if (len == BLOCK) {
            f8 m0 = load8(p), m1 = load8(p + 8);
            nan |= (m0 != m0) | (m1 != m1);
            for (int32_t i = 16; i < BLOCK; i += 16) {
                f8 a = load8(p + i), c = load8(p + i + 8);
                nan |= (a != a) | (c != c);
                m0 = vmax8(m0, a);
                m1 = vmax8(m1, c);
            }
            v = hmax8(vmax8(m0, m1));
        } else {
            v = p[0];
            scalar_nan |= v != v;
            for (int32_t i = 1; i < len; i++) {
                scalar_nan |= p[i] != p[i];
                v = fmax2(v, p[i]);
            }
        }
        bm[b] = v;
        if (v > bm[best]) best = b;
    }
    for (int k = 0; k < 8; k++) scalar_nan |= nan[k] != 0;
    return scalar_nan ? -1 : best;
}

/* numpy's argmax: the first NaN if there is one, else the first largest value. */
static int32_t argmax_scalar(const float *x, int32_t n) {
    int32_t best = 0;
    for (int32_t i = 0; i < n; i++) {
        if (x[i] != x[i]) return i;
        if (x[i] > x[best]) best = i;
    }
    return best;
}

static int32_t argmax(const float *x, int32_t n, float *bm) {
    int32_t b = block_maxima(x, n, bm);
    if (b < 0) return argmax_scalar(x, n);
    int32_t end = b * BLOCK + BLOCK < n ? b * BLOCK + BLOCK : n;
    for (int32_t i = b * BLOCK; i < end; i++)
        if (x[i] == bm[b]) return i;
    return b * BLOCK; /* not reached: the block holds its maximum */
}

/* The k-th largest of v[0..n) (1 <= k <= n), through a min-heap of size k. */
static float kth_largest(const float *v, int32_t n, int32_t k, float *heap) {
    int32_t size = 0;
    for (int32_t i = 0; i < n; i++) {
        float x = v[i];
        if (size < k) { /* sift up */
            int32_t c = size++;
            while (c > 0 && heap[(c - 1) / 2] > x) {
                heap[c] = heap[(c - 1) / 2];
                c = (c - 1) / 2;
            }
            heap[c] = x;
        } else if (x > heap[0]) { /* replace the root, sift down */
            int32_t c = 0;
            for (;;) {
                int32_t l = 2 * c + 1, s = c;
                float sv = x;
                if (l < k && heap[l] < sv) { s = l; sv = heap[l]; }
                if (l + 1 < k && heap[l + 1] < sv) { s = l + 1; }
                if (s == c) break;
                heap[c] = heap[s];
                c = s;
            }
            heap[c] = x;
        }
    }
    return heap[0];
}

struct cand_list {
    float *val;
    int32_t *id;
    int32_t n;
};

/* Every x[i] >= t, in index order; blocks whose maximum is below t are skipped. */
static void collect(const float *x, int32_t n, const float *bm, float t, struct cand_list *c) {
    int32_t nb = (n + BLOCK - 1) / BLOCK;
    c->n = 0;
    for (int32_t b = 0; b < nb; b++) {
        if (!(bm[b] >= t)) continue;
        int32_t end = b * BLOCK + BLOCK < n ? b * BLOCK + BLOCK : n;
        for (int32_t i = b * BLOCK; i < end; i++)
            if (x[i] >= t) {
                c->val[c->n] = x[i];
                c->id[c->n++] = i;
            }
    }
}

/* e^x for x <= 0 (0 < result <= 1), eight at a time: 2^k by the exponent bits times a
 * degree-6 Taylor polynomial of 2^f on [-0.5, 0.5]. Relative error ~1e-7 near 0, up to
 * 1.4e-6 near -87 (x * log2(e) rounded in float): plenty for sampling weights. */
static inline f8 exp_neg8(f8 x) {
    const f8 log2e = splat(1.44269504088896341f);
    x = select8(x > splat(-87.0f), x, splat(-87.0f)); /* also NaN */
    f8 t = x * log2e + 0.5f;
    i8 k = __builtin_convertvector(t, i8);
    k += (i8) (__builtin_convertvector(k, f8) > t); /* true is -1: floor */
    f8 f = x * log2e - __builtin_convertvector(k, f8);
    f8 p = splat(1.5403530393381606e-4f);
    p = p * f + 1.3333558146428441e-3f;
    p = p * f + 9.618129107628477e-3f;
    p = p * f + 5.5504108664821576e-2f;
    p = p * f + 2.402265069591007e-1f;
    p = p * f + 6.931471805599453e-1f;
    p = p * f + 1.0f;
    return p * (f8) ((k + 127) << 23);
}

static inline float exp_neg(float x) {
    f8 v = exp_neg8(splat(x));
    return v[0];
}

/* Sum of exp_neg((v[i] - shift) * scale), writing each term to w when w is not NULL;
 * float partial sums per block, added in double. */
static double sum_exp(const float *v, int32_t n, float shift, float scale, float *w) {
    double sum = 0.0;
    int32_t i = 0;
    for (; i + BLOCK <= n; i += BLOCK) {
        f8 acc = splat(0.0f);
        for (int32_t j = i; j < i + BLOCK; j += 8) {
            f8 e = exp_neg8((load8(v + j) - shift) * scale);
            if (w != NULL) memcpy(w + j, &e, sizeof e);
            acc += e;
        }
        float part = 0.0f;
        for (int k = 0; k < 8; k++) part += acc[k];
        sum += part;
    }
    for (; i < n; i++) {
        float e = exp_neg((v[i] - shift) * scale);
        if (w != NULL) w[i] = e;
        sum += e;
    }
    return sum;
}

struct pair {
    float val;
    int32_t id;
};

/* Largest logit first, lower id first among equals: a total order, so the kept set and
 * the draw do not depend on how the sort works. */
static int cmp_pair(const void *a, const void *b) {
    const struct pair *p = (const struct pair *) a, *q = (const struct pair *) b;
    if (p->val != q->val) return p->val < q->val ? 1 : -1;
    return (p->id > q->id) - (p->id < q->id);
}

static void insertion_sort(struct cand_list *c) {
    for (int32_t i = 1; i < c->n; i++) {
        float v = c->val[i];
        int32_t id = c->id[i], j = i - 1;
        while (j >= 0 && (c->val[j] < v || (c->val[j] == v && c->id[j] > id))) {
            c->val[j + 1] = c->val[j];
            c->id[j + 1] = c->id[j];
            j--;
        }
        c->val[j + 1] = v;
        c->id[j + 1] = id;
    }
}

static void sort_desc(struct cand_list *c) {
    struct pair *p = c->n > 32 ? (struct pair *) malloc(sizeof(struct pair) * (size_t) c->n)
                               : NULL;
    if (p == NULL) { /* short list (the usual case after top-k), or no memory */
        insertion_sort(c);
        return;
    }
    for (int32_t i = 0; i < c->n; i++) p[i] = (struct pair){c->val[i], c->id[i]};
    qsort(p, (size_t) c->n, sizeof(struct pair), cmp_pair);
    for (int32_t i = 0; i < c->n; i++) {
        c->val[i] = p[i].val;
        c->id[i] = p[i].id;
    }
    free(p);
}

/* The index at which the running sum of w first exceeds target, -1 if none does (the sums
 * of w and the target's total differ by rounding); bsum: w's sums per BLOCK, so whole
 * blocks are skipped. */
static int32_t pick(const float *w, int32_t n, const float *bsum, double target) {
    double acc = 0.0;
    int32_t i = 0;
    if (bsum != NULL)
        for (int32_t b = 0; i + BLOCK <= n && acc + bsum[b] <= target; b++, i += BLOCK)
            acc += bsum[b];
    for (; i < n; i++) {
        acc += w[i];
        if (acc > target) return i;
    }
    return -1;
}

/* Keep the shortest prefix of sorted candidates whose probability (at temperature 1,
 * relative to exp(lmax)) reaches top_p of z, `acc` of it being already held. */
static void cut_top_p(struct cand_list *c, float top_p, float lmax, double z, double acc) {
    for (int32_t i = 0; i < c->n; i++) {
        acc += exp_neg(c->val[i] - lmax);
        if (acc >= top_p * z) {
            c->n = i + 1;
            return;
        }
    }
}

static inline int32_t bucket(float lmax, float v) {
    float d = (lmax - v) * (HIST / HIST_SPAN);
    return d < (float) HIST ? (int32_t) d : HIST;
}

/* top_p over the whole vocabulary without sorting it: a histogram of the weights by
 * distance from the maximum finds the bucket where the mass reaches top_p; buckets above
 * it are kept whole (in index order) and only that bucket's logits are sorted and cut. */
static void nucleus(const float *x, int32_t n, const float *bm, float lmax, float top_p,
                    struct cand_list *c, float *w) {
    double z = sum_exp(x, n, lmax, 1.0f, w), mass[HIST + 1] = {0};
    int32_t nb = (n + BLOCK - 1) / BLOCK;
    for (int32_t b = 0; b < nb; b++) {
        if (!(bm[b] > lmax - HIST_SPAN)) continue;
        int32_t end = b * BLOCK + BLOCK < n ? b * BLOCK + BLOCK : n;
        for (int32_t i = b * BLOCK; i < end; i++) mass[bucket(lmax, x[i])] += w[i];
    }
    double acc = 0.0;
    int32_t cut = 0;
    while (cut < HIST && acc + mass[cut] < top_p * z) acc += mass[cut++];
    /* Whole buckets before `cut`, then `cut`'s own logits sorted behind them. */
    c->n = 0;
    int32_t n_cut = 0;
    for (int pass = 0; pass < 2; pass++)
        for (int32_t b = 0; b < nb; b++) {
            if (!(bm[b] > lmax - HIST_SPAN) && cut < HIST) continue;
            int32_t end = b * BLOCK + BLOCK < n ? b * BLOCK + BLOCK : n;
            for (int32_t i = b * BLOCK; i < end; i++) {
                int32_t k = bucket(lmax, x[i]);
                if (pass == 0 ? k < cut : k == cut) {
                    c->val[c->n] = x[i];
                    c->id[c->n++] = i;
                    n_cut += pass;
                }
            }
        }
    struct cand_list tail = {c->val + c->n - n_cut, c->id + c->n - n_cut, n_cut};
    sort_desc(&tail);
    int32_t kept = c->n - n_cut;
    cut_top_p(&tail, top_p, lmax, z, acc);
    c->n = kept + tail.n;
    if (c->n == 0) c->n = 1; /* cannot happen: the maximum is in bucket 0 */
}

static void cut_min_p(struct cand_list *c, float min_p, float lmax) {
    float t = lmax + logf(min_p);
    int32_t k = 0;
    for (int32_t i = 0; i < c->n; i++)
        if (c->val[i] >= t) {
            c->val[k] = c->val[i];
            c->id[k++] = c->id[i];
        }
    c->n = k; /* min_p <= 1 keeps the maximum; the caller falls back to argmax if not */
}

static int32_t sample_row(const float *x, int32_t n, int32_t top_k, float top_p, float min_p,
                          float temp, uint64_t *rng, float *scratch) {
    struct cand_list c = {scratch, (int32_t *) (scratch + n), 0};
    float *w = scratch + 2 * (int64_t) n;
    float *bm = scratch + 3 * (int64_t) n; /* block maxima, then a heap behind them */
    int32_t nb = (n + BLOCK - 1) / BLOCK;
    float *heap = bm + nb;
    int32_t best = block_maxima(x, n, bm);
    float inv_t = 1.0f / temp;
    /* NaN or infinite logits, or a temperature so small that 1/t overflows: greedy. */
    if (best < 0 || !(bm[best] > -INFINITY && bm[best] < INFINITY) || !(inv_t < INFINITY))
        return argmax(x, n, bm);
    float lmax = bm[best];
    if (!(min_p > 0.0f)) min_p = 0.0f; /* also NaN */
    if (min_p > 1.0f) min_p = 1.0f;
    if ((top_k <= 0 || top_k >= n) && top_p >= 1.0f && min_p <= 0.0f) {
        /* Plain temperature over the whole vocabulary; block sums go where the heap was. */
        float *bsum = heap;
        double sum = 0.0;
        for (int32_t b = 0; b * BLOCK < n; b++) {
            int32_t len = n - b * BLOCK < BLOCK ? n - b * BLOCK : BLOCK;
            bsum[b] = (float) sum_exp(x + b * BLOCK, len, lmax, inv_t, w + b * BLOCK);
            sum += bsum[b];
        }
        int32_t i = pick(w, n, bsum, next_uniform(rng) * sum);
        return i >= 0 ? i : argmax(x, n, bm);
    }
    if (top_k > 0 && top_k < n) {
        /* Collect from a threshold at or below the k-th largest logit: the k-th largest
         * block maximum while k <= blocks (cheap), else the k-th largest logit itself. */
        float t = -INFINITY;
        if (top_k <= nb)
            t = kth_largest(bm, nb, top_k, heap);
        else if (top_k <= n - nb)
            t = kth_largest(x, n, top_k, heap);
        collect(x, n, bm, t, &c);
        sort_desc(&c);
        if (c.n > top_k) c.n = top_k;
        if (top_p < 1.0f)
            cut_top_p(&c, top_p, lmax, sum_exp(c.val, c.n, lmax, 1.0f, NULL), 0.0);
    } else if (top_p < 1.0f) {
        nucleus(x, n, bm, lmax, top_p, &c, w);
    } else {
        collect(x, n, bm, lmax + logf(min_p), &c);
    }
    if (min_p > 0.0f) cut_min_p(&c, min_p, lmax);
    if (c.n == 0) return argmax(x, n, bm);
    double sum = sum_exp(c.val, c.n, lmax, inv_t, w);
    int32_t i = pick(w, c.n, NULL, next_uniform(rng) * sum);
    return c.id[i >= 0 ? i : c.n - 1];
}

struct job {
    const struct step_call *call;
    const float *logits;
    const int32_t *row_slot;
    int32_t *out;
    int32_t r0, r1;
    float *scratch;
};

/* Disallowed tokens' logits to -inf (words of all ones, the common case in free text
 * inside a constrained answer, are skipped whole). */
static void apply_mask(float *x, int32_t n, const uint32_t *m) {
    for (int32_t w = 0; w * 32 < n; w++) {
        uint32_t bits = m[w];
        if (bits == 0xFFFFFFFFu) continue;
        int32_t end = w * 32 + 32 < n ? w * 32 + 32 : n;
        for (int32_t i = w * 32; i < end; i++)
            if (!((bits >> (i & 31)) & 1u)) x[i] = -INFINITY;
    }
}

static void *sample_rows(void *arg) {
    const struct job *j = (const struct job *) arg;
    const struct slot_params *s = &j->call->slots;
    int32_t v = j->call->n_vocab;
    for (int32_t r = j->r0; r < j->r1; r++) {
        int32_t slot = j->row_slot[r];
        float *x = (float *) j->logits + (int64_t) r * v;
        float *bm = j->scratch + 3 * (int64_t) v;
        for (int32_t k = 0; s->bias_n != NULL && k < s->bias_n[slot]; k++) {
            int64_t at = (int64_t) slot * MAX_BIAS + k;
            x[s->bias_id[at]] += s->bias_val[at];
        }
        if (s->ban_eog != NULL && s->ban_eog[slot])
            for (int32_t k = 0; k < j->call->n_eog; k++) x[j->call->eog[k]] = -INFINITY;
        if (s->masked != NULL && s->masked[slot])
            apply_mask(x, v, s->mask + (int64_t) slot * j->call->mask_words);
        switch (s->mode[slot]) {
        case ROW_GREEDY:
            j->out[r] = argmax(x, v, bm);
            break;
        case ROW_SAMPLE:
            j->out[r] = sample_row(x, v, s->top_k[slot], s->top_p[slot], s->min_p[slot],
                                   s->temperature[slot], &s->rng[slot], j->scratch);
            break;
        default:
            j->out[r] = -1;
        }
    }
    return NULL;
}

/* Sampling threads that sleep between steps: started once (pthread_create for every step
 * cost more than the rows they share), woken per step through a condition variable. They
 * never spin, so between steps they leave the cores to ggml's CPU threads. */
#define MAX_THREADS 16

struct pool;
struct worker {
    struct pool *pool;
    int32_t idx;
};

struct pool {
    pthread_mutex_t mu;
    pthread_cond_t go, done;
    uint64_t gen; /* bumped per dispatch */
    int32_t n_workers, n_active, pending, stop;
    struct job jobs[MAX_THREADS]; /* jobs[0] is the caller's */
    struct worker args[MAX_THREADS];
    pthread_t tid[MAX_THREADS];
};

static void *worker_main(void *arg) {
    struct worker *w = (struct worker *) arg;
    struct pool *p = w->pool;
    uint64_t seen = 0;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (p->gen == seen && !p->stop) pthread_cond_wait(&p->go, &p->mu);
        if (p->stop) break;
        seen = p->gen;
        if (w->idx < p->n_active) {
            pthread_mutex_unlock(&p->mu);
            sample_rows(&p->jobs[w->idx]);
            pthread_mutex_lock(&p->mu);
            if (--p->pending == 0) pthread_cond_signal(&p->done);
        }
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

static struct pool *pool_start(int32_t n_threads) {
    struct pool *p = (struct pool *) calloc(1, sizeof(struct pool));
    if (p == NULL) return NULL;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->go, NULL);
    pthread_cond_init(&p->done, NULL);
    for (int32_t i = 1; i < n_threads && i < MAX_THREADS; i++) {
        p->args[i] = (struct worker){p, i};
        if (pthread_create(&p->tid[i], NULL, worker_main, &p->args[i]) != 0) break;
        p->n_workers = i;
    }
    return p;
}

/* Rows [0, n_rows) over up to c->n_threads threads, the caller being one of them. */
static void sample_all(struct step_call *c, const float *logits, int32_t n_rows,
                       const int32_t *row_slot, int32_t *out) {
    /* A thread per ~512K logits (2 MB): fewer do not repay a wake-up. */
    int32_t nt = (int32_t) (((int64_t) n_rows * c->n_vocab) >> 19);
    if (nt > c->n_threads) nt = c->n_threads;
    if (nt > n_rows) nt = n_rows;
    if (nt > 1 && c->pool == NULL) c->pool = pool_start(c->n_threads);
    struct pool *p = (struct pool *) c->pool;
    if (p == NULL || nt > p->n_workers + 1) nt = p == NULL ? 1 : p->n_workers + 1;
    if (nt <= 1) {
        struct job j = {c, logits, row_slot, out, 0, n_rows, c->scratch};
        sample_rows(&j);
        return;
    }
    pthread_mutex_lock(&p->mu);
    for (int32_t t = 0; t < nt; t++)
        p->jobs[t] = (struct job){c, logits, row_slot, out, n_rows * t / nt,
                                  n_rows * (t + 1) / nt, c->scratch + t * SCRATCH(c->n_vocab)};
    p->n_active = nt;
    p->pending = nt - 1;
    p->gen++;
    pthread_cond_broadcast(&p->go);
    pthread_mutex_unlock(&p->mu);
    sample_rows(&p->jobs[0]);
    pthread_mutex_lock(&p->mu);
    while (p->pending > 0) pthread_cond_wait(&p->done, &p->mu);
    pthread_mutex_unlock(&p->mu);
}

/* Stop and free the sampling threads (the engine's close). */
void onegpu_close(struct step_call *c) {
    struct pool *p = (struct pool *) c->pool;
    if (p == NULL) return;
    pthread_mutex_lock(&p->mu);
    p->stop = 1;
    pthread_cond_broadcast(&p->go);
    pthread_mutex_unlock(&p->mu);
    for (int32_t i = 1; i <= p->n_workers; i++) pthread_join(p->tid[i], NULL);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->go);
    pthread_cond_destroy(&p->done);
    free(p);
    c->pool = NULL;
}

/* Decode the batch, wait for it, sample rows [0, n_rows) of the logits into out
 * (row r belongs to slot row_slot[r]; -1 for rows left to Python). Returns
 * llama_decode's code; on a non-zero code nothing is synchronised or sampled. */
int32_t onegpu_decode_sample(struct step_call *c, int32_t n_rows, const int32_t *row_slot,
                             int32_t *out) {
    int32_t rc = c->decode(c->ctx, *c->batch);
    if (rc != 0) {
        c->t_decoded = c->t_masked = c->t_sampled = now();
        return rc;
    }
    c->sync(c->ctx);
    c->t_decoded = now();
    if (c->mask_ready != NULL)
        while (!__atomic_load_n(c->mask_ready, __ATOMIC_ACQUIRE)) sched_yield();
    c->t_masked = now();
    if (n_rows > 0) sample_all(c, c->get_logits(c->ctx), n_rows, row_slot, out);
    c->t_sampled = now();
    return 0;
}

/* Sample rows of a logits matrix without decoding (tests, benchmarks). */
void onegpu_sample(struct step_call *c, const float *logits, int32_t n_rows,
                   const int32_t *row_slot, int32_t *out) {
    sample_all(c, logits, n_rows, row_slot, out);
}

/* The mask writer's store: every mask word before it is visible to the step after it. */
void onegpu_mask_ready(int32_t *flag) { __atomic_store_n(flag, 1, __ATOMIC_RELEASE); }

/* Floats of scratch one sampling thread needs for a vocabulary of n_vocab. */
int64_t onegpu_scratch_floats(int32_t n_vocab) { return SCRATCH(n_vocab); }
