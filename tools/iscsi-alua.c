/*
 * iscsi-alua: look at a LUN's ALUA paths with libiscsi, and write through them as a
 * multipath host would, for the cluster tests (there is no kernel initiator here).
 *
 *   iscsi-alua probe URL
 *       One path: INQUIRY's TPGS, the Device Identification page's relative target port
 *       and target port group, REPORT TARGET PORT GROUPS (both header formats), whether
 *       REPORT SUPPORTED OPERATION CODES lists it, and what TEST UNIT READY, READ(16)
 *       and READ CAPACITY(16) answer. One "key value..." line each.
 *
 *   iscsi-alua write BLOCKS STOPFILE URL...
 *       4 KiB WRITE(16)s, one at a time until file STOPFILE exists (the write under way
 *       is finished first), write n to block n % BLOCKS with the
 *       pattern of round n / BLOCKS (8-byte little-endian words (round << 40) |
 *       (block << 12) | word), through the paths URL... (one session each): on the
 *       path in use until it refuses (standby or transition sense) or fails; then the
 *       first path whose own group REPORT TARGET PORT GROUPS says is active/optimized.
 *       A unit attention is retried. Prints "ack BLOCK ROUND PATH" per write the target
 *       acknowledged (GOOD), and what it saw on the way. Exit status 1 if a write finds
 *       no path within 60 s, or on any other error.
 *
 *   iscsi-alua pr URL KEY [TYPE]
 *       REGISTER reservation key KEY (hex), and with TYPE, RESERVE that type with it;
 *       prints "register status S key K ascq A" (and "reserve ...").
 *
 *   iscsi-alua prshow URL
 *       PERSISTENT RESERVE IN: "keys N KEY..." (READ KEYS, hex) and "reservation
 *       RESERVED KEY TYPE" (READ RESERVATION), or "prin status ..." when refused.
 *
 * URL is iscsi://HOST:PORT/IQN/LUN; blocks are 512 bytes (8 LBAs per 4 KiB).
 *
 * Build: cc -O2 -o iscsi-alua tools/iscsi-alua.c -liscsi
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <iscsi/iscsi.h>
#include <iscsi/scsi-lowlevel.h>

#define BS 4096
#define MAX_PATHS 8
#define PATIENCE_S 60

struct path {
	const char *url;
	struct iscsi_context *iscsi;
	int lun;
	int group;
	int rel_port;
	char last_rtpg[256];
};

static double now_s(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

static void die(const char *what)
{
	fprintf(stdout, "error %s\n", what);
	fflush(stdout);
	exit(1);
}

/* libiscsi's own statuses (connection lost, cancelled, timed out), not the target's. */
static int transport_failed(int status)
{
	return status == SCSI_STATUS_ERROR || status == SCSI_STATUS_CANCELLED ||
	       status == SCSI_STATUS_TIMEOUT;
}

/* Log in to the LUN of `p->url`; 0 on success. */
static int login(struct path *p)
{
	struct iscsi_context *iscsi = iscsi_create_context("iqn.2026-11.io.tessera:alua-host");
	if (iscsi == NULL)
		return -1;
	struct iscsi_url *url = iscsi_parse_full_url(iscsi, p->url);
	if (url == NULL) {
		iscsi_destroy_context(iscsi);
		return -1;
	}
	iscsi_set_targetname(iscsi, url->target);
	iscsi_set_session_type(iscsi, ISCSI_SESSION_NORMAL);
	iscsi_set_header_digest(iscsi, ISCSI_HEADER_DIGEST_NONE_CRC32C);
	/* A path that fails stays failed: the host moves to another, as multipath does. */
	iscsi_set_noautoreconnect(iscsi, 1);
	iscsi_set_timeout(iscsi, 10);
	/* Connect and log in without libiscsi's full connect: that one ends with a TEST
	 * UNIT READY, which a standby port refuses (NOT READY) by design. */
	if (iscsi_connect_sync(iscsi, url->portal) != 0 || iscsi_login_sync(iscsi) != 0) {
		fprintf(stdout, "login-failed %s: %s\n", p->url, iscsi_get_error(iscsi));
		iscsi_destroy_url(url);
		iscsi_destroy_context(iscsi);
		return -1;
	}
	p->lun = url->lun;
	p->iscsi = iscsi;
	iscsi_destroy_url(url);
	return 0;
}

