/*
 * cuvil's profiling clock: monotonic nanoseconds, read by `cuvil_<model>_run_profiled`
 * before the first node and after each one. Only that entry point calls it.
 *
 * A system clock, not the cycle counter (LLVM's readcyclecounter): on AArch64 that reads
 * PMCCNTR_EL0, which Linux and macOS do not let user code read (the instruction traps), and
 * on x86 the TSC ticks at a rate that must be calibrated and is not synchronised across
 * sockets on every machine. Reading the system clock costs some tens of nanoseconds (a vDSO
 * call on Linux, the commpage on macOS), little against a node's microseconds.
 */
#include <stdint.h>

#define HIDDEN __attribute__((visibility("hidden")))

#ifdef _WIN32
#include <windows.h>

HIDDEN uint64_t cuvil_clock_ns(void) {
    LARGE_INTEGER count, frequency;
    QueryPerformanceCounter(&count);
    QueryPerformanceFrequency(&frequency); /* fixed at boot; cheap to read */
    uint64_t f = (uint64_t)frequency.QuadPart, c = (uint64_t)count.QuadPart;
    return c / f * 1000000000u + c % f * 1000000000u / f; /* no overflow of c * 1e9 */
}
#else
#include <time.h>

/* CLOCK_MONOTONIC: in glibc's libc from 2.17 on, and in macOS from 10.12 on */
HIDDEN uint64_t cuvil_clock_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}
#endif
