/* transport_shm.c -- shared-memory segment, phase signals and deadline-bounded waits.
 * See transport_shm.h. */
#define _GNU_SOURCE
#include "transport_shm.h"

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
#include <sys/uio.h>
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

static inline void hr_cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield" ::: "memory");
#endif
}

static long futex(uint32_t *addr, int op, uint32_t val, const struct timespec *ts) {
    return syscall(SYS_futex, addr, op, val, ts, NULL, 0);
}

uint32_t hr_shm_signal(hr_shm_t *s, const void *hdr) {
    hr_shm_cell_t *me = hr_shm_cell(s, s->lrank);
    if (hdr) {
        /* hstart = the phase this collective starts at, around the header (a seqlock) */
        __atomic_store_n(&me->hstart, 0, __ATOMIC_RELEASE);
        memcpy(me->hdr, hdr, sizeof(me->hdr));
        __atomic_store_n(&me->hstart, s->phase + 1, __ATOMIC_RELEASE);
    }
    __atomic_store_n(&me->phase, ++s->phase, __ATOMIC_SEQ_CST);
    /* pairs with hr_shm_wait's count-then-reread (both sequentially consistent): either the
     * waiter sees the new phase and does not sleep, or this sees it counted and wakes it */
    if (__atomic_load_n(&me->sleepers, __ATOMIC_SEQ_CST))
        futex(&me->phase, FUTEX_WAKE, INT_MAX, NULL);
    return s->phase;
}

void hr_shm_set_failed(hr_shm_t *s) {
    __atomic_store_n(&hr_shm_cell(s, s->lrank)->failed, 1, __ATOMIC_RELEASE);
}

/* Why local peer l is not coming: 1 = it died, 2 = it failed itself, 3 = out of step, 0 = alive. */
static int peer_state(const hr_shm_t *s, const hr_tcp_t *tcp, int l) {
    int fd = hr_tcp_fd(tcp, s->lranks[l]);
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

static int fail(hr_shm_why_t *why, int kind, int peer) {
    why->kind = kind;
    why->peer = peer;
    return -1;
}

int hr_shm_wait(hr_shm_t *s, const hr_tcp_t *tcp, double deadline, const int *failed,
                hr_shm_why_t *why) {
    uint32_t want = s->phase;
    int l, spins = 0, busy = s->busy > 0, l2, st, dead;
    unsigned reads = 0;
    double busy_end = 0;

    for (l = 0; l < s->lsize; l++) {
        hr_shm_cell_t *cl = hr_shm_cell(s, l);
        uint32_t v;
        if (l == s->lrank) continue;
        while ((int32_t)((v = __atomic_load_n(&cl->phase, __ATOMIC_ACQUIRE)) - want) < 0) {
            struct timespec ts = {0, 5000000};
            if (busy) {             /* a peer a few microseconds away: no system call at all */
                if (busy_end == 0) busy_end = hr_now() + s->busy * 1e-6;
                if ((++reads & 63) || hr_now() < busy_end) {
                    hr_cpu_relax();
                    continue;
                }
                busy = 0;
            }
            if (__atomic_load_n(failed, __ATOMIC_ACQUIRE)) return fail(why, HR_SHM_ABORTED, -1);
            if (++spins < s->spin) {
                sched_yield();
                continue;
            }
            __atomic_add_fetch(&cl->sleepers, 1, __ATOMIC_SEQ_CST);
            if ((int32_t)(__atomic_load_n(&cl->phase, __ATOMIC_SEQ_CST) - want) < 0)
                futex(&cl->phase, FUTEX_WAIT, v, &ts);
            __atomic_sub_fetch(&cl->sleepers, 1, __ATOMIC_SEQ_CST);
            /* woken by the signal (the common case): no clock, no look at the peers' sockets
             * (lsize poll calls, the cost that mattered with 8 ranks on 2 cores) */
            if ((int32_t)(__atomic_load_n(&cl->phase, __ATOMIC_ACQUIRE) - want) >= 0) break;
            if (hr_now() > deadline) return fail(why, HR_SHM_TIMEOUT, s->lranks[l]);
            /* Look at the peers first, then at the counter again: a peer signals before it sends
             * TCP data for its next collective (or exits), so data seen with the counter still
             * short means trouble, while a counter that moved means it is simply ahead. */
            st = peer_state(s, tcp, l);
            for (l2 = 0, dead = -1; l2 < s->lsize && dead < 0; l2++)
                if (l2 != s->lrank && peer_state(s, tcp, l2) == 1) dead = l2;
            if ((int32_t)(__atomic_load_n(&cl->phase, __ATOMIC_ACQUIRE) - want) >= 0) break;
            if (dead >= 0) return fail(why, HR_SHM_PEER_DIED, s->lranks[dead]);
            if (st == 2) return fail(why, HR_SHM_PEER_FAILED, s->lranks[l]);
            if (st == 3) return fail(why, HR_SHM_OUT_OF_STEP, s->lranks[l]);
        }
    }
    return 0;
}

int hr_shm_peer_hdr(const hr_shm_t *s, int l, uint32_t start, void *hdr) {
    hr_shm_cell_t *cl = hr_shm_cell(s, l);
    if (__atomic_load_n(&cl->hstart, __ATOMIC_ACQUIRE) != start) return 0;
    memcpy(hdr, cl->hdr, sizeof(cl->hdr));
    /* re-read: a header copied while the peer rewrote it for its next collective is discarded */
    return __atomic_load_n(&cl->hstart, __ATOMIC_ACQUIRE) == start;
}

void hr_shm_cma_publish(hr_shm_t *s) {
    s->probe = (uint64_t)(uintptr_t)&s->probe ^ HR_SHM_CMA_MAGIC;
    __atomic_store_n(&hr_shm_cell(s, s->lrank)->cma_probe, (uint64_t)(uintptr_t)&s->probe,
                     __ATOMIC_RELEASE);
}

int hr_shm_cma_probe(const hr_shm_t *s, int *err) {
    int l;
    *err = 0;
    for (l = 0; l < s->lsize; l++) {
        hr_shm_cell_t *cl = hr_shm_cell(s, l);
        uint64_t at = __atomic_load_n(&cl->cma_probe, __ATOMIC_ACQUIRE), got = 0;
        if (l == s->lrank) continue;
        if (!at || hr_shm_cma_read(s, l, &got, at, sizeof(got)) != 0) {
            *err = at ? errno : ENOENT;
            return 0;
        }
        if (got != (at ^ HR_SHM_CMA_MAGIC)) return 0;   /* another process behind that pid */
    }
    return 1;
}

int hr_shm_cma_read(const hr_shm_t *s, int l, void *dst, uint64_t src, size_t n) {
    return hr_vm_read((int)__atomic_load_n(&hr_shm_cell(s, l)->pid, __ATOMIC_ACQUIRE), dst, src, n);
}

int hr_vm_read(int pid, void *dst, uint64_t src, size_t n) {
    unsigned char *d = dst;
    if (pid <= 0) {
        errno = ESRCH;
        return -1;
    }
    while (n) {
        struct iovec lo = {d, n}, re = {(void *)(uintptr_t)src, n};
        ssize_t got = process_vm_readv(pid, &lo, 1, &re, 1, 0);
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) {
            if (got == 0) errno = EFAULT;
            return -1;
        }
        d += got;           /* a partial transfer stops at a page it could not pin: go on */
        src += (uint64_t)got;
        n -= (size_t)got;
    }
    return 0;
}
