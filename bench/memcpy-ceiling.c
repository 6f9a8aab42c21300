/* The memory-bandwidth ceiling for 4 KiB random block I/O on RAM devices: each thread
 * copies 4 KiB between its own buffer and random 4 KiB-aligned places of one shared 1 GiB
 * region (what a RAM device's write or read costs in memory traffic), for SECS seconds.
 * Usage: memcpy-ceiling THREADS write|read [SECS]; prints "copies_per_s=N gbps=G".
 * Built and run by bench/scaling.sh. */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define REGION_BYTES (1UL << 30)
#define BLOCK 4096UL

static unsigned char *region;
static int writing;
static double secs = 2.0;

static double seconds_now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

static void *copier(void *arg) {
  uint64_t state = 0x2545F4914F6CDD1DULL ^ (uint64_t)(uintptr_t)arg;
  static __thread unsigned char own[BLOCK] __attribute__((aligned(64)));
  memset(own, 0x5a, BLOCK);
  const uint64_t blocks = REGION_BYTES / BLOCK;
  const double until = seconds_now() + secs;
  uint64_t copies = 0;
  for (;;) {
    /* Check the clock once per 512 copies: a clock read per copy would be measured too. */
    for (int i = 0; i < 512; i++) {
      state = state * 6364136223846793005ULL + 1442695040888963407ULL;
      unsigned char *at = region + ((state >> 20) % blocks) * BLOCK;
      if (writing)
        memcpy(at, own, BLOCK);
      else
        memcpy(own, at, BLOCK);
    }
    copies += 512;
    if (seconds_now() >= until)
      break;
  }
  return (void *)(uintptr_t)copies;
}

int main(int argc, char **argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: %s THREADS write|read [SECS]\n", argv[0]);
    return 2;
  }
  int threads = atoi(argv[1]);
  writing = strcmp(argv[2], "write") == 0;
  if (argc > 3)
    secs = atof(argv[3]);
  if (threads < 1 || threads > 1024 || secs <= 0) {
    fprintf(stderr, "bad THREADS or SECS\n");
    return 2;
  }
  region = aligned_alloc(BLOCK, REGION_BYTES);
  if (!region) {
    perror("aligned_alloc");
    return 1;
  }
  memset(region, 0, REGION_BYTES); /* fault every page in before timing */
  pthread_t *t = calloc((size_t)threads, sizeof *t);
  for (int i = 0; i < threads; i++)
    pthread_create(&t[i], NULL, copier, (void *)(uintptr_t)(i + 1));
  uint64_t total = 0;
  for (int i = 0; i < threads; i++) {
    void *r;
    pthread_join(t[i], &r);
    total += (uint64_t)(uintptr_t)r;
  }
  printf("copies_per_s=%.0f gbps=%.2f\n", (double)total / secs,
         (double)total * BLOCK / secs / 1e9);
  return 0;
}
