/* p2p_queue.c -- the point-to-point match queue of one communicator (see p2p.h): requests,
 * matching per (sender, tag) in arrival order, receives from any rank, unexpected messages,
 * deadlines, sticky failure per peer, and the waits (a waiter blocks here with the GIL
 * released; a request nobody waits for goes to the done queue for the Python notifier).
 */
#define _GNU_SOURCE
#include "p2p.h"

#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "transport_tcp.h"   /* hr_now */

#define NO_DEADLINE 1e300

void hr_p2p_size_text(size_t n, char *out, size_t len) {
    static const struct { const char *u; size_t s; } units[] = {
        {"GiB", (size_t)1 << 30}, {"MiB", (size_t)1 << 20}, {"KiB", (size_t)1 << 10}};
    for (int i = 0; i < 3; i++)
        if (n >= units[i].s) {
            if (n % units[i].s == 0) snprintf(out, len, "%zu %s", n / units[i].s, units[i].u);
            else snprintf(out, len, "%.1f %s", (double)n / (double)units[i].s, units[i].u);
            return;
        }
    snprintf(out, len, "%zu B", n);
}

const char *hr_p2p_who(hr_p2p_t *b, int r, char *out, size_t len) {
    snprintf(out, len, "rank %d (%s)", r, (r >= 0 && r < b->size && b->hosts[r]) ? b->hosts[r] : "?");
    return out;
}

/* "recv from rank 2 (node1), tag 7, 4 MiB": the Python Request's describe(). */
static const char *describe(hr_p2p_t *b, hr_p2p_req_t *r, char *out, size_t len) {
    char who[160], sz[32];
    if (r->peer < 0) snprintf(who, sizeof who, "any rank");
    else hr_p2p_who(b, r->peer, who, sizeof who);
    hr_p2p_size_text(r->nbytes, sz, sizeof sz);
    snprintf(out, len, "%s %s %s, tag %lld, %s", r->kind == HR_P2P_SEND ? "send" : "recv",
             r->kind == HR_P2P_SEND ? "to" : "from", who, (long long)r->tag, sz);
    return out;
}

static int on_progress_thread(hr_p2p_t *b) {
    return b->thread_started && pthread_equal(pthread_self(), b->thread);
}

void hr_p2p_unlock(hr_p2p_t *b) {
    int k = b->kick;
    b->kick = 0;
    if (on_progress_thread(b)) k &= ~HR_KICK_WAKE;   /* it sets its next wake-up anyway */
    pthread_mutex_unlock(&b->mu);
    if (k & HR_KICK_DONE) pthread_cond_broadcast(&b->done_cv);
    if (k & HR_KICK_NOTIFY) pthread_cond_signal(&b->notify_cv);
    if (k & HR_KICK_WAKE) hr_p2p_wake(b);
}

void hr_p2p_wake(hr_p2p_t *b) {
    uint64_t one = 1;
    if (b->wake_fd >= 0 && write(b->wake_fd, &one, sizeof one) < 0) {
        /* EAGAIN: the counter is already non-zero, the thread wakes anyway */
    }
}

static void req_put_locked(hr_p2p_req_t *r) {
    if (--r->refs == 0) free(r);
}

void hr_p2p_req_put(hr_p2p_t *b, hr_p2p_req_t *r) {
    pthread_mutex_lock(&b->mu);
    req_put_locked(r);
    hr_p2p_unlock(b);
}

hr_p2p_req_t *hr_p2p_req_new(int kind, uint64_t id, void *buf, size_t nbytes, int peer,
                             int64_t tag, double timeout) {
    hr_p2p_req_t *r = calloc(1, sizeof *r);
    if (!r) return NULL;
    r->kind = kind;
    r->id = id;
    r->buf = buf;
    r->nbytes = nbytes;
    r->peer = peer;
    r->tag = tag;
    r->timeout = timeout;
    r->deadline = hr_now() + timeout;
    r->source = -1;
    r->refs = 1;
    r->hdrlen = HR_P2P_HDR;
    hr_p2p_put64(r->hdr, (uint64_t)tag);    /* the frame header */
    hr_p2p_put64(r->hdr + 8, (uint64_t)nbytes);
    return r;
}

/* The request is off every list (or never was on one): finish it. The box's reference goes with
 * it to the done queue when nobody waits, else it is dropped. */
