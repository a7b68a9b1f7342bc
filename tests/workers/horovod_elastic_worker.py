"""Worker program for tests/integration/test_horovod_elastic.py (started by hpcring.elastic.driver).

    python tests/workers/horovod_elastic_worker.py train LOGDIR [--epochs E] [--n N] [--batch B] [--commit K] [--pace S]
    python tests/workers/horovod_elastic_worker.py contract LOGDIR

Every event goes to ``LOGDIR/<worker id>.jsonl`` as one JSON line, flushed at once (a killed
worker's lines up to its death stay): ``start``, ``round`` (after each init: round, rank, size),
``synced`` (the state every rank holds after the sync: position and weights), ``step`` (the
samples this rank took, the position before it), ``commit``, ``restored``, ``reset_cb``, ``final``.

``train``: a linear model whose loss is the sum of w.x over the batch, so each gradient is a sum
of integer features, reduced with op=Sum; SGD with lr 0.25 and momentum 0.5: every number stays
an exact binary fraction, and the test can recompute the final weights exactly from the rounds'
sizes and the positions they started at.
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import socket
import sys
import time

import torch

import hpcring.torch as hvd

LOG = None


def log(kind: str, **fields) -> None:
    rec = {"kind": kind, "t": time.time(), "wid": os.environ.get("HPCRING_ELASTIC_ID", "?"), "pid": os.getpid(),
           **fields}
    LOG.write(json.dumps(rec) + "\n")
    LOG.flush()


def features(n: int) -> torch.Tensor:
    i = torch.arange(n, dtype=torch.float64)
    return torch.stack([i % 7 - 3, i % 5 - 2, i % 3 - 1, torch.ones(n, dtype=torch.float64)], dim=1)


class Indices(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        return i


def train(a) -> None:
    hvd.init()
    log("round", round=_round(), rank=hvd.rank(), size=hvd.size())
    torch.manual_seed(1 + hvd.rank())
    model = torch.nn.Linear(4, 1, bias=False).double()
    if hvd.rank() == 0:
        with torch.no_grad():
            model.weight.zero_()
    feats = features(a.n)
    opt = torch.optim.SGD(model.parameters(), lr=0.25, momentum=0.5)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), op=hvd.Sum)
    sampler = hvd.elastic.ElasticSampler(Indices(a.n), shuffle=True, seed=3)
    loader = torch.utils.data.DataLoader(Indices(a.n), batch_size=a.batch, sampler=sampler)
    state = hvd.elastic.TorchState(model, opt, sampler=sampler, epoch=0, step=0)

    def on_reset():
        log("reset_cb", round=_round(), rank=hvd.rank(), size=hvd.size())
    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run
    def loop(state):
        log("synced", round=_round(), rank=hvd.rank(), size=hvd.size(), epoch=state.epoch, step=state.step,
            processed=state.sampler.processed_num, w=model.weight.detach().flatten().tolist())
        while state.epoch < a.epochs:
            for batch_idx, idx in enumerate(loader):
                # logged before the allreduce: a rank killed inside it has still given these samples
                log("step", round=_round(), rank=hvd.rank(), size=hvd.size(), epoch=state.epoch,
                    processed=state.sampler.processed_num, step=state.step + 1, idx=[int(i) for i in idx])
                opt.zero_grad()
                loss = (model(feats[idx])).sum()
                loss.backward()
                opt.step()
                state.sampler.record_batch(batch_idx, a.batch)
                state.step += 1
                if state.step % a.commit == 0:
                    state.commit()
                    log("commit", round=_round(), step=state.step)
                    if a.die and _round() == 1 and state.step == a.die[1] and a.die[0] in _names():
                        log("dying", round=_round(), step=state.step, how=a.die_how)
                        # kill: a lost node (no exit handler runs); stop: a frozen one (no exit at all)
                        os.kill(os.getpid(), signal.SIGKILL if a.die_how == "kill" else signal.SIGSTOP)
                    if state.step == a.hold_at and _round() == 1:
                        hold(state)
                time.sleep(a.pace)
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)
            state.commit()
            log("commit", round=_round(), step=state.step, epoch_end=True)

    orig_restore = state.restore

    def restore():
        orig_restore()
        log("restored", round=_round(), epoch=state.epoch, step=state.step, processed=state.sampler.processed_num)
    state.restore = restore
    loop(state)
    log("final", round=_round(), rank=hvd.rank(), size=hvd.size(), step=state.step,
        w=model.weight.detach().flatten().tolist())


def hold(state, limit_s: float = 120.0) -> None:
    """Wait at this commit for a newcomer: check_host_updates (a collective: every rank loops in
    step, on rank 0's view) until it raises HostsUpdatedInterrupt."""
    end = time.monotonic() + limit_s
    log("holding", round=_round(), step=state.step)
    while time.monotonic() < end:
        time.sleep(0.1)
        state.check_host_updates()
    raise RuntimeError(f"no worker joined within {limit_s} s")


def _names() -> set[str]:
    """This worker's names for --die: its driver id (local) and its node (a launcher's step: srun
    names it; blaunch does not, so the host's own name)."""
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".", 1)[0]
    return {os.environ.get("HPCRING_ELASTIC_ID", ""), node} - {""}


