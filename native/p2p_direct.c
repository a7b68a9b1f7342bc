/* p2p_direct.c -- point-to-point within a host by direct reads (see p2p.h): the sender offers
 * its buffer, the receiver copies it out of the sender's memory, the token comes back.
 *
 * Steps for a send of S >= direct_min bytes to a peer that proved it can read this rank's memory:
 *   sender:   write the offer (tag, S | HR_P2P_F_DIRECT, address, token); keep the send pending
 *             on the peer's awaiting list
 *   receiver: match the offer as any frame; process_vm_readv S bytes into the posted receive
 *             (none posted: into a buffer of its own, as an unexpected message); write the token
 *             back on the same socket; then complete the receive
 *   sender:   read the token (progress thread), complete the send
 * Cost: S bytes copied once (a stream: twice, into and out of the socket buffers, in pieces of
 * the socket's buffer size), plus a 32-byte offer and an 8-byte token: about one extra wake-up,
 * on a stream the sender's and the receiver's copies overlap on two cores, so up to a few MiB
 * the stream is as fast or faster and small messages stay on it (HPCRING_P2P_DIRECT_MIN, 8 MiB
 * as measured: docs/collectives.md "Point-to-point").
 *
 * The token is written before the receive completes, and a failed write fails the receive: a
 * sender that gave up (its deadline, its pair failed) shuts its socket down before its caller
 * gets the buffer back, so a receiver never completes with bytes read from a buffer already
 * handed back.
 */
#define _GNU_SOURCE
#include "p2p.h"

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "transport_shm.h"   /* hr_vm_read */
#include "transport_tcp.h"   /* hr_now */

void hr_p2p_offer(hr_p2p_t *b, hr_p2p_peer_t *p, hr_p2p_req_t *r) {
    if (!p->direct_out || r->direct || r->moved || r->nbytes == 0 || r->nbytes < b->direct_min ||
        (uint64_t)r->nbytes >= HR_P2P_F_DIRECT)
        return;
    r->direct = 1;
    r->token = ++p->token_seq;
    hr_p2p_put64(r->hdr + 8, (uint64_t)r->nbytes | HR_P2P_F_DIRECT);
    hr_p2p_put64(r->hdr + 16, (uint64_t)(uintptr_t)r->buf);
    hr_p2p_put64(r->hdr + 24, r->token);
    r->hdrlen = HR_P2P_OFFER_HDR;
}

void hr_p2p_offered(hr_p2p_t *b, int peer, hr_p2p_req_t *r) {
    hr_p2p_peer_t *p = &b->peers[peer];
    b->direct_sent++;
    if (r->acked) {             /* read already: the token overtook this thread's return */
        hr_p2p_complete(b, r, peer);
        return;
    }
    if (p->err) {               /* the pair failed while the offer was written: no token will come */
        hr_p2p_fail(b, r, p->err_hint, "%s", p->err);
        return;
    }
    r->awaiting = 1;
    r->next = NULL;
    if (p->aw_tail) p->aw_tail->next = r;
    else p->aw_head = r;
    p->aw_tail = r;
    hr_p2p_arm(b, peer);        /* the progress thread watches for the token */
}

void hr_p2p_direct_read(hr_p2p_t *b, int peer) {
    hr_p2p_peer_t *p = &b->peers[peer];
    size_t n = p->rleft, got = 0;
    uint64_t src = p->raddr + (p->rn - p->rleft);
    unsigned char *dst = p->rdst;
    int pid = p->pid, rc, e;
    hr_p2p_unlock(b);
    rc = hr_vm_read(pid, dst, src, n);
    e = errno;
    pthread_mutex_lock(&b->mu);
    if (rc == 0) got = n;
    p->rdst += got;
    p->rleft -= got;
    if (rc != 0 && !p->err) {
        char who[160], why[HR_P2P_WHYLEN], sz[32];
        hr_p2p_who(b, peer, who, sizeof who);
        hr_p2p_size_text((size_t)p->rn, sz, sizeof sz);
        if (e == ESRCH)
            snprintf(why, sizeof why, "%s died while this rank read its message of %s from its memory "
                     "(process_vm_readv: %s)", who, sz, strerror(e));
        else
            snprintf(why, sizeof why, "reading the message of %s from the memory of %s failed "
                     "(process_vm_readv: %s): its buffer is gone (it gave up on the send?)", sz, who,
                     strerror(e));
        hr_p2p_fail_peer_locked(b, peer, why, e == ESRCH ? HR_HINT_DIED : HR_HINT_NONE);
    }
}