static void drop(struct path *p)
{
	if (p->iscsi != NULL) {
		iscsi_destroy_context(p->iscsi);
		p->iscsi = NULL;
	}
}

/* A command with a hand-made CDB reading up to `len` bytes. */
static struct scsi_task *command_in(struct path *p, unsigned char *cdb, int cdb_len, int len)
{
	struct scsi_task *task = scsi_create_task(cdb_len, cdb, SCSI_XFER_READ, len);
	if (task == NULL)
		return NULL;
	if (iscsi_scsi_command_sync(p->iscsi, p->lun, task, NULL) == NULL) {
		scsi_free_scsi_task(task);
		return NULL;
	}
	return task;
}

/* REPORT TARGET PORT GROUPS; `extended` asks for the extended header. */
static struct scsi_task *rtpg(struct path *p, int extended)
{
	unsigned char cdb[12] = {0xa3, 0x0a};
	if (extended)
		cdb[1] |= 0x20;
	cdb[9] = 0xff; /* allocation length 255 */
	return command_in(p, cdb, 12, 255);
}

/* "G:S ..." for each group of RTPG data `d` (`n` bytes). */
static void groups_text(const unsigned char *d, int n, int extended, char *out, size_t room)
{
	out[0] = 0;
	if (n < 4)
		return;
	int len = (d[0] << 24 | d[1] << 16 | d[2] << 8 | d[3]) + 4;
	if (len > n)
		len = n;
	int at = extended ? 8 : 4;
	size_t used = 0;
	while (at + 8 <= len) {
		int ports = d[at + 7];
		int id = d[at + 2] << 8 | d[at + 3];
		int rel = at + 12 <= len ? (d[at + 10] << 8 | d[at + 11]) : -1;
		used += snprintf(out + used, room - used, "%s%d:%d:%d:%d", used ? " " : "", id,
				 d[at] & 0x0f, d[at + 1], rel);
		if (used >= room)
			break;
		at += 8 + 4 * ports;
	}
}

/* The state REPORT TARGET PORT GROUPS on `p` gives `p`'s own group: 0..15, -1 when the
 * path failed (it is dropped), -2 when its group is not listed. */
static int own_state(struct path *p, int index)
{
	for (int tries = 0; tries < 4; tries++) {
		struct scsi_task *t = rtpg(p, 1);
		if (t == NULL || transport_failed(t->status)) {
			fprintf(stdout, "path-failed %d rtpg: %s\n", index, iscsi_get_error(p->iscsi));
			if (t != NULL)
				scsi_free_scsi_task(t);
			drop(p);
			return -1;
		}
		if (t->status == SCSI_STATUS_CHECK_CONDITION && t->sense.key == SCSI_SENSE_UNIT_ATTENTION) {
			fprintf(stdout, "ua %d rtpg ascq 0x%04x\n", index, t->sense.ascq);
			scsi_free_scsi_task(t);
			continue;
		}
		if (t->status != SCSI_STATUS_GOOD) {
			fprintf(stdout, "rtpg-refused %d status %d key %d ascq 0x%04x\n", index,
				t->status, t->sense.key, t->sense.ascq);
			scsi_free_scsi_task(t);
			return -2;
		}
		char text[256];
		groups_text(t->datain.data, t->datain.size, 1, text, sizeof text);
		if (strcmp(text, p->last_rtpg) != 0) {
			fprintf(stdout, "rtpg %d %s\n", index, text);
			snprintf(p->last_rtpg, sizeof p->last_rtpg, "%s", text);
		}
		const unsigned char *d = t->datain.data;
		int n = t->datain.size, at = 8, state = -2;
		while (at + 8 <= n) {
			if ((d[at + 2] << 8 | d[at + 3]) == p->group)
				state = d[at] & 0x0f;
			at += 8 + 4 * d[at + 7];
		}
		scsi_free_scsi_task(t);
		return state;
	}
	return -2;
}

