/* transport_shm.c -- shared-memory segment, phase signals and deadline-bounded waits.
 * See transport_shm.h. */
#define _GNU_SOURCE
#include "hr_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <poll.h>
#include <sched.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

size_t hr_shm_bytes(int lsize, size_t slot) {
    size_t hdr = (64 + (size_t)lsize * sizeof(hr_shm_cell_t) + 4095) & ~(size_t)4095;
    return hdr + (size_t)lsize * 2 * slot;
}

int hr_shm_map(const char *name, int create, size_t bytes, unsigned char **out, char *err,
               size_t errlen) {
    int fd = -1, rc = -1;
    void *p;
    struct stat st;

    *out = NULL;
    fd = shm_open(name, create ? (O_RDWR | O_CREAT | O_EXCL) : O_RDWR, 0600);
    if (fd < 0) {
        snprintf(err, errlen, "shm_open(%s%s): %s", name, create ? ", O_CREAT|O_EXCL" : "",
                 strerror(errno));
        goto cleanup;
    }
    /* posix_fallocate, not ftruncate: a sparse segment larger than a small /dev/shm (64 MiB in
     * many containers) would kill the ranks with SIGBUS on first touch instead of failing here */
    if (create && (errno = posix_fallocate(fd, 0, (off_t)bytes)) != 0) {
        snprintf(err, errlen, "posix_fallocate(%s, %zu bytes): %s", name, bytes, strerror(errno));
        shm_unlink(name);
        goto cleanup;
    }
    if (!create && (fstat(fd, &st) < 0 || (size_t)st.st_size != bytes)) {
        snprintf(err, errlen, "shared-memory segment %s has %lld bytes, expected %zu (ranks of "
                 "this node disagree on the piece size or the rank count)", name,
                 (long long)st.st_size, bytes);
        goto cleanup;
    }
    p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
        snprintf(err, errlen, "mmap(%s, %zu): %s", name, bytes, strerror(errno));
        if (create) shm_unlink(name);
        goto cleanup;
    }
    *out = p;
    rc = 0;
cleanup:
    if (fd >= 0) close(fd);
    return rc;
}

int hr_shm_unlink(const char *name, char *err, size_t errlen) {
    if (shm_unlink(name) < 0 && errno != ENOENT) {
        snprintf(err, errlen, "shm_unlink(%s): %s", name, strerror(errno));
        return -1;
    }
    return 0;
}

static long futex(uint32_t *addr, int op, uint32_t val, const struct timespec *ts) {
    return syscall(SYS_futex, addr, op, val, ts, NULL, 0);
}

void hr_shm_signal(hr_op_t *op) {
    hr_shm_t *s = &op->c->shm;
    hr_shm_cell_t *me = hr_shm_cell(s, s->lrank);
    if (op->shm_signals++ == 0) {
        /* hstart = the phase this collective starts at, around the header (a seqlock) */
        __atomic_store_n(&me->hstart, 0, __ATOMIC_RELEASE);
        memcpy(me->hdr, &op->hdr, sizeof(op->hdr));
        __atomic_store_n(&me->hstart, s->phase + 1, __ATOMIC_RELEASE);
        op->shm_start = s->phase + 1;
    }
    __atomic_store_n(&me->phase, ++s->phase, __ATOMIC_RELEASE);
    futex(&me->phase, FUTEX_WAKE, INT_MAX, NULL);
}

