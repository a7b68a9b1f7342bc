"""One rank of a torch.distributed job using subgroups on the ``hpcring`` backend (started by
``hpcring run``); every group's result is compared with the same op on a gloo group over the
same ranks.

    python tests/workers/torch_subgroup_worker.py groups     new_group (halves, strided, each rank alone,
                                                     all ranks, the same ranks twice),
                                                     new_subgroups, init_device_mesh('cpu', (2, 2))
                                                     at 4 ranks ((1, n) / (n, 1) otherwise)
    python tests/workers/torch_subgroup_worker.py hang R     group {0, R}: rank R never joins its allreduce
"""
from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

from hpcring.distributed import init_process_group

init_process_group("cpu:hpcring,cuda:hpcring")      # also under a plain mpirun (then: the MPI backend)
RANK, SIZE = dist.get_rank(), dist.get_world_size()


def pair(ranks):
    """The same ranks as an hpcring group and a gloo group (every rank creates both)."""
    return dist.new_group(ranks), dist.new_group(ranks, backend="gloo")


def check(hp, gl, what: str) -> int:
    """Every op in group ``hp`` equals the same op in ``gl``; returns the number of ops checked."""
    if hp == dist.GroupMember.NON_GROUP_MEMBER:
        assert gl == dist.GroupMember.NON_GROUP_MEMBER
        return 0
    n = dist.get_world_size(hp)
    assert n == dist.get_world_size(gl) and dist.get_rank(hp) == dist.get_rank(gl)
    assert dist.get_process_group_ranks(hp) == dist.get_process_group_ranks(gl)
    assert hp.size() == n and hp.rank() == dist.get_rank(hp), what
    g = torch.Generator().manual_seed(1000 + RANK)
    checked = 0
    for dtype in (torch.float32, torch.int64, torch.bfloat16):
        x = torch.randint(-50, 50, (37,), generator=g).to(dtype)
        res = []
        for grp in (hp, gl):
            a = x.clone()
            dist.all_reduce(a, group=grp)
            m = x.clone()
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=grp)
            out = torch.empty(n * 37, dtype=dtype)
            dist.all_gather_into_tensor(out, x, group=grp)
            lst = [torch.empty_like(x) for _ in range(n)]
            dist.all_gather(lst, x, group=grp)
            b = x.clone()
            dist.broadcast(b, src=dist.get_process_group_ranks(grp)[-1], group=grp)
            rs = torch.empty(5, dtype=dtype)
            dist.reduce_scatter_tensor(rs, torch.arange(5 * n).to(dtype) * (RANK + 1), group=grp)
            dist.barrier(group=grp)
            res.append([a, m, out, torch.stack(lst), b, rs])
        for i, (p, q) in enumerate(zip(*res)):
            assert torch.equal(p, q), f"{what} {dtype} op {i}: hpcring {p} != gloo {q}"
            checked += 1
    return checked


def groups() -> None:
    checked = 0
    # halves (rows), strided (columns), each rank alone, all ranks, the first half a second time
    half = [list(range(SIZE // 2 or 1)), list(range(SIZE // 2 or 1, SIZE))]
    specs = [("half", r) for r in half if r] + [("strided", list(range(s, SIZE, 2))) for s in range(min(2, SIZE))]
    specs += [("alone", [r]) for r in range(SIZE)] + [("all", list(range(SIZE))), ("half again", half[0])]
    made = [(name, ranks, *pair(ranks)) for name, ranks in specs]
    for name, ranks, hp, gl in made:
        checked += check(hp, gl, f"new_group {name} {ranks}")
    # two groups over the same ranks have their own sequence numbers
    mine = [hp for _, ranks, hp, _ in made if RANK in ranks and len(ranks) < SIZE]
    seqs = [dict(hp._comms)["cpu"].recorder.seq for hp in mine]
    assert all(s == seqs[0] for s in seqs), seqs
    names = {dict(hp._comms)["cpu"].group for hp in mine}
    assert len(names) == len(mine), names
    backend = dict(mine[0]._comms)["cpu"].backend.name
    # new_subgroups: consecutive groups of 2 (of 1 on an odd world)
    size = 2 if SIZE % 2 == 0 else 1
    cur, _ = dist.new_subgroups(group_size=size)
    cur_gloo, _ = dist.new_subgroups(group_size=size, backend="gloo")
    checked += check(cur, cur_gloo, "new_subgroups")
    # a 2-D device mesh
    from torch.distributed.device_mesh import init_device_mesh
    shape = (2, 2) if SIZE == 4 else (1, SIZE) if SIZE % 2 else (SIZE // 2, 2)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
    for dim in ("dp", "tp"):
        hp = mesh.get_group(dim)
        ranks = dist.get_process_group_ranks(hp)
        gloos = {}
        for r in [list(row) for row in (mesh.mesh.tolist() if dim == "tp" else mesh.mesh.t().tolist())]:
            gloos[tuple(r)] = dist.new_group(r, backend="gloo")      # every rank creates every one
        assert hp.getBackendName() == "hpcring", hp
        checked += check(hp, gloos[tuple(ranks)], f"mesh {dim} {ranks}")
    dist.barrier()
    print(f"rank {RANK}: groups OK ({checked} ops equal to gloo) on {backend}", flush=True)


def hang(victim: int) -> None:
    g = dist.new_group([0, victim])
    if RANK in (0, victim):
        x = torch.ones(8)
        dist.all_reduce(x, group=g)                  # both join the group's mesh
        if RANK == victim:
            print(f"FAULT skip at {time.time()}", flush=True)
            time.sleep(120)                         # alive but elsewhere: never joins the next one
        dist.all_reduce(x, group=g)
    else:
        time.sleep(120)                             # outside the group: the watchdog ends it too
    print(f"rank {RANK}: hang finished", flush=True)


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "groups":
        groups()
    elif mode == "hang":
        hang(int(sys.argv[2]))
    dist.destroy_process_group()
