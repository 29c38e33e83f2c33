/* aiolaunch benchmark worker (binary). Compiled on demand by benchmarks/run.py
 * into benchmarks/results/tmp/; _worker.py is the identical Python fallback.
 *
 *   stamp  STAMP RANK                 append "RANK start T"; exit 0
 *   gate   STAMP RANK FIFO CODE HANG  open FIFO, append "RANK ready T"; block until EOF;
 *                                     HANG=1: pause forever, else append
 *                                     "RANK exit T" and _exit(CODE)
 *   sleep  STAMP RANK                 append "RANK ready T"; pause forever
 *   ignore STAMP RANK                 ignore SIGTERM; append "RANK ready T"; pause
 *   lines  N INTERVAL_US              N lines "T\n" on stdout, INTERVAL_US apart
 *   bulk   RANK MIB [STAMP [WRITE]]   MIB blocks of the verifiable pattern on stdout,
 *                                     WRITE bytes per write() (default: the 1 MiB
 *                                     block; 128: a line each, as print(flush=True));
 *                                     with STAMP, then append "RANK first T" (just
 *                                     before the first write) and "RANK last T"
 *                                     (just after the last): the writer's own rate
 *   count  OUT                        (not a worker) a console: read stdin to EOF,
 *                                     then write "LINES BYTES T" to OUT, T = the
 *                                     time of the last read that returned bytes
 *   observe OUT PID...                exit observer (not a worker): opens a pidfd per
 *                                     PID, writes "ready", then "PID T" as each exits
 * T is CLOCK_MONOTONIC in seconds (Python's time.monotonic()). */
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <poll.h>
#include <sched.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static double mono(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void stamp(const char *path, const char *rank, const char *what) {
    char buf[128];
    int n = snprintf(buf, sizeof buf, "%s %s %.9f\n", rank, what, mono());
    int fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0 || write(fd, buf, n) != n) _exit(90);
    close(fd);
}

static void write_all(const char *p, size_t n) {
    while (n) {
        ssize_t k = write(1, p, n);
        if (k <= 0) _exit(91);
        p += k; n -= k;
    }
}

int main(int argc, char **argv) {
    if (argc < 2) return 2;
    const char *mode = argv[1];
    if (!strcmp(mode, "stamp")) { stamp(argv[2], argv[3], "start"); return 0; }
    if (!strcmp(mode, "gate")) {
        /* Open before the ready stamp: the driver closes its end once every
         * worker is ready, and an open for reading with no writer left would
         * block forever (the driver's "no answer within 300 s"). */
        int fd = open(argv[4], O_RDONLY | O_CLOEXEC);
        stamp(argv[2], argv[3], "ready");
        char c;
        while (read(fd, &c, 1) > 0) {}
        if (atoi(argv[6])) for (;;) pause();
        stamp(argv[2], argv[3], "exit");
        _exit(atoi(argv[5]));
    }
    if (!strcmp(mode, "sleep") || !strcmp(mode, "ignore")) {
        if (!strcmp(mode, "ignore")) signal(SIGTERM, SIG_IGN);
        stamp(argv[2], argv[3], "ready");
        for (;;) pause();
    }
    if (!strcmp(mode, "lines")) {
        int n = atoi(argv[2]), us = atoi(argv[3]);
        char buf[64];
        for (int i = 0; i < n; i++) {
            int k = snprintf(buf, sizeof buf, "%.9f\n", mono());
            write_all(buf, k);
            if (us) usleep(us);
        }
        return 0;
    }
    if (!strcmp(mode, "bulk")) {
        /* block k: 8192 lines of 128 bytes; line = 127 filler bytes + '\n';
         * the first 15 bytes of the block are "%03d %010d " (rank, k). */
        int rank = atoi(argv[2]), mib = atoi(argv[3]);
        size_t each = argc > 5 ? (size_t)atol(argv[5]) : (size_t)1 << 20;
        static char block[1 << 20];
        for (int i = 0; i < (1 << 20); i++)
            block[i] = (i % 128 == 127) ? '\n' : (char)('a' + (i % 128) % 26);
        double first = mono();
        for (int k = 0; k < mib; k++) {
            char hdr[32];
            snprintf(hdr, sizeof hdr, "%03d %010d ", rank, k);
            memcpy(block, hdr, 15);
            for (size_t at = 0; at < sizeof block; at += each)
                write_all(block + at, each < sizeof block - at ? each : sizeof block - at);
        }
        double last = mono();
        if (argc > 4) {
            char buf[128];
            int n = snprintf(buf, sizeof buf, "%s first %.9f\n%s last %.9f\n",
                             argv[2], first, argv[2], last);
            int fd = open(argv[4], O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
            if (fd < 0 || write(fd, buf, n) != n) _exit(90);
            close(fd);
        }
        return 0;
    }
    if (!strcmp(mode, "count")) {
        static char buf[1 << 20];
        long long lines = 0, bytes = 0;
        double t = 0;
        for (;;) {
            ssize_t k = read(0, buf, sizeof buf);
            if (k < 0) _exit(94);
            if (k == 0) break;
            t = mono();
            bytes += k;
            for (char *p = buf, *end = buf + k; (p = memchr(p, '\n', end - p)); p++) lines++;
        }
        char out[128];
        int n = snprintf(out, sizeof out, "%lld %lld %.9f\n", lines, bytes, t);
        int fd = open(argv[2], O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
        if (fd < 0 || write(fd, out, n) != n) _exit(95);
        close(fd);
        return 0;
    }
    if (!strcmp(mode, "observe")) {
#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
        int n = argc - 3;
        /* wake before the supervisor where allowed (root / CAP_SYS_NICE) */
        struct sched_param sp = {.sched_priority = 10};
        if (sched_setscheduler(0, SCHED_FIFO, &sp) != 0) { int r_ = nice(-10); (void)r_; }
        struct pollfd *pf = calloc(n, sizeof *pf);
        int out = open(argv[2], O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
        for (int i = 0; i < n; i++) {
            pf[i].fd = (int)syscall(SYS_pidfd_open, atoi(argv[3 + i]), 0);
            pf[i].events = POLLIN;
        }
        if (write(out, "ready\n", 6) != 6) return 92;
        for (int left = n; left > 0;) {
            if (poll(pf, n, -1) <= 0) continue;
            double t = mono();
            for (int i = 0; i < n; i++) {
                if (pf[i].fd >= 0 && (pf[i].revents & (POLLIN | POLLHUP | POLLERR))) {
                    char buf[64];
                    int k = snprintf(buf, sizeof buf, "%s %.9f\n", argv[3 + i], t);
                    if (write(out, buf, k) != k) return 93;
                    close(pf[i].fd);
                    pf[i].fd = -1;  /* poll() ignores negative fds */
                    left--;
                }
            }
        }
        return 0;
    }
    return 3;
}
