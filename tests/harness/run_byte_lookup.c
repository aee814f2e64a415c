/* Runs the byte lookup kernel (tests/codegen/test_byte_lookup.py) on a CPU the host lacks,
 * under qemu: reads records from stdin, each
 *   int64 n, int64 flip, 256 table bytes, n source bytes
 * calls lookup(table, src, dst, n, flip) and writes the n bytes of dst, then the 16 bytes
 * past them (which must be as they were: 0xA5), to stdout. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void lookup(const uint8_t *table, const uint8_t *src, uint8_t *dst, int64_t n, uint8_t flip);

int main(void) {
    int64_t head[2];
    uint8_t table[256];
    while (fread(head, sizeof head, 1, stdin) == 1) {
        if (head[0] < 0 || fread(table, 1, sizeof table, stdin) != sizeof table) return 2;
        uint8_t *src = malloc((size_t)head[0] + 1), *dst = malloc((size_t)head[0] + 16);
        if (!src || !dst || fread(src, 1, (size_t)head[0], stdin) != (size_t)head[0]) return 2;
        memset(dst, 0xA5, (size_t)head[0] + 16);
        lookup(table, src, dst, head[0], (uint8_t)head[1]);
        fwrite(dst, 1, (size_t)head[0] + 16, stdout);
        free(src), free(dst);
    }
    return 0;
}