int hr_p2p_direct_ack(hr_p2p_t *b, int peer) {
    hr_p2p_peer_t *p = &b->peers[peer];
    unsigned char tok[8];
    ssize_t k;
    hr_p2p_put64(tok, p->rtoken);
    p->rdirect = 0;
    b->direct_read++;
    /* 8 bytes on a socket nobody else writes in this direction: all or nothing, never blocks
     * unless the sender stopped reading its tokens (then its pair is in trouble anyway) */
    do {
        k = send(p->in_fd, tok, sizeof tok, MSG_NOSIGNAL | MSG_DONTWAIT);
    } while (k < 0 && errno == EINTR);
    if (k == (ssize_t)sizeof tok) return 0;
    char who[160], why[HR_P2P_WHYLEN];
    hr_p2p_who(b, peer, who, sizeof who);
    snprintf(why, sizeof why, "%s gave up on a message this rank was reading from its memory "
             "(acknowledging it: %s)", who, k < 0 ? strerror(errno) : "short write");
    hr_p2p_fail_peer_locked(b, peer, why, HR_HINT_DIED);
    return -1;
}

/* The send whose token this is, off the awaiting list; NULL if none. */
static hr_p2p_req_t *take_awaiting(hr_p2p_peer_t *p, uint64_t token) {
    hr_p2p_req_t **pp = &p->aw_head, *r, *prev = NULL;
    while ((r = *pp)) {
        if (r->token == token) {
            *pp = r->next;
            if (p->aw_tail == r) p->aw_tail = prev;
            r->next = NULL;
            return r;
        }
        prev = r;
        pp = &r->next;
    }
    return NULL;
}

/* Read the tokens there are now (b->mu held, this thread owns p->acking). */
static void drain_acks(hr_p2p_t *b, int peer) {
    hr_p2p_peer_t *p = &b->peers[peer];
    unsigned char buf[512];
    char who[160], why[HR_P2P_WHYLEN];
    while (p->aw_head && !p->err && !b->closing && p->out_fd >= 0) {
        int fd = p->out_fd;
        size_t have = p->alen, i;
        ssize_t k;
        memcpy(buf, p->abuf, have);
        hr_p2p_unlock(b);
        do {
            k = recv(fd, buf + have, sizeof buf - have, MSG_DONTWAIT);
        } while (k < 0 && errno == EINTR);
        int e = errno;
        pthread_mutex_lock(&b->mu);
        if (p->err || b->closing) return;   /* failed meanwhile: the awaiting sends with it */
        if (k == 0 || (k < 0 && e != EAGAIN && e != EWOULDBLOCK)) {
            hr_p2p_who(b, peer, who, sizeof who);
            if (k == 0) snprintf(why, sizeof why, "%s closed its connection before it read a message "
                                 "sent to it (it exited or failed)", who);
            else snprintf(why, sizeof why, "%s connection error: %s", who, strerror(e));
            hr_p2p_fail_peer_locked(b, peer, why, HR_HINT_DIED);
            return;
        }
        if (k < 0) break;                   /* drained */
        have += (size_t)k;
        for (i = 0; i + 8 <= have; i += 8) {
            uint64_t token = hr_p2p_get64(buf + i);
            hr_p2p_req_t *r = take_awaiting(p, token);
            if (!r && p->writing && p->sq_head && p->sq_head->direct && p->sq_head->token == token &&
                !p->sq_head->acked) {
                /* the offer being written: its last bytes went out, the receiver read the message
                 * and answered before the writer took the mutex back (hr_p2p_offered completes it) */
                p->sq_head->acked = 1;
                continue;
            }
            if (!r) {
                hr_p2p_who(b, peer, who, sizeof who);
                snprintf(why, sizeof why, "%s acknowledged a message this rank never offered (token "
                         "%llu): a corrupt stream", who, (unsigned long long)token);
                hr_p2p_fail_peer_locked(b, peer, why, HR_HINT_NONE);
                return;
            }
            r->awaiting = 0;
            hr_p2p_complete(b, r, peer);
        }
        p->alen = have - i;
        memcpy(p->abuf, buf + i, p->alen);
    }
}

void hr_p2p_read_acks(hr_p2p_t *b, int peer) {
    hr_p2p_peer_t *p = &b->peers[peer];
    if (p->acking != HR_READ_NONE) return;
    p->acking = HR_READ_PROGRESS;
    drain_acks(b, peer);
    p->acking = HR_READ_NONE;
    hr_p2p_arm(b, peer);
}

int hr_p2p_ack_for(hr_p2p_t *b, hr_p2p_req_t *r, double deadline) {
    hr_p2p_peer_t *p = &b->peers[r->peer];
    double busy_end = 0;
    if (p->acking != HR_READ_NONE || p->out_fd < 0 || p->err || b->closing) return 0;
    p->acking = HR_READ_WAITER;
    hr_p2p_arm(b, r->peer);                 /* the progress thread stops watching for tokens */
    drain_acks(b, r->peer);
    while (r->state != HR_P2P_DONE && !p->err && !b->closing && p->out_fd >= 0) {
        double now = hr_now(), until = deadline < r->deadline ? deadline : r->deadline;
        if (now >= until) break;            /* r's own deadline: the progress thread's to word */
        hr_p2p_park(b, p->out_fd, POLLIN, now, until, &busy_end);
        drain_acks(b, r->peer);
    }
    p->acking = HR_READ_NONE;
    hr_p2p_arm(b, r->peer);
    return 1;
}
