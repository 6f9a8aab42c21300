// iSCSI load generator on libiscsi's asynchronous API, for bench/iscsi.sh.
//
// Debian's iscsi-perf (libiscsi 1.19) only reads, so writes need another client; this one
// uses the same library (and so the same PDU handling, login keys and event loop as
// iscsi-perf) for both directions, so that Tessera and tgt see the same initiator.
// One connection, QD commands kept in flight, READ(16)/WRITE(16) of BS bytes at random
// (or sequential) block-aligned offsets within SIZE bytes of the LUN, for SECS seconds.
// Prints one line:
//   RESULT iops=N mean_us=X ios=N secs=S
// mean_us is the mean time from queueing a command to its completion callback.
//
// Build: cc -O2 -o iscsi-load bench/iscsi-load.c -liscsi
// Usage: iscsi-load [-w] [-s] [-1] [-p] [-q QD] [-b BS] [-S SIZE] [-t SECS] iscsi://HOST:PORT/IQN/LUN
//   -w write (default read)   -s sequential (default random)
//   -1 one pass: sequential, stop once SIZE bytes have been queued (or at SECS)
//   -p busy-poll: poll(2) with a zero timeout, so the client's own wake-up is not in a
//      QD1 latency (as `tessera nvmf perf --busy-poll` does)
#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <iscsi/iscsi.h>
#include <iscsi/scsi-lowlevel.h>

struct state {
  struct iscsi_context *iscsi;
  int lun;
  int write;
  int seq;
  int once;     // sequential, one pass over SIZE
  uint32_t block_size;
  uint64_t bs;         // bytes per command
  uint64_t units;      // BS-sized units within SIZE
  uint64_t next_unit;  // sequential position
  uint64_t rng;
  unsigned char *wbuf;
  double end;          // stop issuing at this time
  uint64_t ios;
  double lat_sum;
  int in_flight;
  int failed;
};

struct req {
  struct state *st;
  double start;
};

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static uint64_t xorshift(uint64_t *s) {
  uint64_t x = *s;
  x ^= x << 13;
  x ^= x >> 7;
  x ^= x << 17;
  return *s = x;
}

static int issue(struct state *st);

static void done(struct iscsi_context *iscsi, int status, void *command_data, void *private_data) {
  struct req *r = private_data;
  struct state *st = r->st;
  struct scsi_task *task = command_data;
  (void)iscsi;
  st->in_flight--;
  if (status != SCSI_STATUS_GOOD) {
    fprintf(stderr, "iscsi-load: command failed: status %d: %s\n", status,
            iscsi_get_error(st->iscsi));
    st->failed = 1;
  } else {
    double t = now();
    st->ios++;
    st->lat_sum += t - r->start;
  }
  if (task)
    scsi_free_scsi_task(task);
  free(r);
  if (!st->failed && now() < st->end && issue(st) != 0)
    st->failed = 1;
}

static int issue(struct state *st) {
  if (st->once && st->next_unit >= st->units)
    return 0;
  uint64_t unit = st->seq ? st->next_unit++ % st->units : xorshift(&st->rng) % st->units;
  uint64_t lba = unit * st->bs / st->block_size;
  struct req *r = malloc(sizeof *r);
  struct scsi_task *t;
  if (!r)
    return -1;
  r->st = st;
  r->start = now();
  if (st->write)
    t = iscsi_write16_task(st->iscsi, st->lun, lba, st->wbuf, (uint32_t)st->bs, (int)st->block_size,
                           0, 0, 0, 0, 0, done, r);
  else
    t = iscsi_read16_task(st->iscsi, st->lun, lba, (uint32_t)st->bs, (int)st->block_size, 0, 0, 0, 0,
                          0, done, r);
  if (!t) {
    fprintf(stderr, "iscsi-load: could not queue a command: %s\n", iscsi_get_error(st->iscsi));
    free(r);
    return -1;
  }
  st->in_flight++;
  return 0;
}

static uint64_t parse_size(const char *s) {
  char *e;
  uint64_t v = strtoull(s, &e, 10);
  switch (*e) {
  case 'k': case 'K': v <<= 10; break;
  case 'm': case 'M': v <<= 20; break;
  case 'g': case 'G': v <<= 30; break;
  default: break;
  }
  return v;
}