static void finish(hr_p2p_t *b, hr_p2p_req_t *r) {
    __atomic_store_n(&r->state, HR_P2P_DONE, __ATOMIC_RELEASE);   /* read unlocked by hr_p2p_wait */
    if (r->waiters > 0) {
        b->kick |= HR_KICK_DONE;
        req_put_locked(r);
        return;
    }
    r->next = NULL;
    r->in_doneq = 1;
    r->done_at = hr_now();
    if (b->done_tail) b->done_tail->next = r;
    else b->done_head = r;
    b->done_tail = r;
    b->kick |= HR_KICK_NOTIFY;
}

void hr_p2p_complete(hr_p2p_t *b, hr_p2p_req_t *r, int source) {
    if (r->state == HR_P2P_DONE) return;
    r->source = source;
    finish(b, r);
}

void hr_p2p_fail(hr_p2p_t *b, hr_p2p_req_t *r, int hint, const char *fmt, ...) {
    va_list ap;
    if (r->state == HR_P2P_DONE) return;
    va_start(ap, fmt);
    vsnprintf(r->why, sizeof r->why, fmt, ap);
    va_end(ap);
    r->failed = 1;
    r->hint = hint;
    finish(b, r);
}

/* A request never queued (refused at its post): failed with its box reference taken first. */
static void refuse(hr_p2p_t *b, hr_p2p_req_t *r, const char *why) {
    r->refs++;
    hr_p2p_fail(b, r, HR_HINT_NONE, "%s", why);
}


/* Fail the sends queued to p that no thread is writing (all of them when none is), and the
 * offers awaiting their tokens (the reader's copy ends in a failed acknowledgement: p2p_direct.c). */
static void fail_sends(hr_p2p_t *b, hr_p2p_peer_t *p, const char *why, int hint) {
    hr_p2p_req_t *keep = p->writing ? p->sq_head : NULL;
    hr_p2p_req_t *r = keep ? keep->next : p->sq_head;
    while (r) {
        hr_p2p_req_t *next = r->next;
        hr_p2p_fail(b, r, hint, "%s", why);
        r = next;
    }
    if (keep) keep->next = NULL;
    p->sq_head = p->sq_tail = keep;
    for (r = p->aw_head; r;) {
        hr_p2p_req_t *next = r->next;
        r->awaiting = 0;
        hr_p2p_fail(b, r, hint, "%s", why);
        r = next;
    }
    p->aw_head = p->aw_tail = NULL;
}

void hr_p2p_fail_peer_locked(hr_p2p_t *b, int peer, const char *why, int hint) {
    hr_p2p_peer_t *p = &b->peers[peer];
    hr_p2p_req_t **pp = &b->posted_head, *r, *prev = NULL;
    if (!p->err) {
        p->err = strdup(why ? why : "failed");
        p->err_hint = hint;
        if (p->in_fd >= 0) shutdown(p->in_fd, SHUT_RDWR);
        if (p->out_fd >= 0) shutdown(p->out_fd, SHUT_RDWR);
    }
    while ((r = *pp)) {                     /* receives from this peer (not the any-rank ones) */
        if (r->peer == peer) {
            *pp = r->next;
            if (b->posted_tail == r) b->posted_tail = prev;
            hr_p2p_fail(b, r, hint, "%s", why);
        } else {
            prev = r;
            pp = &r->next;
        }
    }
    fail_sends(b, p, why, hint);
    if (hr_p2p_reads_here(b, peer)) {       /* the bytes in flight are this thread's own */
        if (p->rreq) hr_p2p_fail(b, p->rreq, hint, "%s", why);
        if (p->rtake) hr_p2p_fail(b, p->rtake, hint, "%s", why);
        free(p->rmsg);
        p->rreq = p->rtake = NULL;
        p->rmsg = NULL;
        p->in_frame = 0;
        p->rdirect = 0;
    }                                       /* else their reader frees them after its I/O */
    hr_p2p_arm(b, peer);                    /* out of the epoll set */
}

void hr_p2p_fail_peer(hr_p2p_t *b, int peer, const char *why, int hint) {
    if (peer < 0 || peer >= b->size) return;
    pthread_mutex_lock(&b->mu);
    hr_p2p_fail_peer_locked(b, peer, why, hint);
    hr_p2p_unlock(b);
}

