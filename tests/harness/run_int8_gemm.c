/* Runs the int8 GEMM kernel test functions (tests/codegen/test_int8_gemm_kernel.py) on a CPU
 * the host lacks, under qemu: writes the OS's answers about the dot product and I8MM to stderr,
 * then reads records from stdin, each
 *   int64 function, int64 dims[5], int64 sizes[5] (A, B, b_zero, C, scratch bytes), A, B, b_zero
 * calls functions[function](dims, A, B, C, NULL, NULL, b_zero, scratch, &one) and writes C to
 * stdout. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#define PARAMS                                                                                \
    const int64_t *, const void *, const void *, void *, const void *, const void *,          \
        const void *, void *, const float *
typedef int32_t (*test_fn)(PARAMS);
/* X applied to the test functions of one kernel kind, in the order the test numbers them */
#define NAMES(p, X)                                                                            \
    X(p##_packed_00), X(p##_packed_01), X(p##_packed_10), X(p##_packed_11),                   \
        X(p##_runtime_000), X(p##_runtime_001), X(p##_runtime_010), X(p##_runtime_011),       \
        X(p##_runtime_100), X(p##_runtime_101), X(p##_runtime_110), X(p##_runtime_111)
/* weak: a kind may be built with some of them only (the gated one: two suffice), the others
 * are null */
#define DECLARE(f) __attribute__((weak)) f(PARAMS)
#define ITSELF(f) f
int32_t NAMES(neon, DECLARE), NAMES(dot, DECLARE), NAMES(i8mm, DECLARE), NAMES(gated, DECLARE);
static const test_fn functions[] = {NAMES(neon, ITSELF), NAMES(dot, ITSELF), NAMES(i8mm, ITSELF),
                                    NAMES(gated, ITSELF)};
/* the runtime's answers the gated kernels act on (threadpool.c) */
int32_t cuvil_cpuid_bit(int32_t word, int32_t unused_a, int32_t unused_b, int32_t bit);

static void *read_bytes(int64_t size) {
    void *p = calloc(1, (size_t)(size > 0 ? size : 1));
    if (!p || (size > 0 && fread(p, 1, (size_t)size, stdin) != (size_t)size)) exit(2);
    return p;
}

int main(void) {
    int64_t head[11];
    const float one = 1.0f;
    fprintf(stderr, "dotprod=%d i8mm=%d\n", cuvil_cpuid_bit(1, 0, 0, 20), cuvil_cpuid_bit(2, 0, 0, 13));
    while (fread(head, sizeof head, 1, stdin) == 1) {
        if (head[0] < 0 || head[0] >= (int64_t)(sizeof functions / sizeof *functions)
            || !functions[head[0]])
            return 3;
        void *a = read_bytes(head[6]), *b = read_bytes(head[7]), *zero = read_bytes(head[8]);
        void *c = calloc(1, (size_t)head[9] + 1), *scratch = calloc(1, (size_t)head[10] + 1);
        functions[head[0]](head + 1, a, b, c, NULL, NULL, zero, scratch, &one);
        fwrite(c, 1, (size_t)head[9], stdout);
        free(a), free(b), free(zero), free(c), free(scratch);
    }
    return 0;
}
