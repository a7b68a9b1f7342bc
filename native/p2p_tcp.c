/* p2p_tcp.c -- framing of point-to-point messages on the fds (see p2p.h): the progress thread,
 * a waiter reading its peer's connection itself, reading frames into posted receives or
 * unexpected buffers, writing queued sends.
 *
 * Reading goes through a per-peer buffer so that a small frame (header and payload) costs one
 * recv(); a payload still missing is read with readv() straight into its destination, with the
 * buffer behind it to catch the next header in the same call.
 */
#define _GNU_SOURCE
#include "p2p.h"

#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <sys/epoll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "transport_tcp.h"   /* hr_now */

/* Register fd for the events in want (0: not at all); *reg holds what is registered now. */
static void ep_set(hr_p2p_t *b, int fd, uint32_t tag, uint32_t want, int *reg) {
    struct epoll_event ev;
    int op;
    if ((uint32_t)*reg == want || fd < 0) return;
    memset(&ev, 0, sizeof ev);
    ev.events = want;
    ev.data.u32 = tag;
    op = !want ? EPOLL_CTL_DEL : *reg ? EPOLL_CTL_MOD : EPOLL_CTL_ADD;
    /* ENOMEM aside these cannot fail on a live fd; a failed ADD leaves the fd to the waiters and
     * the next arm, a failed DEL to the shutdown that every failure of the pair does */
    if (epoll_ctl(b->ep_fd, op, fd, &ev) == 0 || !want) *reg = (int)want;
}

void hr_p2p_arm(hr_p2p_t *b, int peer) {
    hr_p2p_peer_t *p = &b->peers[peer];
    int live = !p->err && !b->closing;
    ep_set(b, p->in_fd, 2u * (uint32_t)peer,
           live && p->in_fd >= 0 && p->reading != HR_READ_WAITER ? EPOLLIN : 0, &p->in_reg);
    ep_set(b, p->out_fd, 2u * (uint32_t)peer + 1,
           !live || p->out_fd < 0 ? 0 : (p->sq_head && !p->writing && !p->send_waiter ? EPOLLOUT : 0) |
                                        (p->aw_head && p->acking != HR_READ_WAITER ? EPOLLIN : 0), &p->out_reg);
}

int hr_p2p_reads_here(hr_p2p_t *b, int peer) {
    hr_p2p_peer_t *p = &b->peers[peer];
    return p->reading == HR_READ_NONE || pthread_equal(p->reader, pthread_self());
}