/* The relative target port and target port group the Device Identification page of `p`
 * designates (-1 when absent). */
static int identify(struct path *p)
{
	p->group = -1;
	p->rel_port = -1;
	struct scsi_task *t = iscsi_inquiry_sync(p->iscsi, p->lun, 1, 0x83, 255);
	if (t == NULL || t->status != SCSI_STATUS_GOOD) {
		if (t)
			scsi_free_scsi_task(t);
		return -1;
	}
	const unsigned char *d = t->datain.data;
	int n = t->datain.size, at = 4;
	while (at + 4 <= n) {
		int len = d[at + 3];
		int type = d[at + 1] & 0x0f;
		if (len == 4 && at + 8 <= n) {
			int v = d[at + 6] << 8 | d[at + 7];
			if (type == 4)
				p->rel_port = v;
			if (type == 5)
				p->group = v;
		}
		at += 4 + len;
	}
	scsi_free_scsi_task(t);
	return 0;
}

static void print_result(const char *what, struct scsi_task *t)
{
	if (t == NULL) {
		printf("%s failed\n", what);
		return;
	}
	printf("%s status %d key %d ascq 0x%04x\n", what, t->status,
	       t->status == SCSI_STATUS_GOOD ? 0 : t->sense.key,
	       t->status == SCSI_STATUS_GOOD ? 0 : t->sense.ascq);
	scsi_free_scsi_task(t);
}

static int probe(const char *url)
{
	struct path p = {.url = url};
	if (login(&p) != 0)
		die("login");
	struct scsi_task *t = iscsi_inquiry_sync(p.iscsi, p.lun, 0, 0, 96);
	if (t == NULL || t->status != SCSI_STATUS_GOOD)
		die("inquiry");
	printf("tpgs %d\n", (((unsigned char *)t->datain.data)[5] >> 4) & 3);
	scsi_free_scsi_task(t);
	identify(&p);
	printf("relport %d\ngroup %d\n", p.rel_port, p.group);
	for (int ext = 1; ext >= 0; ext--) {
		t = rtpg(&p, ext);
		if (t == NULL)
			die("rtpg");
		char text[256];
		if (t->status == SCSI_STATUS_GOOD) {
			groups_text(t->datain.data, t->datain.size, ext, text, sizeof text);
			printf("%s %s\n", ext ? "rtpg" : "rtpg-short", text);
			if (ext)
				printf("rtpg-format 0x%02x %d\n", ((unsigned char *)t->datain.data)[4],
				       ((unsigned char *)t->datain.data)[5]);
		} else {
			printf("%s status %d key %d ascq 0x%04x\n", ext ? "rtpg" : "rtpg-short",
			       t->status, t->sense.key, t->sense.ascq);
		}
		scsi_free_scsi_task(t);
	}
	/* REPORT SUPPORTED OPERATION CODES, one command: A3h service action 0Ah. */
	unsigned char rsoc[12] = {0xa3, 0x0c, 0x02, 0xa3, 0x00, 0x0a, 0, 0, 0, 0xff};
	t = command_in(&p, rsoc, 12, 255);
	if (t == NULL)
		die("report supported operation codes");
	printf("rsoc-rtpg %d\n", t->status == SCSI_STATUS_GOOD && t->datain.size > 1 ?
					 ((unsigned char *)t->datain.data)[1] & 7 : -1);
	scsi_free_scsi_task(t);
	print_result("tur", iscsi_testunitready_sync(p.iscsi, p.lun));
	print_result("read", iscsi_read16_sync(p.iscsi, p.lun, 0, BS, 512, 0, 0, 0, 0, 0));
	t = iscsi_readcapacity16_sync(p.iscsi, p.lun);
	if (t != NULL && t->status == SCSI_STATUS_GOOD) {
		struct scsi_readcapacity16 *rc = scsi_datain_unmarshall(t);
		printf("readcap status 0 key 0 blocks %llu\n",
		       rc ? (unsigned long long)rc->returned_lba + 1 : 0ULL);
		scsi_free_scsi_task(t);
	} else {
		print_result("readcap", t);
	}
	iscsi_logout_sync(p.iscsi);
	drop(&p);
	return 0;
}