hr_p2p_req_t *hr_p2p_match(hr_p2p_t *b, int source, int64_t tag) {
    hr_p2p_req_t **pp = &b->posted_head, *r, *prev = NULL;
    while ((r = *pp)) {
        if (r->tag == tag && (r->peer < 0 || r->peer == source)) {
            *pp = r->next;
            if (b->posted_tail == r) b->posted_tail = prev;
            r->next = NULL;
            return r;
        }
        prev = r;
        pp = &r->next;
    }
    return NULL;
}

void hr_p2p_deliver(hr_p2p_t *b, hr_p2p_req_t *r, hr_p2p_msg_t *m) {
    if (m->n != r->nbytes) {
        char who[160], sz[32];
        hr_p2p_size_text(m->n, sz, sizeof sz);
        hr_p2p_fail(b, r, HR_HINT_SIZE, "%s sent %s (%zu bytes) but this receive takes %zu bytes",
                    hr_p2p_who(b, m->source, who, sizeof who), sz, m->n, r->nbytes);
    } else {
        if (m->n) memcpy(r->buf, m->data, m->n);
        hr_p2p_complete(b, r, m->source);
    }
    free(m);
}

/* The progress thread sleeps in epoll_wait() until b->sleep_until (0: awake); a request due earlier
 * must wake it. */
static void wake_for(hr_p2p_t *b, double deadline) {
    if (b->sleep_until != 0 && deadline < b->sleep_until) b->kick |= HR_KICK_WAKE;
}

/* A message of r's size being read into a buffer of its own (it came before any receive) that
 * no earlier posted receive matches: r takes it over, so the rest of a large message goes
 * straight into r->buf instead of through a second copy. 1 when taken. */
static int take_in_flight(hr_p2p_t *b, hr_p2p_req_t *r) {
    for (int i = 0; i < b->size; i++) {
        hr_p2p_peer_t *p = &b->peers[i];
        hr_p2p_msg_t *m = p->rmsg;
        hr_p2p_req_t *q;
        if ((r->peer >= 0 && r->peer != i) || !m || p->rtake || p->err || m->tag != r->tag ||
            m->n != r->nbytes)
            continue;
        for (q = b->posted_head; q; q = q->next)
            if (q->tag == m->tag && (q->peer < 0 || q->peer == i)) break;
        if (q) continue;                    /* that one is first in line */
        r->state = HR_P2P_ACTIVE;
        p->rtake = r;
        return 1;
    }
    return 0;
}

void hr_p2p_post_recv(hr_p2p_t *b, hr_p2p_req_t *r) {
    hr_p2p_msg_t **mp, *m, *prev = NULL;
    pthread_mutex_lock(&b->mu);
    if (b->closing) {
        refuse(b, r, "the communicator is closed");
    } else if (r->peer >= 0 && b->peers[r->peer].err) {
        refuse(b, r, b->peers[r->peer].err);
    } else {
        for (mp = &b->unexp_head; (m = *mp); prev = m, mp = &m->next)
            if (m->tag == r->tag && (r->peer < 0 || m->source == r->peer)) break;
        r->refs++;
        if (m) {
            *mp = m->next;
            if (b->unexp_tail == m) b->unexp_tail = prev;
            hr_p2p_deliver(b, r, m);
        } else if (take_in_flight(b, r)) {
            /* the progress thread moves what it read so far and reads the rest into r->buf */
        } else {
            r->next = NULL;
            if (b->posted_tail) b->posted_tail->next = r;
            else b->posted_head = r;
            b->posted_tail = r;
            wake_for(b, r->deadline);
        }
    }
    hr_p2p_unlock(b);
}

int hr_p2p_post_send(hr_p2p_t *b, hr_p2p_req_t *r) {
    hr_p2p_peer_t *p = &b->peers[r->peer];
    int done;
    pthread_mutex_lock(&b->mu);
    r->waiters++;                           /* the caller learns of an inline completion itself */
    if (b->closing) {
        refuse(b, r, "the communicator is closed");
    } else if (p->err) {
        refuse(b, r, p->err);
    } else {
        r->refs++;
        r->next = NULL;
        if (p->sq_tail) p->sq_tail->next = r;
        else p->sq_head = r;
        p->sq_tail = r;
        if (p->sq_head == r && p->out_fd >= 0 && !p->writing) hr_p2p_write(b, r->peer);
        if (r->state != HR_P2P_DONE)
            wake_for(b, r->deadline);       /* the rest is the progress thread's (hr_p2p_write armed the fd) */
    }
    r->waiters--;
    done = r->state == HR_P2P_DONE;
    hr_p2p_unlock(b);
    return done;
}

