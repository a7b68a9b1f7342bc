/* transport_tcp.c -- non-blocking TCP streams with poll() and deadlines. See transport_tcp.h. */
#define _GNU_SOURCE
#include "transport_tcp.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

double hr_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Non-blocking, TCP_NODELAY, and the buffer sizes when asked; 0 or -1 with err set. */
static int setup_fd(int fd, int sockbuf, char *err, size_t errlen) {
    int fl, one = 1;
    if ((fl = fcntl(fd, F_GETFL)) < 0 || fcntl(fd, F_SETFL, fl | O_NONBLOCK) < 0) {
        snprintf(err, errlen, "fcntl(O_NONBLOCK) on fd %d: %s", fd, strerror(errno));
        return -1;
    }
    /* Not fatal: a socketpair (tests) has no TCP level. */
    (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    if (sockbuf > 0 && (setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &sockbuf, sizeof(sockbuf)) < 0 ||
                        setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &sockbuf, sizeof(sockbuf)) < 0)) {
        snprintf(err, errlen, "setsockopt(SO_SNDBUF/SO_RCVBUF=%d): %s", sockbuf, strerror(errno));
        return -1;
    }
    return 0;
}

int hr_tcp_init(hr_tcp_t *t, int rank, int size, const int *fds, int nconn, int sockbuf,
                char *err, size_t errlen) {
    int i;
    size_t n = (size_t)size * (size_t)nconn;

    memset(t, 0, sizeof(*t));
    t->fds = malloc(n * sizeof(int));
    if (!t->fds) {
        snprintf(err, errlen, "malloc(): out of memory");
        return -1;
    }
    for (i = 0; i < (int)n; i++) t->fds[i] = fds[i];
    t->rank = rank;
    t->size = size;
    t->nconn = nconn;
    t->sockbuf = sockbuf;
    for (i = 0; i < (int)n; i++)
        if (t->fds[i] >= 0 && setup_fd(t->fds[i], sockbuf, err, errlen) != 0) goto fail;
    return 0;
fail:
    free(t->fds); /* the caller still owns the descriptors */
    t->fds = NULL;
    return -1;
}

int hr_tcp_set(hr_tcp_t *t, int peer, const int *fds, int n, char *err, size_t errlen) {
    int k;
    if (!t->fds || peer < 0 || peer >= t->size || peer == t->rank || n < 1 || n > t->nconn) {
        snprintf(err, errlen, "bad peer %d or connection count %d (at most %d)", peer, n,
                 t->nconn);
        return -1;
    }
    if (t->fds[peer * t->nconn] >= 0) {
        snprintf(err, errlen, "rank %d is already connected", peer);
        return -1;
    }
    if (fds[0] < 0) {
        snprintf(err, errlen, "connection 0 to rank %d is missing", peer);
        return -1;
    }
    for (k = 0; k < n; k++)
        if (fds[k] >= 0 && setup_fd(fds[k], t->sockbuf, err, errlen) != 0) return -1;
    for (k = 0; k < n; k++) t->fds[peer * t->nconn + k] = fds[k];
    return 0;
}

void hr_tcp_drop(hr_tcp_t *t, int peer) {
    int k;
    if (!t->fds || peer < 0 || peer >= t->size) return;
    for (k = 0; k < t->nconn; k++) {
        int *fd = &t->fds[peer * t->nconn + k];
        if (*fd >= 0) close(*fd);
        *fd = -1;
    }
}

int hr_tcp_count(const hr_tcp_t *t) {
    int i, n = 0;
    if (!t->fds) return 0;
    for (i = 0; i < t->size * t->nconn; i++) n += t->fds[i] >= 0;
    return n;
}

void hr_tcp_close(hr_tcp_t *t) {
    int i;
    if (!t->fds) return;
    for (i = 0; i < t->size * t->nconn; i++)
        if (t->fds[i] >= 0) close(t->fds[i]);
    free(t->fds);
    t->fds = NULL;
}

void hr_tcp_abort(hr_tcp_t *t) {
    int i;
    if (!t->fds) return;
    for (i = 0; i < t->size * t->nconn; i++)
        if (t->fds[i] >= 0) shutdown(t->fds[i], SHUT_RDWR);
}

int hr_tcp_fd(const hr_tcp_t *t, int peer) { return hr_tcp_fdk(t, peer, 0); }

