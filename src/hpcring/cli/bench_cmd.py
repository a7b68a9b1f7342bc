"""`hpcring bench`: nccl-tests-style collective benchmark, checked in every run (see hpcring.bench)."""
from __future__ import annotations

from typing import Optional

import typer


def register(app: typer.Typer) -> None:
    from hpcring.cli.common import command
    from hpcring.config.envvars import MAX_LOCAL_RANKS, MAX_NODES, MAX_RANKS, MAX_TIMEOUT

    @command(app, "bench",
             help="Benchmark a collective like nccl-tests (size, count, type, redop, root, time, algbw, busbw, "
                  "#wrong). Inside a job (hpcring run -- hpcring bench ..., srun, mpirun) every rank runs it and "
                  "rank 0 prints; standalone it starts --ranks local ranks itself. Exit code 1 if any element "
                  "was wrong.")
    def bench(collective: str = typer.Option("allreduce", "--collective", "-c",
                                             help="allreduce, allgather, broadcast, reduce_scatter or alltoall."),
              backend: str = typer.Option("auto", "--backend", "-B", help="auto, ring, mpi or nccl."),
              minbytes: str = typer.Option("8", "--minbytes", "-b", help="Smallest size (bytes; K/M/G suffixes; at most 8G)."),
              maxbytes: str = typer.Option("64M", "--maxbytes", "-e",
                                           help="Largest size (bytes; K/M/G suffixes; at most 8G, and standalone "
                                                "what this machine's memory holds)."),
              factor: float = typer.Option(2.0, "--stepfactor", "-f",
                                           help="Multiply the size by this each step (> 1, at most 1024; at most "
                                                "256 sizes)."),
              dtype: str = typer.Option("float32", "--dtype", "-d",
                                        help="float32, float64, float16, bfloat16, int32, int64, uint8."),
              op: str = typer.Option("sum", "--op", "-o", help="sum, prod, min, max or avg (reducing collectives)."),
              root: int = typer.Option(0, "--root", "-r", min=0, max=MAX_RANKS, help="Broadcast root."),
              iters: int = typer.Option(20, "--iters", min=1, max=10**7, help="Timed calls per size."),
              warmup: int = typer.Option(5, "--warmup", "-w", min=0, max=10**7, help="Untimed calls per size before timing."),
              seed: int = typer.Option(0, "--seed", help="Seed of the per-rank data patterns."),
              memory: str = typer.Option("auto", "--memory",
                                         help="device, host or auto: buffers in GPU memory (auto on the nccl "
                                              "backend, like nccl-tests) or host numpy arrays (staged through "
                                              "the GPU by nccl; labelled in the table)."),
              timeout: Optional[float] = typer.Option(None, "--timeout", min=0.001, max=MAX_TIMEOUT, help="Deadline per collective (s)."),
              json_path: Optional[str] = typer.Option(None, "--json", help="Write the results as JSON here (rank 0)."),
              plot: Optional[str] = typer.Option(None, "--plot", help="Write busbw vs size as PNG (needs matplotlib)."),
              ranks: Optional[int] = typer.Option(None, "--ranks", "-n", min=1, max=MAX_RANKS,
                                                  help=f"Standalone only: local ranks to start (default 2, at most {MAX_LOCAL_RANKS})."),
              nodes: Optional[int] = typer.Option(None, "--nodes", "-N", min=1, max=MAX_NODES,
                                                  help="Standalone only: virtual local nodes (default 1).")):
        import sys

        from hpcring.bench.options import BenchOptions, parse_size
        from hpcring.bench.run import bench_main
        opts = BenchOptions(collective=collective, backend=backend, minbytes=parse_size(minbytes, "--minbytes"),
                            maxbytes=parse_size(maxbytes, "--maxbytes"), factor=factor, dtype=dtype, op=op, root=root,
                            iters=iters, warmup=warmup, seed=seed, timeout=timeout, json=json_path, plot=plot,
                            memory=memory)
        sys.exit(bench_main(opts, ranks, nodes))
