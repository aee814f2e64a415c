/* Loads a cuvil model library the way a C program would and runs it once, through the
 * public C ABI of its generated header. zig compiles it for each target (tests/test_harness.py)
 * with -DCUVIL_MODEL=<model> -DCUVIL_MODEL_UPPER=<MODEL> -DCUVIL_HEADER="<model>.h".
 *
 *   run_model LIBRARY INPUTS OUTPUT_FLOATS...
 *
 * INPUTS holds each input in order as a little-endian uint64 byte count then the bytes,
 * padded to a multiple of 8 bytes. The model's symbolic dims are -DCUVIL_DIMS=d0,d1,... at
 * compile time (without it, dims is NULL: the model must have none).
 * Each output is float32 with the given element count; the harness prints
 * "cpu_check: copy N" (the code copy run() uses), then "output I" and one value a line.
 * Exit codes: 0 success, 3 the CPU lacks what the library needs (cpu_check's names on
 * stderr; run() must then refuse too), 2 anything else. */
#if !defined(_WIN32) && !defined(_POSIX_C_SOURCE)
#define _POSIX_C_SOURCE 200112L /* posix_memalign */
#endif
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef _WIN32
#include <malloc.h>
#include <windows.h>
#define OPEN(path) ((void *)LoadLibraryA(path))
#define SYMBOL(lib, name) ((void *)GetProcAddress((HMODULE)(lib), name))
#define ALIGNED_ALLOC(size) _aligned_malloc(size, 64)
#else
#include <dlfcn.h>
#define OPEN(path) dlopen(path, RTLD_NOW | RTLD_LOCAL)
#define SYMBOL(lib, name) dlsym(lib, name)
static void *ALIGNED_ALLOC(size_t size) {
    void *p = NULL;
    return posix_memalign(&p, 64, size) ? NULL : p;
}
#endif

#include CUVIL_HEADER

#ifdef CUVIL_DIMS
static const int64_t DIMS[] = {CUVIL_DIMS};
#else
#define DIMS NULL
#endif

#define CAT3_(a, b, c) a##b##c
#define CAT3(a, b, c) CAT3_(a, b, c)
#define STR_(x) #x
#define STR(x) STR_(x)
/* the header's declaration of cuvil_<model>_<part>, and that symbol's name */
#define API(part) CAT3(cuvil_, CUVIL_MODEL, _##part)
#define API_NAME(part) "cuvil_" STR(CUVIL_MODEL) "_" #part
#define MACRO(part) CAT3(CUVIL_, CUVIL_MODEL_UPPER, _##part)

static void *lookup(void *lib, const char *name) {
    void *p = SYMBOL(lib, name);
    if (!p) {
        fprintf(stderr, "run_model: the library exports no %s\n", name);
        exit(2);
    }
    return p;
}

static void *read_file(const char *path, size_t *size) {
    FILE *f = fopen(path, "rb");
    char *data;
    long n;
    if (!f || fseek(f, 0, SEEK_END) || (n = ftell(f)) < 0 || fseek(f, 0, SEEK_SET)) {
        fprintf(stderr, "run_model: cannot read %s\n", path);
        exit(2);
    }
    data = malloc((size_t)n + 1);
    if (!data || fread(data, 1, (size_t)n, f) != (size_t)n) {
        fprintf(stderr, "run_model: cannot read %s\n", path);
        exit(2);
    }
    fclose(f);
    *size = (size_t)n;
    return data;
}

int main(int argc, char **argv) {
    const void *inputs[MACRO(NUM_INPUTS) + 1];
    void *outputs[MACRO(NUM_OUTPUTS) + 1];
    int64_t counts[MACRO(NUM_OUTPUTS) + 1];
    char missing[256];
    size_t size, at = 0;
    char *feeds;
    void *lib, *workspace;
    int i, copy;
    int32_t status;
    int64_t j;

    if (argc != 3 + MACRO(NUM_OUTPUTS)) {
        fprintf(stderr, "usage: %s LIBRARY INPUTS OUTPUT_FLOATS x %d\n", argv[0], MACRO(NUM_OUTPUTS));
        return 2;
    }
    lib = OPEN(argv[1]);
    if (!lib) {
        fprintf(stderr, "run_model: cannot load %s\n", argv[1]);
        return 2;
    }
    /* the library's check first: it runs on any CPU of the architecture */
    copy = ((__typeof__(&API(cpu_check)))lookup(lib, API_NAME(cpu_check)))(missing, sizeof missing);
    if (copy < 0) {
        status = ((__typeof__(&API(run)))lookup(lib, API_NAME(run)))(NULL, NULL, NULL, NULL);
        fprintf(stderr, "run_model: this CPU lacks %s; run() returned %d\n", missing, (int)status);
        return status == MACRO(CPU_UNSUPPORTED) ? 3 : 2;
    }
    printf("cpu_check: copy %d\n", copy);
    if (strcmp((const char *)lookup(lib, API_NAME(abi_checksum)), MACRO(ABI_CHECKSUM)) != 0) {
        fprintf(stderr, "run_model: the library's ABI checksum is not the header's\n");
        return 2;
    }

    feeds = read_file(argv[2], &size);
    for (i = 0; i < MACRO(NUM_INPUTS); i++) {
        uint64_t n;
        if (size - at < 8) {
            fprintf(stderr, "run_model: %s holds fewer than %d inputs\n", argv[2], MACRO(NUM_INPUTS));
            return 2;
        }
        memcpy(&n, feeds + at, 8);
        if (n > size - at - 8) {
            fprintf(stderr, "run_model: input %d is truncated\n", i);
            return 2;
        }
        inputs[i] = feeds + at + 8; /* 8 bytes past a malloc'ed start: aligned for float */
        at += 8 + (size_t)n;
        at += (8 - at % 8) % 8;
    }
    for (i = 0; i < MACRO(NUM_OUTPUTS); i++) {
        counts[i] = strtoll(argv[3 + i], NULL, 10);
        outputs[i] = malloc((size_t)counts[i] * sizeof(float) + 1);
    }
    workspace = ALIGNED_ALLOC((size_t)((__typeof__(&API(workspace_size)))lookup(
        lib, API_NAME(workspace_size)))(DIMS) + 64);
    status = ((__typeof__(&API(run)))lookup(lib, API_NAME(run)))(inputs, outputs, DIMS, workspace);
    if (status != 0) {
        fprintf(stderr, "run_model: run() returned %d\n", (int)status);
        return 2;
    }
    for (i = 0; i < MACRO(NUM_OUTPUTS); i++) {
        printf("output %d\n", i);
        for (j = 0; j < counts[i]; j++) printf("%.9g\n", (double)((float *)outputs[i])[j]);
    }
    return 0;
}
