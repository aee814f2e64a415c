/* AMX-BF16's tile operations in plain C, for the bf16 GEMM kernel's AMX code on CPUs without
 * AMX (tests/codegen/test_bf16_gemm_kernel.py; kernels/bf16_gemm.py `_AmxTiles`). A tile
 * is a 1 KiB buffer the kernel gives: 16 rows of 64 bytes, as the kernel configures them.
 * Semantics from Intel's SDM (TILELOADD, TILESTORED, TILEZERO, TDPBF16PS): rows and bytes per
 * row as given, strides in bytes; TDPBF16PS adds to C[m][n] (float32) the products of A's row
 * m (bf16 pairs) with B's row k (bf16 pairs, one pair per column n), pair element 0 then 1,
 * rounded to nearest even, denormal inputs and results as zero. */
#include <stdint.h>
#include <string.h>

static float from_bf16(uint16_t bits) {
    uint32_t word = (uint32_t)bits << 16;
    float x;
    memcpy(&x, &word, sizeof x);
    return x;
}

static float flush(float x) {
    uint32_t word;
    memcpy(&word, &x, sizeof word);
    return (word & 0x7F800000u) == 0 ? (word & 0x80000000u ? -0.0f : 0.0f) : x;
}

void *cuvil_emulated_tilezero(int16_t rows, int16_t colsb, void *tile) {
    (void)rows, (void)colsb;
    memset(tile, 0, 1024);
    return tile;
}

void *cuvil_emulated_tileloadd64(int16_t rows, int16_t colsb, const void *base, int64_t stride,
                                 void *tile) {
    memset(tile, 0, 1024);
    for (int r = 0; r < rows; r++)
        memcpy((char *)tile + 64 * r, (const char *)base + stride * r, (size_t)colsb);
    return tile;
}

void cuvil_emulated_tilestored64(int16_t rows, int16_t colsb, void *base, int64_t stride,
                                 const void *tile) {
    for (int r = 0; r < rows; r++)
        memcpy((char *)base + stride * r, (const char *)tile + 64 * r, (size_t)colsb);
}

void *cuvil_emulated_tdpbf16ps(int16_t m, int16_t n, int16_t k, void *c, const void *a,
                               const void *b) {
    float *cf = c;
    const uint16_t *ab = a, *bb = b;
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n / 4; j++) {
            float sum = cf[16 * i + j];
            for (int p = 0; p < k / 4; p++) {
                for (int e = 0; e < 2; e++) {
                    float x = flush(from_bf16(ab[32 * i + 2 * p + e]));
                    float y = flush(from_bf16(bb[32 * p + 2 * j + e]));
                    sum = flush(sum + x * y);
                }
            }
            cf[16 * i + j] = sum;
        }
    return c;
}