void hr_p2p_write(hr_p2p_t *b, int peer) {
    hr_p2p_peer_t *p = &b->peers[peer];
    while (p->sq_head && !p->err && p->out_fd >= 0 && !p->writing && !b->closing) {
        hr_p2p_req_t *r = p->sq_head;
        size_t total;
        int fd = p->out_fd, e = 0;
        if (!r->moved) hr_p2p_offer(b, p, r);   /* to a peer that reads it directly: an offer */
        total = r->hdrlen + (r->direct ? 0 : r->nbytes);
        p->writing = 1;
        if (r->state == HR_P2P_POSTED) r->state = HR_P2P_ACTIVE;
        hr_p2p_unlock(b);
        while (r->moved < total) {
            struct iovec iov[2];
            struct msghdr mh;
            int n = 0;
            if (r->moved < r->hdrlen) {
                iov[n].iov_base = r->hdr + r->moved;
                iov[n++].iov_len = r->hdrlen - r->moved;
            }
            if (r->nbytes && !r->direct) {
                size_t off = r->moved > r->hdrlen ? r->moved - r->hdrlen : 0;
                iov[n].iov_base = r->buf + off;
                iov[n++].iov_len = r->nbytes - off;
            }
            memset(&mh, 0, sizeof mh);
            mh.msg_iov = iov;
            mh.msg_iovlen = (size_t)n;
            ssize_t k = sendmsg(fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
            if (k < 0) {
                if (errno == EINTR) continue;
                if (errno != EAGAIN && errno != EWOULDBLOCK) e = errno;
                break;
            }
            r->moved += (size_t)k;
        }
        pthread_mutex_lock(&b->mu);
        p->writing = 0;
        if (e) {
            char who[160], why[HR_P2P_WHYLEN];
            snprintf(why, sizeof why, "sending to %s failed: the connection broke: %s",
                     hr_p2p_who(b, peer, who, sizeof who), strerror(e));
            hr_p2p_fail_peer_locked(b, peer, why, HR_HINT_NONE);   /* r too: no longer writing */
            return;
        }
        if (r->moved < total) {
            if (p->err) hr_p2p_fail_peer_locked(b, peer, p->err, HR_HINT_NONE);
            else hr_p2p_arm(b, peer);       /* socket full: the progress thread waits for room */
            return;
        }
        p->sq_head = r->next;
        if (!p->sq_head) p->sq_tail = NULL;
        r->next = NULL;
        if (r->direct) hr_p2p_offered(b, peer, r);   /* done when the peer says it read it */
        else hr_p2p_complete(b, r, peer);
    }
    if (p->err && p->sq_head && !p->writing) hr_p2p_fail_peer_locked(b, peer, p->err, HR_HINT_NONE);
    hr_p2p_arm(b, peer);
}

/* A header was read: aim the payload at the oldest matching receive, or at a buffer of its own. */
static void begin_frame(hr_p2p_t *b, int peer) {
    hr_p2p_peer_t *p = &b->peers[peer];
    hr_p2p_req_t *r;
    char who[160], why[HR_P2P_WHYLEN];
    if (p->rdirect && p->pid <= 0) {        /* never agreed on this connection */
        snprintf(why, sizeof why, "%s offered a message for a direct read on a connection where "
                 "this rank cannot read its memory: a corrupt stream", hr_p2p_who(b, peer, who, sizeof who));
        hr_p2p_fail_peer_locked(b, peer, why, HR_HINT_NONE);
        return;
    }
    r = hr_p2p_match(b, peer, p->rtag);
    if (r && r->nbytes != p->rn) {
        size_t n = (size_t)p->rn;
        char sz[32];
        hr_p2p_size_text(n, sz, sizeof sz);
        hr_p2p_who(b, peer, who, sizeof who);
        hr_p2p_fail(b, r, HR_HINT_SIZE, "%s sent %s (%zu bytes) but this receive takes %zu bytes",
                    who, sz, n, r->nbytes);
        snprintf(why, sizeof why, "an earlier message from %s did not match its receive", who);
        hr_p2p_fail_peer_locked(b, peer, why, HR_HINT_NONE);
        return;
    }
    p->in_frame = 1;
    p->rleft = (size_t)p->rn;
    if (r) {
        r->state = HR_P2P_ACTIVE;
        p->rreq = r;
        p->rdst = r->buf;
        return;
    }
    /* a size no allocation could hold: a corrupt stream, refused before the sum can wrap */
    hr_p2p_msg_t *m = p->rn > ((uint64_t)1 << 48) ? NULL : malloc(sizeof *m + (size_t)p->rn);
    if (!m) {
        snprintf(why, sizeof why, "out of memory for a message of %llu bytes from %s",
                 (unsigned long long)p->rn, hr_p2p_who(b, peer, who, sizeof who));
        hr_p2p_fail_peer_locked(b, peer, why, HR_HINT_NONE);
        return;
    }
    m->next = NULL;
    m->source = peer;
    m->tag = p->rtag;
    m->n = (size_t)p->rn;
    m->data = (unsigned char *)(m + 1);
    p->rmsg = m;
    p->rdst = m->data;
}

/* The payload is in: complete the receive, or deliver/queue the unexpected message (a matching
 * receive may have been posted while it was read). */
static void end_frame(hr_p2p_t *b, int peer) {
    hr_p2p_peer_t *p = &b->peers[peer];
    if (p->rdirect && hr_p2p_direct_ack(b, peer) != 0) return;   /* the pair failed: r with it */
    p->in_frame = 0;
    if (p->rreq) {
        hr_p2p_req_t *r = p->rreq;
        p->rreq = NULL;
        hr_p2p_complete(b, r, peer);
    } else if (p->rmsg) {
        hr_p2p_msg_t *m = p->rmsg;
        hr_p2p_req_t *r = hr_p2p_match(b, peer, m->tag);
        p->rmsg = NULL;
        if (r) {
            hr_p2p_deliver(b, r, m);
        } else {
            if (b->unexp_tail) b->unexp_tail->next = m;
            else b->unexp_head = m;
            b->unexp_tail = m;
        }
    }
}

/* Read what peer's connection holds now (b->mu held; released during recv). */
static void read_peer(hr_p2p_t *b, int peer) {
    hr_p2p_peer_t *p = &b->peers[peer];
    for (;;) {
        struct iovec iov[2];
        int n = 0;
        ssize_t k;
        if (p->err || b->closing || p->in_fd < 0) return;
        if (p->rtake && p->rmsg) {          /* a receive was posted for it: the rest goes there */
            size_t got = p->rmsg->n - p->rleft;
            memcpy(p->rtake->buf, p->rmsg->data, got);
            p->rreq = p->rtake;
            p->rdst = p->rreq->buf + got;
            p->rtake = NULL;
            free(p->rmsg);
            p->rmsg = NULL;
        }
        if (!p->in_frame) {
            size_t have = p->ilen - p->ipos;
            uint64_t rn = have >= HR_P2P_HDR ? hr_p2p_get64(p->ibuf + p->ipos + 8) : 0;
            if (have >= HR_P2P_OFFER_HDR || (have >= HR_P2P_HDR && !(rn & HR_P2P_F_DIRECT))) {
                p->rtag = (int64_t)hr_p2p_get64(p->ibuf + p->ipos);
                p->rn = rn & ~HR_P2P_F_DIRECT;
                p->rdirect = (rn & HR_P2P_F_DIRECT) != 0;
                if (p->rdirect) {            /* an offer: the bytes are in the sender's memory */
                    p->raddr = hr_p2p_get64(p->ibuf + p->ipos + 16);
                    p->rtoken = hr_p2p_get64(p->ibuf + p->ipos + 24);
                }
                p->ipos += p->rdirect ? HR_P2P_OFFER_HDR : HR_P2P_HDR;
                begin_frame(b, peer);
                continue;
            }
        } else {
            if (p->rleft == 0) {
                end_frame(b, peer);
                continue;
            }
            if (p->rdirect) {                /* copied out of the sender's memory, not the stream */
                hr_p2p_direct_read(b, peer);
                continue;
            }
            if (p->ipos < p->ilen) {
                size_t c = p->ilen - p->ipos < p->rleft ? p->ilen - p->ipos : p->rleft;
                memcpy(p->rdst, p->ibuf + p->ipos, c);
                p->rdst += c;
                p->rleft -= c;
                p->ipos += c;
                continue;
            }
            iov[n].iov_base = p->rdst;
            iov[n++].iov_len = p->rleft;
        }
        if (p->ipos > 0) {                   /* keep a partial header at the buffer's start */
            memmove(p->ibuf, p->ibuf + p->ipos, p->ilen - p->ipos);
            p->ilen -= p->ipos;
            p->ipos = 0;
        }
        iov[n].iov_base = p->ibuf + p->ilen;
        iov[n++].iov_len = HR_P2P_IBUF - p->ilen;
        int fd = p->in_fd;
        hr_p2p_unlock(b);
        k = readv(fd, iov, n);
        int e = errno;
        pthread_mutex_lock(&b->mu);
        if (k == 0 || (k < 0 && e != EAGAIN && e != EWOULDBLOCK && e != EINTR)) {
            char who[160], why[HR_P2P_WHYLEN];
            hr_p2p_who(b, peer, who, sizeof who);
            if (k == 0) snprintf(why, sizeof why, "%s closed its connection (it exited or failed)", who);
            else snprintf(why, sizeof why, "%s connection error: %s", who, strerror(e));
            if (!b->closing) hr_p2p_fail_peer_locked(b, peer, why, HR_HINT_DIED);
            return;
        }
        if (k < 0) {
            if (e == EINTR) continue;
            return;                          /* drained */
        }
        if (n == 2) {                        /* the payload first, the rest into the buffer */
            size_t c = (size_t)k < p->rleft ? (size_t)k : p->rleft;
            p->rdst += c;
            p->rleft -= c;
            p->ilen += (size_t)k - c;
        } else {
            p->ilen += (size_t)k;
        }
    }
}

/* After a read: a pair that failed while this thread read it frees the bytes in flight now. */
static void read_done(hr_p2p_t *b, int peer) {
    hr_p2p_peer_t *p = &b->peers[peer];
    if (p->err && (p->rreq || p->rmsg || p->rtake)) hr_p2p_fail_peer_locked(b, peer, p->err, p->err_hint);
}

static int take_reading(hr_p2p_t *b, int peer, int who) {
    hr_p2p_peer_t *p = &b->peers[peer];
    if (p->reading != HR_READ_NONE || p->in_fd < 0 || p->err || b->closing) return 0;
    p->reading = who;
    p->reader = pthread_self();
    return 1;
}

static void give_reading(hr_p2p_t *b, int peer) {
    hr_p2p_peer_t *p = &b->peers[peer];
    read_done(b, peer);                     /* still the reader: the in-flight bytes are ours */
    p->reading = HR_READ_NONE;
    hr_p2p_arm(b, peer);                    /* back to the progress thread */
}

/* Wait for fd to be ready for events: poll without sleeping until busy_end (set on the first
 * call), then sleep until `until` (b->mu released meanwhile). */
void hr_p2p_park(hr_p2p_t *b, int fd, short events, double now, double until, double *busy_end) {
    struct pollfd pf = {.fd = fd, .events = events};
    if (until > now + HR_P2P_NAP) until = now + HR_P2P_NAP;
    if (*busy_end == 0) *busy_end = now + b->busy_s;
    hr_p2p_unlock(b);
    if (now < *busy_end) {                  /* the reply is often microseconds away */
        /* yield between looks: a thread this one would keep from its core (the peer's, on a
         * host where anything else runs) goes first; a spin that never yields measured 5-10x
         * slower round trips whenever a third thread wanted a core */
        while (poll(&pf, 1, 0) == 0 && hr_now() < *busy_end) {
            pf.revents = 0;
            sched_yield();
        }
    } else {
        poll(&pf, 1, (int)((until - now) * 1000.0) + 1);
    }
    pthread_mutex_lock(&b->mu);
}

int hr_p2p_read_for(hr_p2p_t *b, hr_p2p_req_t *r, double deadline) {
    hr_p2p_peer_t *p = &b->peers[r->peer];
    double busy_end = 0;
    if (!take_reading(b, r->peer, HR_READ_WAITER)) return 0;
    read_peer(b, r->peer);                  /* it may be here already: no epoll change then */
    while (r->state != HR_P2P_DONE && !p->err && !b->closing) {
        double now = hr_now(), until = deadline < r->deadline ? deadline : r->deadline;
        if (now >= until) break;            /* r's own deadline: the progress thread's to word */
        hr_p2p_arm(b, r->peer);             /* parked: the progress thread stops watching the fd */
        hr_p2p_park(b, p->in_fd, POLLIN, now, until, &busy_end);
        read_peer(b, r->peer);
    }
    give_reading(b, r->peer);
    return 1;
}

int hr_p2p_write_for(hr_p2p_t *b, hr_p2p_req_t *r, double deadline) {
    hr_p2p_peer_t *p = &b->peers[r->peer];
    double busy_end = 0;
    if (r->awaiting) return hr_p2p_ack_for(b, r, deadline);
    if (p->out_fd < 0 || p->err || b->closing || p->writing || p->send_waiter) return 0;
    p->send_waiter = 1;
    while (r->state != HR_P2P_DONE && !p->err && !b->closing) {
        double now, until;
        hr_p2p_write(b, r->peer);           /* from the queue's head, while the socket takes it */
        /* p->writing: another thread's; r->awaiting: written, the peer reads it (its token is
         * waited for below) */
        if (r->state == HR_P2P_DONE || p->err || p->writing || r->awaiting) break;
        now = hr_now();
        until = deadline < r->deadline ? deadline : r->deadline;
        if (now >= until) break;            /* r's own deadline: the progress thread's to word */
        hr_p2p_arm(b, r->peer);             /* parked: the progress thread stops watching the fd */
        hr_p2p_park(b, p->out_fd, POLLOUT, now, until, &busy_end);
    }
    p->send_waiter = 0;
    hr_p2p_arm(b, r->peer);
    if (r->awaiting) hr_p2p_ack_for(b, r, deadline);
    return 1;
}

void *hr_p2p_progress(void *arg) {
    hr_p2p_t *b = arg;
    struct epoll_event evs[64];
    pthread_mutex_lock(&b->mu);
    while (!b->closing) {
        double now = hr_now(), next = hr_p2p_expire(b, now);
        int ms;
        if (next > now + HR_P2P_NAP) next = now + HR_P2P_NAP;
        b->sleep_until = next;
        hr_p2p_unlock(b);
        ms = (int)((next - now) * 1000.0) + 1;
        int got = epoll_wait(b->ep_fd, evs, 64, ms);
        pthread_mutex_lock(&b->mu);
        b->sleep_until = 0;
        for (int j = 0; j < got; j++) {
            uint32_t tag = evs[j].data.u32;
            if (tag == UINT32_MAX) {
                uint64_t v;
                if (read(b->wake_fd, &v, sizeof v) < 0) { /* EAGAIN: drained by an earlier read */ }
                continue;
            }
            int peer = (int)(tag / 2);
            hr_p2p_peer_t *p = &b->peers[peer];
            if (tag % 2) {
                if (p->out_reg & EPOLLIN) hr_p2p_read_acks(b, peer);
                if (p->out_reg & EPOLLOUT) hr_p2p_write(b, peer);
            } else if (p->reading == HR_READ_WAITER) {
                hr_p2p_arm(b, peer);        /* a waiter took it after this event: let it be */
            } else if (p->in_reg && take_reading(b, peer, HR_READ_PROGRESS)) {
                read_peer(b, peer);
                give_reading(b, peer);
            } else if (p->err) {
                hr_p2p_arm(b, peer);        /* a failed pair: no more events from its fds */
            }
        }
    }
    hr_p2p_unlock(b);
    return NULL;
}