int hr_p2p_wait(hr_p2p_t *b, hr_p2p_req_t *r, double deadline) {
    int done;
    double busy_end = 0;
    pthread_mutex_lock(&b->mu);
    r->waiters++;
    while (r->state != HR_P2P_DONE) {
        double now = hr_now();
        struct timespec ts;
        if (now >= deadline) break;
        /* a receive from one rank, or a send: move its bytes here, unless another thread does */
        if (now < r->deadline && (r->kind == HR_P2P_RECV ? r->peer >= 0 && hr_p2p_read_for(b, r, deadline)
                                                         : hr_p2p_write_for(b, r, deadline)))
            continue;
        if (busy_end == 0) busy_end = now + b->busy_s;
        int *busy = r->peer < 0 ? NULL : r->kind == HR_P2P_RECV ? &b->peers[r->peer].reading
                  : r->awaiting ? &r->awaiting : &b->peers[r->peer].writing;
        if (now < busy_end && busy && *busy) {
            /* another thread (the progress thread) moves r's bytes now: it is about to finish, and
             * a sleep on done_cv would cost its signal and this thread's wake-up */
            pthread_mutex_unlock(&b->mu);
            while (__atomic_load_n(&r->state, __ATOMIC_ACQUIRE) != HR_P2P_DONE &&
                   __atomic_load_n(busy, __ATOMIC_RELAXED) && hr_now() < busy_end)
                sched_yield();
            pthread_mutex_lock(&b->mu);
            continue;
        }
        clock_gettime(CLOCK_MONOTONIC, &ts);
        double until = (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec + (deadline - now);
        ts.tv_sec = (time_t)until;
        ts.tv_nsec = (long)((until - (double)ts.tv_sec) * 1e9);
        pthread_cond_timedwait(&b->done_cv, &b->mu, &ts);
    }
    r->waiters--;
    done = r->state == HR_P2P_DONE;
    hr_p2p_unlock(b);
    return done;
}

void hr_p2p_claim(hr_p2p_t *b, hr_p2p_req_t *r) {
    pthread_mutex_lock(&b->mu);
    if (r->in_doneq) {
        hr_p2p_req_t **pp = &b->done_head, *prev = NULL;
        while (*pp && *pp != r) { prev = *pp; pp = &(*pp)->next; }
        if (*pp) {
            *pp = r->next;
            if (b->done_tail == r) b->done_tail = prev;
            r->next = NULL;
            r->in_doneq = 0;
            req_put_locked(r);
        }
    }
    pthread_mutex_unlock(&b->mu);
}

int hr_p2p_take_done(hr_p2p_t *b, uint64_t *ids, int max, double deadline) {
    int n = 0;
    pthread_mutex_lock(&b->mu);
    while (!b->closed) {
        double now = hr_now(), wake = deadline;
        struct timespec ts;
        if (b->done_head) {
            if (b->done_head->done_at + HR_P2P_NOTIFY_DELAY <= now) break;
            if (b->done_head->done_at + HR_P2P_NOTIFY_DELAY < wake) wake = b->done_head->done_at + HR_P2P_NOTIFY_DELAY;
        }
        if (now >= deadline) break;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        double until = (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec + (wake - now);
        ts.tv_sec = (time_t)until;
        ts.tv_nsec = (long)((until - (double)ts.tv_sec) * 1e9);
        pthread_cond_timedwait(&b->notify_cv, &b->mu, &ts);
    }
    while (b->done_head && n < max && (b->closed || b->done_head->done_at + HR_P2P_NOTIFY_DELAY <= hr_now())) {
        hr_p2p_req_t *r = b->done_head;
        b->done_head = r->next;
        if (!b->done_head) b->done_tail = NULL;
        r->in_doneq = 0;
        ids[n++] = r->id;
        req_put_locked(r);
    }
    if (n == 0 && b->closed) n = -1;
    hr_p2p_unlock(b);
    return n;
}

/* Fail one request that is due and not moving bytes, worded as the Python mailbox did: what was
 * missing (no connection, no message, no room), then the pair fails (a late message could match
 * the wrong receive). */
static void expire_one(hr_p2p_t *b, hr_p2p_req_t *r) {
    char who[160], d[320], why[HR_P2P_WHYLEN], sticky[2 * HR_P2P_WHYLEN];
    hr_p2p_peer_t *p = r->peer >= 0 ? &b->peers[r->peer] : NULL;
    describe(b, r, d, sizeof d);
    if (p) hr_p2p_who(b, r->peer, who, sizeof who);
    snprintf(sticky, sizeof sticky, "an earlier %s timed out", d);
    if (r->kind == HR_P2P_RECV) {
        if (p && !p->in_seen) {
            hr_p2p_fail(b, r, HR_HINT_CONNECT, "%s never connected within the %g s deadline: it has "
                        "sent nothing to this rank", who, r->timeout);
        } else {
            hr_p2p_fail(b, r, HR_HINT_LATE, "%s within the %g s deadline",
                        p ? (snprintf(why, sizeof why, "%s did not send it", who), why) : "no rank sent it",
                        r->timeout);
        }
        if (p) hr_p2p_fail_peer_locked(b, r->peer, sticky, HR_HINT_NONE);
        return;
    }
    if (p->out_fd < 0) {
        snprintf(why, sizeof why, "no connection to %s within the %g s deadline: it never opened "
                 "point-to-point", who, r->timeout);
        hr_p2p_fail(b, r, HR_HINT_CONNECT, "%s", why);
        snprintf(sticky, sizeof sticky, "point-to-point with %s failed earlier: %s", who, why);
    } else if (r->moved > 0) {
        snprintf(sticky, sizeof sticky, "the link with %s stalled mid-message (deadline %g s)", who,
                 r->timeout);
        hr_p2p_fail(b, r, HR_HINT_STALL, "%s", sticky);        /* off the queue already */
        hr_p2p_fail_peer_locked(b, r->peer, sticky, HR_HINT_STALL);
        return;
    } else {
        hr_p2p_fail(b, r, HR_HINT_NONE, "not written to the connection within the %g s deadline "
                    "(the receiver does not drain)", r->timeout);
    }
    hr_p2p_fail_peer_locked(b, r->peer, sticky, HR_HINT_NONE);
}

double hr_p2p_expire(hr_p2p_t *b, double now) {
    for (;;) {
        double next = NO_DEADLINE;
        hr_p2p_req_t *due = NULL, *r;
        int stalled = -1, unread = -1;
        for (r = b->posted_head; r; r = r->next) {
            if (r->deadline <= now) { due = r; break; }
            if (r->deadline < next) next = r->deadline;
        }
        for (int i = 0; !due && stalled < 0 && i < b->size; i++) {
            hr_p2p_peer_t *p = &b->peers[i];
            /* a failed pair's requests failed with it, but for the bytes in flight, which the
             * thread moving them frees after its I/O: nothing here is due any more */
            if (p->err) continue;
            for (r = p->sq_head; r && !due; r = r->next) {
                if (r == p->sq_head && p->writing) continue;   /* its writer checks after the I/O */
                if (r->deadline <= now) due = r;
                else if (r->deadline < next) next = r->deadline;
            }
            for (int k = 0; k < 2; k++) {
                hr_p2p_req_t *q = k ? p->rtake : p->rreq;
                if (!q) continue;
                if (q->deadline <= now) stalled = i;
                else if (q->deadline < next) next = q->deadline;
            }
            for (r = p->aw_head; r && stalled < 0; r = r->next) {
                if (r->deadline <= now) unread = stalled = i;
                else if (r->deadline < next) next = r->deadline;
            }
        }
        if (stalled >= 0) {
            char who[160], why[HR_P2P_WHYLEN];
            hr_p2p_peer_t *p = &b->peers[stalled];
            hr_p2p_who(b, stalled, who, sizeof who);
            if (unread >= 0)
                snprintf(why, sizeof why, "%s did not read a message offered to it within the %g s "
                         "deadline (it froze, or its reading thread is stuck)", who, p->aw_head->timeout);
            else
                snprintf(why, sizeof why, "the link with %s stalled mid-message (deadline %g s)", who,
                         (p->rreq ? p->rreq : p->rtake)->timeout);
            hr_p2p_fail_peer_locked(b, stalled, why, HR_HINT_STALL);   /* this thread's rreq too */
            continue;
        }
        if (!due) return next;
        if (due->kind == HR_P2P_RECV) {         /* off the posted list first */
            hr_p2p_req_t **pp = &b->posted_head, *prev = NULL;
            while (*pp != due) { prev = *pp; pp = &(*pp)->next; }
            *pp = due->next;
            if (b->posted_tail == due) b->posted_tail = prev;
        } else {
            hr_p2p_peer_t *p = &b->peers[due->peer];
            hr_p2p_req_t **pp = &p->sq_head, *prev = NULL;
            while (*pp != due) { prev = *pp; pp = &(*pp)->next; }
            *pp = due->next;
            if (p->sq_tail == due) p->sq_tail = prev;
        }
        expire_one(b, due);
    }
}

int hr_p2p_set_fd(hr_p2p_t *b, int peer, int fd, int incoming, int direct, char *err, size_t errlen) {
    hr_p2p_peer_t *p;
    int rc = -1;
    if (peer < 0 || peer >= b->size || peer == b->rank) {
        snprintf(err, errlen, "peer rank %d is not another rank of 0-%d", peer, b->size - 1);
        return -1;
    }
    p = &b->peers[peer];
    pthread_mutex_lock(&b->mu);
    if (b->closing) {
        snprintf(err, errlen, "the communicator is closed");
    } else if (incoming ? p->in_fd >= 0 || p->in_seen : p->out_fd >= 0) {
        snprintf(err, errlen, "a second %s connection with rank %d", incoming ? "incoming" : "outgoing", peer);
    } else {
        int fl = fcntl(fd, F_GETFL);        /* every read and write here must not block */
        if (fl >= 0) fcntl(fd, F_SETFL, fl | O_NONBLOCK);
        if (incoming) {
            p->in_fd = fd;
            p->in_seen = 1;
            p->pid = direct > 0 ? direct : 0;
        } else {
            p->out_fd = fd;
            p->direct_out = direct != 0;
        }
        if (p->err) shutdown(fd, SHUT_RDWR);   /* owned now; the pair failed already */
        hr_p2p_arm(b, peer);
        rc = 0;
    }
    hr_p2p_unlock(b);
    return rc;
}

int hr_p2p_init(hr_p2p_t *b, int rank, int size, const char *const *hosts, char *err, size_t errlen) {
    pthread_condattr_t ca;
    memset(b, 0, sizeof *b);
    b->rank = rank;
    b->size = size;
    b->wake_fd = b->ep_fd = -1;
    pthread_mutex_init(&b->mu, NULL);
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&b->done_cv, &ca);
    pthread_cond_init(&b->notify_cv, &ca);
    pthread_condattr_destroy(&ca);
    b->peers = calloc((size_t)size, sizeof *b->peers);
    b->hosts = calloc((size_t)size, sizeof *b->hosts);
    if (!b->peers || !b->hosts) goto oom;
    for (int i = 0; i < size; i++) {
        b->peers[i].in_fd = b->peers[i].out_fd = -1;
        if (hosts && hosts[i] && !(b->hosts[i] = strdup(hosts[i]))) goto oom;
        if (i != rank && !(b->peers[i].ibuf = malloc(HR_P2P_IBUF))) goto oom;
    }
    b->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    b->ep_fd = epoll_create1(EPOLL_CLOEXEC);
    if (b->wake_fd < 0 || b->ep_fd < 0) {
        snprintf(err, errlen, "%s: %s", b->wake_fd < 0 ? "eventfd()" : "epoll_create1()", strerror(errno));
        hr_p2p_free(b);
        return -1;
    }
    struct epoll_event ev = {.events = EPOLLIN, .data.u32 = UINT32_MAX};
    if (epoll_ctl(b->ep_fd, EPOLL_CTL_ADD, b->wake_fd, &ev) != 0) {
        snprintf(err, errlen, "epoll_ctl(): %s", strerror(errno));
        hr_p2p_free(b);
        return -1;
    }
    /* busy polling only where every rank of this host has a core of its own: else the peer it
     * waits for needs this core (as the collectives' shared-memory waits, comm.c) */
    int local = 0;
    for (int i = 0; i < size; i++)
        local += !hosts || !hosts[i] || !hosts[rank] || strcmp(hosts[i], hosts[rank]) == 0;
    b->busy_s = local > sysconf(_SC_NPROCESSORS_ONLN) ? 0 : HR_P2P_BUSY_US * 1e-6;
    b->direct_min = (size_t)-1;             /* no offers until the mailbox sets its cut */
    if (pthread_create(&b->thread, NULL, hr_p2p_progress, b) != 0) {
        snprintf(err, errlen, "cannot start the point-to-point progress thread");
        hr_p2p_free(b);
        return -1;
    }
    b->thread_started = 1;
    return 0;
oom:
    snprintf(err, errlen, "out of memory");
    hr_p2p_free(b);
    return -1;
}

void hr_p2p_close(hr_p2p_t *b) {
    if (!b->peers) return;
    pthread_mutex_lock(&b->mu);
    if (b->closing) {
        hr_p2p_unlock(b);
        return;
    }
    b->closing = 1;
    hr_p2p_unlock(b);
    hr_p2p_wake(b);
    if (b->thread_started) pthread_join(b->thread, NULL);
    b->thread_started = 0;
    pthread_mutex_lock(&b->mu);
    for (int i = 0; i < b->size; i++) {      /* an inline write ends soon: its socket never blocks; */
        while (b->peers[i].writing || b->peers[i].reading || b->peers[i].send_waiter ||
               b->peers[i].acking) {        /* waiters see closing */
            hr_p2p_unlock(b);
            usleep(200);
            pthread_mutex_lock(&b->mu);
        }
    }
    while (b->posted_head) {
        hr_p2p_req_t *r = b->posted_head;
        b->posted_head = r->next;
        hr_p2p_fail(b, r, HR_HINT_NONE, "the communicator was closed");
    }
    b->posted_tail = NULL;
    while (b->unexp_head) {
        hr_p2p_msg_t *m = b->unexp_head;
        b->unexp_head = m->next;
        free(m);
    }
    b->unexp_tail = NULL;
    for (int i = 0; i < b->size; i++) {
        hr_p2p_peer_t *p = &b->peers[i];
        fail_sends(b, p, "the communicator was closed", HR_HINT_NONE);
        if (p->rreq) hr_p2p_fail(b, p->rreq, HR_HINT_NONE, "the communicator was closed");
        if (p->rtake) hr_p2p_fail(b, p->rtake, HR_HINT_NONE, "the communicator was closed");
        free(p->rmsg);
        p->rreq = p->rtake = NULL;
        p->rmsg = NULL;
        if (p->in_fd >= 0) { shutdown(p->in_fd, SHUT_RDWR); close(p->in_fd); }
        if (p->out_fd >= 0) { shutdown(p->out_fd, SHUT_RDWR); close(p->out_fd); }
        p->in_fd = p->out_fd = -1;
    }
    b->closed = 1;
    pthread_cond_broadcast(&b->done_cv);
    pthread_cond_broadcast(&b->notify_cv);
    hr_p2p_unlock(b);
}

void hr_p2p_free(hr_p2p_t *b) {
    if (!b->peers || !b->hosts) {            /* init ran out of memory */
        free(b->peers);
        free(b->hosts);
        b->peers = NULL;
        b->hosts = NULL;
        return;
    }
    hr_p2p_close(b);
    while (b->done_head) {                   /* completions nobody took: only the box's refs */
        hr_p2p_req_t *r = b->done_head;
        b->done_head = r->next;
        r->in_doneq = 0;
        req_put_locked(r);
    }
    for (int i = 0; i < b->size; i++) {
        free(b->peers[i].ibuf);
        free(b->peers[i].err);
        free(b->hosts[i]);
    }
    free(b->peers);
    free(b->hosts);
    b->peers = NULL;
    b->hosts = NULL;
    if (b->wake_fd >= 0) close(b->wake_fd);
    if (b->ep_fd >= 0) close(b->ep_fd);
    b->wake_fd = b->ep_fd = -1;
    pthread_cond_destroy(&b->done_cv);
    pthread_cond_destroy(&b->notify_cv);
    pthread_mutex_destroy(&b->mu);
}