/* Why local peer l is not coming: 1 = it died, 2 = it failed itself, 3 = out of step, 0 = alive. */
static int peer_state(hr_comm_t *c, int l) {
    hr_shm_t *s = &c->shm;
    int fd = hr_tcp_fd(&c->tcp, s->lranks[l]);
    struct pollfd p;
    char b;
    ssize_t r;
    if (__atomic_load_n(&hr_shm_cell(s, l)->failed, __ATOMIC_ACQUIRE)) return 2;
    if (fd < 0) return 0;
    p.fd = fd;
    p.events = POLLIN | POLLRDHUP;
    if (poll(&p, 1, 0) <= 0) return 0;
    r = recv(fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
    if (r == 0 || (r < 0 && errno != EAGAIN && errno != EINTR)) return 1;
    return r > 0 ? 3 : 0;
}

int hr_shm_wait(hr_op_t *op, const char *what) {
    hr_comm_t *c = op->c;
    hr_shm_t *s = &c->shm;
    uint32_t want = s->phase;
    int l, spins = 0, l2, st, dead;
    char why[192];

    for (l = 0; l < s->lsize; l++) {
        hr_shm_cell_t *cl = hr_shm_cell(s, l);
        uint32_t v;
        if (l == s->lrank) continue;
        while ((int32_t)((v = __atomic_load_n(&cl->phase, __ATOMIC_ACQUIRE)) - want) < 0) {
            struct timespec ts = {0, 5000000};
            if (__atomic_load_n(&c->failed, __ATOMIC_ACQUIRE)) return HR_ERR;
            if (++spins < s->spin) {
                sched_yield();
                continue;
            }
            futex(&cl->phase, FUTEX_WAIT, v, &ts);
            if (hr_now() > op->deadline) {
                snprintf(why, sizeof(why), "(shared memory, %s) timed out after %.1f s", what,
                         op->timeout);
                return hr_op_fail_peer(op, 1, s->lranks[l], why);
            }
            /* Look at the peers first, then at the counter again: a peer signals before it sends
             * TCP data for its next collective (or exits), so data seen with the counter still
             * short means trouble, while a counter that moved means it is simply ahead. */
            st = peer_state(c, l);
            for (l2 = 0, dead = -1; l2 < s->lsize && dead < 0; l2++)
                if (l2 != s->lrank && peer_state(c, l2) == 1) dead = l2;
            if ((int32_t)(__atomic_load_n(&cl->phase, __ATOMIC_ACQUIRE) - want) >= 0) break;
            /* name a dead peer before one that failed because of it; the "recv from rank ..., x/y
             * bytes done" form is the one the hang report (diagnostics/report.py) parses */
            if (dead >= 0) {
                snprintf(why, sizeof(why), "failed: connection closed by peer (EOF) without an error "
                         "report: it died during the shared-memory %s (same node)", what);
                return hr_op_fail_peer(op, 1, s->lranks[dead], why);
            }
            switch (st) {
            case 2:
                snprintf(why, sizeof(why), "failed: it reported an error during the shared-memory %s "
                         "(same node; see its message)", what);
                return hr_op_fail_peer(op, 1, s->lranks[l], why);
            case 3:
                return hr_op_fail(op, "rank %d (%s, same node) sent TCP data while this rank waits in "
                                  "shared memory (%s); the ranks are out of step (mismatched "
                                  "collectives)", s->lranks[l], c->hosts[s->lranks[l]], what);
            default:
                break;
            }
        }
    }
    return HR_OK;
}

/* After the first wait of a collective: every local peer must be in the same collective. */
int hr_shm_check_peers(hr_op_t *op) {
    hr_shm_t *s = &op->c->shm;
    int l;
    for (l = 0; l < s->lsize; l++) {
        hr_shm_cell_t *cl = hr_shm_cell(s, l);
        hr_hdr_t h;
        if (l == s->lrank) continue;
        if (__atomic_load_n(&cl->hstart, __ATOMIC_ACQUIRE) != op->shm_start) continue;
        memcpy(&h, cl->hdr, sizeof(h));
        /* a peer that already moved on to the next collective passed this one with us */
        if (__atomic_load_n(&cl->hstart, __ATOMIC_ACQUIRE) != op->shm_start) continue;
        if (hr_op_check_hdr(op, &h, s->lranks[l]) != HR_OK) return HR_ERR;
    }
    return HR_OK;
}