static void pattern(unsigned char *buf, uint64_t block, uint64_t round)
{
	for (int k = 0; k < BS / 8; k++) {
		uint64_t w = round << 40 | block << 12 | (uint64_t)k;
		for (int b = 0; b < 8; b++)
			buf[8 * k + b] = (unsigned char)(w >> (8 * b));
	}
}

/* The first path (from `from` on) whose own group is active/optimized, or -1. */
static int pick(struct path *paths, int n, int from)
{
	for (int i = 0; i < n; i++) {
		int k = (from + i) % n;
		if (paths[k].iscsi == NULL)
			continue;
		if (own_state(&paths[k], k) == 0) {
			printf("use %d group %d\n", k, paths[k].group);
			return k;
		}
	}
	return -1;
}

static int writer(int blocks, const char *stop, char **urls, int n)
{
	struct path paths[MAX_PATHS];
	memset(paths, 0, sizeof paths);
	for (int i = 0; i < n; i++) {
		paths[i].url = urls[i];
		if (login(&paths[i]) != 0)
			die("login");
		identify(&paths[i]);
		printf("path %d group %d relport %d\n", i, paths[i].group, paths[i].rel_port);
	}
	fflush(stdout);
	unsigned char buf[BS];
	int cur = 0;
	double since = now_s();
	/* Stop only between writes: the last one tried was acknowledged. */
	int settled = 1;
	for (long w = 0; !(settled && access(stop, F_OK) == 0);) {
		settled = 0;
		if (now_s() - since > PATIENCE_S) {
			printf("error write %ld found no path in %d s\n", w, PATIENCE_S);
			fflush(stdout);
			return 1;
		}
		if (cur < 0 || paths[cur].iscsi == NULL) {
			cur = pick(paths, n, cur < 0 ? 0 : cur);
			if (cur < 0) {
				fflush(stdout);
				usleep(100 * 1000);
			}
			continue;
		}
		uint64_t block = (uint64_t)(w % blocks), round = (uint64_t)(w / blocks);
		pattern(buf, block, round);
		struct scsi_task *t = iscsi_write16_sync(paths[cur].iscsi, paths[cur].lun, block * 8,
							 buf, BS, 512, 0, 0, 0, 0, 0);
		if (t == NULL) {
			printf("path-failed %d write: %s\n", cur, iscsi_get_error(paths[cur].iscsi));
			drop(&paths[cur]);
			continue;
		}
		int status = t->status, key = t->sense.key, ascq = t->sense.ascq;
		scsi_free_scsi_task(t);
		if (transport_failed(status)) {
			printf("path-failed %d write: %s\n", cur, iscsi_get_error(paths[cur].iscsi));
			drop(&paths[cur]);
			continue;
		}
		if (status == SCSI_STATUS_GOOD) {
			printf("ack %llu %llu %d\n", (unsigned long long)block,
			       (unsigned long long)round, cur);
			w++;
			settled = 1;
			since = now_s();
			continue;
		}
		if (status == SCSI_STATUS_CHECK_CONDITION && key == SCSI_SENSE_UNIT_ATTENTION) {
			printf("ua %d write ascq 0x%04x\n", cur, ascq);
			continue;
		}
		if (status == SCSI_STATUS_CHECK_CONDITION && key == SCSI_SENSE_NOT_READY &&
		    (ascq == 0x040b || ascq == 0x040a)) {
			/* Not this path, not yet: ask the groups which one. */
			printf("refused %d ascq 0x%04x\n", cur, ascq);
			int next = pick(paths, n, cur);
			if (next < 0) {
				fflush(stdout);
				usleep(100 * 1000);
			} else {
				cur = next;
			}
			continue;
		}
		printf("error write %ld path %d: status %d key %d ascq 0x%04x\n", w, cur, status,
		       key, ascq);
		fflush(stdout);
		return 1;
	}
	for (int i = 0; i < n; i++) {
		if (paths[i].iscsi != NULL)
			iscsi_logout_sync(paths[i].iscsi);
		drop(&paths[i]);
	}
	printf("done\n");
	fflush(stdout);
	return 0;
}