int main(int argc, char **argv) {
  struct state st;
  int qd = 1, secs = 5, busy = 0, c;
  uint64_t size = 0;
  memset(&st, 0, sizeof st);
  st.bs = 4096;
  st.rng = 0x9e3779b97f4a7c15ULL ^ (uint64_t)getpid();
  while ((c = getopt(argc, argv, "wsp1q:b:S:t:")) != -1) {
    switch (c) {
    case 'w': st.write = 1; break;
    case 's': st.seq = 1; break;
    case '1': st.seq = 1; st.once = 1; break;
    case 'p': busy = 1; break;
    case 'q': qd = atoi(optarg); break;
    case 'b': st.bs = parse_size(optarg); break;
    case 'S': size = parse_size(optarg); break;
    case 't': secs = atoi(optarg); break;
    default:
      fprintf(stderr, "usage: %s [-w] [-s] [-1] [-p] [-q QD] [-b BS] [-S SIZE] [-t SECS] iscsi://HOST:PORT/IQN/LUN\n", argv[0]);
      return 2;
    }
  }
  if (optind != argc - 1 || qd < 1 || secs < 1 || st.bs == 0) {
    fprintf(stderr, "iscsi-load: one iscsi:// URL, -q >= 1, -t >= 1 and -b > 0 are needed\n");
    return 2;
  }
  st.iscsi = iscsi_create_context("iqn.2026-11.io.tessera:bench-load");
  if (!st.iscsi) {
    fprintf(stderr, "iscsi-load: no libiscsi context\n");
    return 1;
  }
  struct iscsi_url *url = iscsi_parse_full_url(st.iscsi, argv[optind]);
  if (!url) {
    fprintf(stderr, "iscsi-load: bad URL %s: %s\n", argv[optind], iscsi_get_error(st.iscsi));
    return 1;
  }
  iscsi_set_targetname(st.iscsi, url->target);
  iscsi_set_session_type(st.iscsi, ISCSI_SESSION_NORMAL);
  // No digests on either server: the comparison is of the targets, not of CRC32C.
  iscsi_set_header_digest(st.iscsi, ISCSI_HEADER_DIGEST_NONE);
  if (iscsi_full_connect_sync(st.iscsi, url->portal, url->lun) != 0) {
    fprintf(stderr, "iscsi-load: login to %s failed: %s\n", argv[optind], iscsi_get_error(st.iscsi));
    return 1;
  }
  st.lun = url->lun;
  struct scsi_task *t = iscsi_readcapacity16_sync(st.iscsi, st.lun);
  struct scsi_readcapacity16 *rc = t && t->status == SCSI_STATUS_GOOD ? scsi_datain_unmarshall(t) : NULL;
  if (!rc) {
    fprintf(stderr, "iscsi-load: READ CAPACITY(16) failed: %s\n", iscsi_get_error(st.iscsi));
    return 1;
  }
  st.block_size = rc->block_length;
  uint64_t cap = (rc->returned_lba + 1) * (uint64_t)rc->block_length;
  scsi_free_scsi_task(t);
  if (size == 0 || size > cap)
    size = cap;
  if (st.bs % st.block_size != 0 || size < st.bs) {
    fprintf(stderr, "iscsi-load: -b %" PRIu64 " must be a multiple of the %u-byte block and at most the size\n",
            st.bs, st.block_size);
    return 1;
  }
  st.units = size / st.bs;
  if (st.write) {
    st.wbuf = malloc(st.bs);
    if (!st.wbuf)
      return 1;
    for (uint64_t i = 0; i < st.bs; i++)
      st.wbuf[i] = (unsigned char)(i * 7 + 1);
  }
  double start = now();
  st.end = start + secs;
  for (int i = 0; i < qd; i++)
    if (issue(&st) != 0)
      return 1;
  while (st.in_flight > 0 && !st.failed) {
    struct pollfd pfd = {.fd = iscsi_get_fd(st.iscsi), .events = (short)iscsi_which_events(st.iscsi)};
    int n = poll(&pfd, 1, busy ? 0 : 1000);
    if (n < 0) {
      if (errno == EINTR)
        continue;
      perror("iscsi-load: poll");
      return 1;
    }
    if (n == 0 && busy)
      continue;
    if (iscsi_service(st.iscsi, pfd.revents) < 0) {
      fprintf(stderr, "iscsi-load: iscsi_service: %s\n", iscsi_get_error(st.iscsi));
      return 1;
    }
    if (now() > st.end + 30) {
      fprintf(stderr, "iscsi-load: %d commands still in flight 30 s after the end\n", st.in_flight);
      return 1;
    }
  }
  double elapsed = now() - start;
  if (st.failed || st.ios == 0)
    return 1;
  printf("RESULT iops=%.0f mean_us=%.1f ios=%" PRIu64 " secs=%.2f\n", (double)st.ios / elapsed,
         st.lat_sum / (double)st.ios * 1e6, st.ios, elapsed);
  iscsi_logout_sync(st.iscsi);
  iscsi_destroy_context(st.iscsi);
  return 0;
}