int hr_tcp_fdk(const hr_tcp_t *t, int peer, int k) {
    if (!t->fds || peer < 0 || peer >= t->size || k < 0 || k >= t->nconn) return -1;
    return t->fds[peer * t->nconn + k];
}

/* One non-blocking sendmsg/recvmsg on the peer's connection: bytes moved, 0 when it would
 * block, -1 with err set (EOF on a receive is an error: a peer never closes mid-collective). */
ssize_t hr_tcp_iok(hr_tcp_t *t, int peer, int k, struct iovec *iov, int iovcnt, int is_send,
                   char *err, size_t errlen) {
    struct msghdr m;
    ssize_t r;
    int fd = hr_tcp_fdk(t, peer, k);

    if (fd < 0) {
        /* on-demand connections (collectives/ring.py) open every peer an algorithm uses
         * before the call: reaching this is a bug, reported instead of a hang */
        snprintf(err, errlen, "failed: no connection to that rank (not in this rank's "
                 "connection set)");
        return -1;
    }
    memset(&m, 0, sizeof(m));
    m.msg_iov = iov;
    m.msg_iovlen = iovcnt;
    for (;;) {
        r = is_send ? sendmsg(fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT) : recvmsg(fd, &m, MSG_DONTWAIT);
        if (r > 0 || (r == 0 && is_send)) return r;
        if (r == 0) {
            snprintf(err, errlen, "failed: connection closed by peer (EOF)");
            return -1;
        }
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
        snprintf(err, errlen, "failed: %s(): %s", is_send ? "sendmsg" : "recvmsg", strerror(errno));
        return -1;
    }
}

ssize_t hr_tcp_sendv(hr_tcp_t *t, int peer, struct iovec *iov, int iovcnt, char *err,
                     size_t errlen) {
    return hr_tcp_iok(t, peer, 0, iov, iovcnt, 1, err, errlen);
}

ssize_t hr_tcp_recvv(hr_tcp_t *t, int peer, struct iovec *iov, int iovcnt, char *err,
                     size_t errlen) {
    return hr_tcp_iok(t, peer, 0, iov, iovcnt, 0, err, errlen);
}

int hr_poll(struct pollfd *pf, nfds_t n, int ms) {
    int i, r;
    for (i = 0; i < HR_TCP_SPIN && ms != 0; i++) {
        if ((r = poll(pf, n, 0)) != 0) return r;
        sched_yield();
    }
    return poll(pf, n, ms);
}

int hr_tcp_wait(hr_tcp_t *t, int speer, int rpeer, double deadline, char *err, size_t errlen) {
    struct pollfd p[2];
    int np = 0, si = -1, ri = -1, r, mask = 0;

    if (speer >= 0 && speer == rpeer) {
        p[0].fd = hr_tcp_fd(t, speer);
        p[0].events = POLLIN | POLLOUT;
        si = ri = np++;
    } else {
        if (speer >= 0) { p[np].fd = hr_tcp_fd(t, speer); p[np].events = POLLOUT; si = np++; }
        if (rpeer >= 0) { p[np].fd = hr_tcp_fd(t, rpeer); p[np].events = POLLIN; ri = np++; }
    }
    for (;;) {
        double left = deadline - hr_now();
        int ms;
        if (left <= 0) return 0;
        ms = (int)ceil(left * 1000.0);
        if (ms > 1000) ms = 1000; /* re-check the clock at least once a second */
        r = hr_poll(p, (nfds_t)np, ms);
        if (r < 0) {
            if (errno == EINTR) continue;
            snprintf(err, errlen, "failed: poll(): %s", strerror(errno));
            return -1;
        }
        if (r == 0) continue;
        if (si >= 0 && (p[si].revents & (POLLOUT | POLLERR | POLLHUP))) mask |= HR_TCP_WRITE;
        if (ri >= 0 && (p[ri].revents & (POLLIN | POLLERR | POLLHUP | POLLRDHUP))) mask |= HR_TCP_READ;
        if (si == ri && si >= 0) {
            /* Same socket both ways: keep only the directions that were asked for. */
            if (p[si].revents & (POLLERR | POLLHUP)) mask = HR_TCP_READ | HR_TCP_WRITE;
        }
        if (mask) return mask;
    }
}