/* REGISTER KEY, then (type > 0) RESERVE `type` with it, through `url`. */
static int pr(const char *url, const char *key, int type)
{
	struct path p = {.url = url};
	if (login(&p) != 0)
		die("login");
	uint64_t k = strtoull(key, NULL, 16);
	struct scsi_persistent_reserve_out_basic reg = {.service_action_reservation_key = k};
	print_result("register", iscsi_persistent_reserve_out_sync(
					 p.iscsi, p.lun, SCSI_PERSISTENT_RESERVE_REGISTER, 0, 0, &reg));
	if (type > 0) {
		struct scsi_persistent_reserve_out_basic res = {.reservation_key = k};
		print_result("reserve",
			     iscsi_persistent_reserve_out_sync(p.iscsi, p.lun,
							       SCSI_PERSISTENT_RESERVE_RESERVE, 0,
							       type, &res));
	}
	iscsi_logout_sync(p.iscsi);
	drop(&p);
	return 0;
}

/* READ KEYS and READ RESERVATION through `url`. */
static int prshow(const char *url)
{
	struct path p = {.url = url};
	if (login(&p) != 0)
		die("login");
	struct scsi_task *t = iscsi_persistent_reserve_in_sync(
		p.iscsi, p.lun, SCSI_PERSISTENT_RESERVE_READ_KEYS, 4096);
	if (t == NULL || t->status != SCSI_STATUS_GOOD) {
		print_result("prin", t);
	} else {
		struct scsi_persistent_reserve_in_read_keys *rk = scsi_datain_unmarshall(t);
		if (rk == NULL)
			die("read keys");
		printf("keys %d", rk->num_keys);
		for (int i = 0; i < rk->num_keys; i++)
			printf(" %llx", (unsigned long long)rk->keys[i]);
		printf("\n");
		scsi_free_scsi_task(t);
		t = iscsi_persistent_reserve_in_sync(p.iscsi, p.lun,
						     SCSI_PERSISTENT_RESERVE_READ_RESERVATION, 4096);
		if (t == NULL || t->status != SCSI_STATUS_GOOD)
			die("read reservation");
		struct scsi_persistent_reserve_in_read_reservation *rr = scsi_datain_unmarshall(t);
		if (rr == NULL)
			die("read reservation");
		printf("reservation %d %llx %d\n", rr->reserved,
		       (unsigned long long)rr->reservation_key, rr->pr_type);
		scsi_free_scsi_task(t);
	}
	iscsi_logout_sync(p.iscsi);
	drop(&p);
	return 0;
}

int main(int argc, char **argv)
{
	setvbuf(stdout, NULL, _IOLBF, 0);
	if (argc == 3 && strcmp(argv[1], "probe") == 0)
		return probe(argv[2]);
	if ((argc == 4 || argc == 5) && strcmp(argv[1], "pr") == 0)
		return pr(argv[2], argv[3], argc == 5 ? atoi(argv[4]) : 0);
	if (argc == 3 && strcmp(argv[1], "prshow") == 0)
		return prshow(argv[2]);
	if (argc >= 5 && argc - 4 <= MAX_PATHS && strcmp(argv[1], "write") == 0) {
		int blocks = atoi(argv[2]);
		if (blocks <= 0)
			die("BLOCKS must be positive");
		return writer(blocks, argv[3], argv + 4, argc - 4);
	}
	fprintf(stderr, "usage: iscsi-alua probe URL\n"
			"       iscsi-alua write BLOCKS STOPFILE URL...\n");
	return 1;
}