def _round() -> int:
    s = hvd.state.session()
    r = getattr(s, "elastic_round", None)
    return r.number if r is not None else 0


def contract(a) -> None:
    """Horovod's documented edge cases: commit/restore round trips, ObjectState, all ranks raising
    HostsUpdatedInterrupt at the same check (rank 0's notification only), skip_sync, reset
    callbacks, process sets gone after a reset and registered again, and the reset limit ending
    the job (driver --reset-limit 2)."""
    hvd.init()
    r = hvd.rank()
    # TorchState: model + optimizer + extra attributes; differing values until the sync
    model = torch.nn.Linear(2, 2)
    with torch.no_grad():
        model.weight.fill_(1.0 + r)
        model.bias.fill_(1.0 + r)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = hvd.elastic.TorchState(model, opt, batch=20 + r, epoch=10 + r, note={"r": r})
    state.sync()
    assert torch.equal(model.weight, torch.ones(2, 2)), model.weight
    assert (state.batch, state.epoch, state.note) == (20, 10, {"r": 0}), (state.batch, state.epoch)
    # as in Horovod, sync() saves the synced plain attributes but not the model and optimizer
    # (a restore now would bring back this rank's own model): commit the synced state
    state.commit()
    model(torch.ones(1, 2)).sum().backward()
    opt.step()                                   # momentum buffers exist now
    state.batch, state.epoch = 21, 11
    state.restore()                              # back to the committed (synced) values
    assert torch.equal(model.weight, torch.ones(2, 2)) and (state.batch, state.epoch) == (20, 10)
    assert not opt.state_dict()["state"], "optimizer state restored to before the step"
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    state.batch = 22
    w = model.weight.detach().clone()
    mom = opt.state_dict()["state"][0]["momentum_buffer"].clone()
    state.commit()
    with torch.no_grad():
        model.weight.add_(5.0)
    opt.zero_grad()
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    state.batch = 99
    state.restore()
    assert torch.equal(model.weight, w) and state.batch == 22
    assert torch.equal(opt.state_dict()["state"][0]["momentum_buffer"], mom)
    # a new object assigned to a handled attribute becomes the saved state
    other = torch.nn.Linear(2, 2)
    state.model = other
    state.restore()
    assert state.model is other
    state.model = model
    log("ok", what="torchstate")

    # ObjectState with Horovod's own arguments
    obj = hvd.elastic.ObjectState(hvd.broadcast_object, hvd.rank, a=r, b=[r])
    obj.sync()
    assert (obj.a, obj.b) == (0, [0])
    obj.a = 5
    obj.restore()
    assert obj.a == 0
    obj.a = 6
    obj.commit()
    obj.a = 7
    obj.restore()
    assert obj.a == 6
    log("ok", what="objectstate")

    # check_host_updates: only rank 0 heard of new hosts, every rank raises at the same call
    obj.check_host_updates()                     # nothing yet
    if r == 0:
        obj.on_hosts_updated(5, 2)
    raised = None
    try:
        obj.check_host_updates()
    except hvd.HostsUpdatedInterrupt as e:
        raised = e.skip_sync
    assert raised is False, raised
    obj.check_host_updates()                     # answered: not again
    if r == 0:
        obj.on_hosts_updated(6, 1)               # removed only: skip_sync
    try:
        obj.commit()
        raise AssertionError("commit did not raise HostsUpdatedInterrupt")
    except hvd.HostsUpdatedInterrupt as e:
        assert e.skip_sync is True
    log("ok", what="check_host_updates")

    # hvd.elastic.run: an interrupt resets (new round, same workers), callbacks run with the new
    # round up, the sync is skipped after a removal-only interrupt; a third reset is over the limit
    calls, syncs, cbs = [], [], []
    counter = hvd.elastic.ObjectState(hvd.broadcast_object, hvd.rank, n=0)
    real_sync = counter.sync

    def sync():
        syncs.append(_round())
        real_sync()
    counter.sync = sync
    counter.register_reset_callbacks([lambda: cbs.append((_round(), hvd.size()))])
    # process sets: Horovod's reset is shutdown() then init(), so every set but the global one is
    # gone after it; the script registers its sets again (a reset callback, or the body)
    before = hvd.add_process_set([1])
    assert before.process_set_id == 1 and before.size() == 1
    sets = []

    def again():
        stale = None
        try:
            hvd.allreduce(torch.ones(1), process_set=before, name=f"stale.{_round()}")
        except ValueError as e:                  # Horovod: ValueError for a set it does not know
            stale = str(e)
        assert stale is not None and "not registered" in stale, stale
        assert before.process_set_id is None and before.size() is None and before.included() is None
        ps = hvd.add_process_set([0])            # [0, 1] is the global set's: Horovod refuses it too
        assert ps.size() == 1 and ps.included() == (hvd.rank() == 0)
        if hvd.rank() == 0:
            got = hvd.allreduce(torch.tensor([5.0]), op=hvd.Sum, process_set=ps, name=f"again.{_round()}")
            assert got.item() == 5.0, got
        sets.append((_round(), ps.process_set_id))
        hvd.remove_process_set(ps)
    counter.register_reset_callbacks([again])

    @hvd.elastic.run
    def body(state, tag):
        calls.append((tag, _round()))
        if len(calls) <= 3:
            if hvd.rank() == 0:
                state.on_hosts_updated(100 + len(calls), 1 if len(calls) == 1 else 2)
            state.check_host_updates()
        return "done"

    try:
        body(counter, "x")
        raise AssertionError("the reset limit did not end the job")
    except hvd.elastic.ElasticJobError as e:
        assert "reset limit" in str(e), e
        log("ok", what="reset_limit", error=str(e), calls=calls, syncs=syncs, cbs=cbs)
    assert [c[1] for c in calls] == [1, 2, 3], calls
    assert syncs == [1, 3], syncs                 # not after the first (removal-only) interrupt
    assert cbs == [(2, 2), (3, 2)], cbs           # after each reset, with the new round up
    assert sets == [(2, 1), (3, 1)], sets         # registered again after each reset, ids from 1 again
    log("ok", what="run")
    print(f"OK contract {r}", flush=True)


def main() -> int:
    global LOG
    ap = argparse.ArgumentParser()
    ap.add_argument("mode")
    ap.add_argument("logdir")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--n", type=int, default=48)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--commit", type=int, default=2)
    ap.add_argument("--pace", type=float, default=0.05)
    ap.add_argument("--hold-at", type=int, default=-1, help="in round 1, wait at this commit for a newcomer")
    ap.add_argument("--die", default="", help="NAME:STEP: the worker whose id or node is NAME SIGKILLs itself "
                                              "after the commit at STEP of round 1")
    ap.add_argument("--die-how", choices=("kill", "stop"), default="kill")
    a = ap.parse_args()
    a.die = (a.die.split(":")[0], int(a.die.split(":")[1])) if a.die else None
    os.makedirs(a.logdir, exist_ok=True)
    LOG = open(os.path.join(a.logdir, f"{os.environ.get('HPCRING_ELASTIC_ID', os.getpid())}.jsonl"), "a")
    log("start")
    faulthandler.register(signal.SIGUSR1, all_threads=True)   # the test asks for stacks before it gives up
    {"train": train, "contract": contract}[a.mode](a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
