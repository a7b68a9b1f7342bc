"""nccl-tests-style collective benchmark with a correctness check in every run (``hpcring bench``).

Where it runs:
  * inside any launcher, as a rank (``hpcring run -- hpcring bench ...``, ``srun``, ``mpirun``, or a
    script under ``hpcring submit`` that calls :func:`run_as_rank`): every rank benchmarks, rank 0
    prints;
  * standalone (no launcher around it): :func:`bench_main` spawns ``--ranks`` local ranks itself
    through :func:`hpcring.allocation.run` (local backend env) and prints rank 0's table untagged.

Columns follow nccl-tests (out-of-place only): ``size`` is the bytes of the largest buffer of the
call (allgather: the gathered output; reduce_scatter: the input; alltoall: one rank's buffer),
``count`` the elements per rank (allgather/reduce_scatter: one rank's share; alltoall: per peer),
``time`` the mean of ``iters`` timed calls on the slowest rank (after ``warmup`` calls and a barrier),
``algbw = size / time``, ``busbw = algbw * factor`` with factor allreduce 2(n-1)/n; allgather,
reduce_scatter, alltoall (n-1)/n; broadcast 1.

Correctness: rank r's input is a deterministic pattern ``G_r`` of small integers with period 1021
elements (from the seed and r), so every rank can compute the expected result of any collective
for every rank without communication; ``#wrong`` is the number of elements, summed over ranks,
that differ from it (exact comparison; ``avg`` within one rounding of the dtype). Integer-valued
data keep float16/bfloat16 sums exact, so the check is exact for them too.

The modules: data (patterns, #wrong), cases, options (BenchOptions), table, run (run_as_rank,
bench_main); callers import from them (this package re-exports nothing).
"""
