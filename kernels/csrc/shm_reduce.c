/* The all-reduce of tensor parallelism's CPU ranks through a shared-memory segment, for float32 activations.

   gloo's all-reduce goes through loopback TCP: each call wakes the other process through the kernel, which on a
   small machine costs far more than the bytes (BENCHMARKS.md, tensor parallelism). Here every rank copies its
   part into its own slot of the segment, raises its flag to the call's sequence number and spins until every
   rank's flag has reached it; then each sums the slots in rank order (so every rank holds the same bits) into
   its own tensor. Two buffers alternate by sequence parity: a rank writes buffer s & 1 only after every rank
   raised its flag for s - 1, which each does after it finished reading s - 2 from that buffer, so one barrier per
   chunk is enough. Tensors larger than a slot go through in chunks, each its own sequence number.

   The segment: `flags`, one int64 per rank on a 64-byte line of its own; `slots`, 2 x world x chunk floats.
   `seq` (one int64, the caller's) is the last sequence number used; advanced here. */
#include <sched.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define spin_pause() _mm_pause()
#elif defined(__aarch64__)
#define spin_pause() __asm__ volatile("yield")
#else
#define spin_pause() ((void)0)
#endif

#define FLAG_STRIDE 8 /* int64s: one flag per cache line */
#define SPINS_BEFORE_YIELD 4096

static void wait_for_all(int64_t *flags, int world, int64_t s)
{
    for (int r = 0; r < world; r++) {
        int64_t spins = 0;
        while (__atomic_load_n(&flags[r * FLAG_STRIDE], __ATOMIC_ACQUIRE) < s) {
            if (++spins < SPINS_BEFORE_YIELD) spin_pause();
            else sched_yield(); /* more ranks than free cores: let the one we wait for run */
        }
    }
}

int shm_all_reduce_f32(float *x, int64_t n, void *flags_addr, void *slots_addr, int rank, int world, int64_t chunk,
                       int64_t *seq)
{
    if (rank < 0 || rank >= world || chunk <= 0) return 1;
    int64_t *flags = (int64_t *)flags_addr;
    float *slots = (float *)slots_addr;
    for (int64_t start = 0; start < n; start += chunk) {
        int64_t m = n - start < chunk ? n - start : chunk, s = ++*seq;
        float *buffer = slots + (s & 1) * world * chunk;
        memcpy(buffer + rank * chunk, x + start, (size_t)m * sizeof(float));
        __atomic_store_n(&flags[rank * FLAG_STRIDE], s, __ATOMIC_RELEASE);
        wait_for_all(flags, world, s);
        float *out = x + start;
        memcpy(out, buffer, (size_t)m * sizeof(float));
        for (int r = 1; r < world; r++) {
            const float *part = buffer + r * chunk;
            for (int64_t i = 0; i < m; i++) out[i] += part[i];
        }
    }
    return 0;
}
