/*
 * iscsi-blockio: copy bytes between a file and an iSCSI LUN with libiscsi's synchronous
 * READ(16)/WRITE(16), for tests that check data across protocols (Debian's libiscsi-bin
 * has no iscsi-dd, and there is no kernel initiator here).
 *
 *   iscsi-blockio write URL OFFSET FILE          the file's bytes to the LUN at OFFSET
 *   iscsi-blockio read  URL OFFSET LENGTH FILE   LENGTH bytes of the LUN at OFFSET to FILE
 *
 * URL is iscsi://HOST:PORT/IQN/LUN. OFFSET and the length are in bytes and must be
 * multiples of the LUN's block size (READ CAPACITY(16) says which). Exit status 0 on
 * success; 1 with a message on stderr otherwise.
 *
 * Build: cc -O2 -o iscsi-blockio tools/iscsi-blockio.c -liscsi
 */
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <iscsi/iscsi.h>
#include <iscsi/scsi-lowlevel.h>

/* Bytes per command: a quarter of the 1 MiB transfer limit targets commonly report. */
#define CHUNK (256 * 1024)

static void die(const char *what, struct iscsi_context *iscsi)
{
	fprintf(stderr, "iscsi-blockio: %s: %s\n", what,
		iscsi ? iscsi_get_error(iscsi) : strerror(errno));
	exit(1);
}

/* A task that did not end GOOD: say what the target answered. */
static void check(struct scsi_task *task, struct iscsi_context *iscsi, const char *what,
		  uint64_t lba)
{
	if (task == NULL)
		die(what, iscsi);
	if (task->status != SCSI_STATUS_GOOD) {
		fprintf(stderr, "iscsi-blockio: %s at LBA %llu: status %d, sense key %d "
			"ascq 0x%04x: %s\n", what, (unsigned long long)lba, task->status,
			task->sense.key, task->sense.ascq, iscsi_get_error(iscsi));
		exit(1);
	}
}

int main(int argc, char **argv)
{
	int writing;
	if (argc == 5 && strcmp(argv[1], "write") == 0)
		writing = 1;
	else if (argc == 6 && strcmp(argv[1], "read") == 0)
		writing = 0;
	else {
		fprintf(stderr, "usage: iscsi-blockio write URL OFFSET FILE\n"
				"       iscsi-blockio read URL OFFSET LENGTH FILE\n");
		return 1;
	}
	const char *url_text = argv[2];
	uint64_t offset = strtoull(argv[3], NULL, 0);
	const char *path = argv[writing ? 4 : 5];

	struct iscsi_context *iscsi = iscsi_create_context("iqn.2026-11.io.tessera:blockio");
	if (iscsi == NULL)
		die("cannot create an iSCSI context", NULL);
	struct iscsi_url *url = iscsi_parse_full_url(iscsi, url_text);
	if (url == NULL)
		die("bad URL (iscsi://HOST:PORT/IQN/LUN)", iscsi);
	iscsi_set_targetname(iscsi, url->target);
	iscsi_set_session_type(iscsi, ISCSI_SESSION_NORMAL);
	iscsi_set_header_digest(iscsi, ISCSI_HEADER_DIGEST_NONE_CRC32C);
	if (iscsi_full_connect_sync(iscsi, url->portal, url->lun) != 0)
		die("login", iscsi);

	struct scsi_task *task = iscsi_readcapacity16_sync(iscsi, url->lun);
	check(task, iscsi, "READ CAPACITY(16)", 0);
	struct scsi_readcapacity16 *cap = scsi_datain_unmarshall(task);
	if (cap == NULL)
		die("READ CAPACITY(16) data", iscsi);
	uint32_t bs = cap->block_length;
	uint64_t blocks = cap->returned_lba + 1;
	scsi_free_scsi_task(task);

	uint64_t length;
	int fd;
	if (writing) {
		fd = open(path, O_RDONLY);
		struct stat st;
		if (fd < 0 || fstat(fd, &st) != 0)
			die(path, NULL);
		length = (uint64_t)st.st_size;
	} else {
		length = strtoull(argv[4], NULL, 0);
		fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
		if (fd < 0)
			die(path, NULL);
	}
	if (offset % bs || length % bs) {
		fprintf(stderr, "iscsi-blockio: offset %llu and length %llu must be multiples "
			"of the block size %u\n", (unsigned long long)offset,
			(unsigned long long)length, bs);
		return 1;
	}
	if ((offset + length) / bs > blocks) {
		fprintf(stderr, "iscsi-blockio: %llu bytes at %llu go past the LUN's end "
			"(%llu bytes)\n", (unsigned long long)length,
			(unsigned long long)offset, (unsigned long long)(blocks * bs));
		return 1;
	}

	unsigned char *buf = malloc(CHUNK);
	if (buf == NULL)
		die("malloc", NULL);
	for (uint64_t done = 0; done < length;) {
		uint32_t n = length - done < CHUNK ? (uint32_t)(length - done) : CHUNK;
		uint64_t lba = (offset + done) / bs;
		if (writing) {
			if (pread(fd, buf, n, (off_t)done) != (ssize_t)n)
				die("short read of the input file", NULL);
			task = iscsi_write16_sync(iscsi, url->lun, lba, buf, n, bs, 0, 0, 0, 0, 0);
			check(task, iscsi, "WRITE(16)", lba);
		} else {
			task = iscsi_read16_sync(iscsi, url->lun, lba, n, bs, 0, 0, 0, 0, 0);
			check(task, iscsi, "READ(16)", lba);
			if (task->datain.size != (int)n) {
				fprintf(stderr, "iscsi-blockio: READ(16) at LBA %llu returned %d bytes, "
					"not %u\n", (unsigned long long)lba, task->datain.size, n);
				return 1;
			}
			if (pwrite(fd, task->datain.data, n, (off_t)done) != (ssize_t)n)
				die(path, NULL);
		}
		scsi_free_scsi_task(task);
		done += n;
	}
	if (writing) {
		/* The data is on the volume, not in a cache, before we say so. */
		task = iscsi_synchronizecache10_sync(iscsi, url->lun, 0, 0, 0, 0);
		check(task, iscsi, "SYNCHRONIZE CACHE(10)", 0);
		scsi_free_scsi_task(task);
	}
	if (close(fd) != 0)
		die(path, NULL);
	free(buf);
	iscsi_logout_sync(iscsi);
	iscsi_destroy_url(url);
	iscsi_destroy_context(iscsi);
	return 0;
}
