"""``HPCRING_AUTOTUNE=1``: tune the fusion threshold and the cycle time online, on rank 0.

Method: coordinate search over two small grids, scored by the median optimizer step time.
First the cycle time is swept at the default threshold (auto, then 1, 0.2, 5 and 20 ms), then
the threshold (128, 32, 8, 2, 0.5 MiB) at the best cycle time; the best measured pair is kept
for the rest of the run. With the auto cycle the threshold also starts a cycle early (buffer
full), so the threshold sweep explores DDP-like buckets that overlap the backward pass. Why not
Bayesian optimisation (Horovod's choice): there are two knobs with a handful of meaningful values
each, and step times are noisy; a Gaussian process fitted on ~10 noisy samples mostly re-measures
the same corners, while a sweep costs a fixed, predictable number of steps (here
``(5 + 4 + 2) * (steps + 1)`` after warm-up). A final confirmation measures the sweep's best and
the default once more, back to back, and keeps the better of the two, so a single noisy sample
cannot displace the default. Coordinate search assumes the knobs interact weakly: the cycle time
decides how long gradients gather, the threshold how many are fused (and, with auto, where a
bucket ends).

Only rank 0 measures and decides; the engine sends rank 0's values in every negotiation header
and all ranks adopt them (fusion must be cut identically on every rank). Each sample is logged
to ``HPCRING_AUTOTUNE_LOG`` (CSV) when set.
"""
from __future__ import annotations

import statistics
import time

from hpcring.torch.engine import DEFAULT_CYCLE_MS, DEFAULT_THRESHOLD, HOROVOD_CYCLE_MS
from hpcring.config import envvars

# the default (auto: a host optimizer's gradients wait for the whole step or a full buffer), then
# time-based cycles, which overlap communication with the backward pass at the cost of more cycles
CYCLES_MS = (DEFAULT_CYCLE_MS, HOROVOD_CYCLE_MS, 0.2, 5.0, 20.0)
THRESHOLDS = (DEFAULT_THRESHOLD, 32 << 20, 8 << 20, 2 << 20, 512 << 10)


class Autotuner:
    def __init__(self, engine, log_path: str | None = None, *, warmup: int | None = None,
                 steps_per_sample: int | None = None, clock=time.perf_counter) -> None:
        self.engine = engine
        self._clock = clock
        self.warmup = envvars.get("HPCRING_AUTOTUNE_WARMUP_STEPS") if warmup is None else warmup
        self.steps = envvars.get("HPCRING_AUTOTUNE_STEPS_PER_SAMPLE") if steps_per_sample is None \
            else steps_per_sample
        self.log_path = log_path
        self._plan = [("cycle", DEFAULT_THRESHOLD, c) for c in CYCLES_MS]
        self._results: list[tuple[float, int, float]] = []      # (median s, threshold, cycle ms)
        self._times: list[float] = []
        self._last: float | None = None
        self._seen = 0
        self._skip = 1
        self.done = False
        self.best: tuple[int, float] | None = None
        self._sample = 0
        if log_path:
            with open(log_path, "w") as f:
                f.write("sample,phase,fusion_threshold_bytes,cycle_time_ms,median_step_s,steps\n")
        self._apply(*self._plan[0][1:])

    def _apply(self, threshold: int, cycle_ms: float) -> None:
        self.engine.threshold, self.engine.cycle_s = int(threshold), cycle_ms / 1000.0

    def on_step(self) -> None:
        """Called by DistributedOptimizer.step() on every rank; acts on rank 0 only."""
        if self.done or self.engine.rank != 0:
            return
        now = self._clock()
        last, self._last = self._last, now
        self._seen += 1
        if last is None or self._seen <= self.warmup:
            return
        if self._skip:                  # the step that straddled a change of settings
            self._skip -= 1
            return
        self._times.append(now - last)
        if len(self._times) < self.steps:
            return
        phase, thr, cyc = self._plan.pop(0)
        med = statistics.median(self._times)
        self._times, self._skip = [], 1
        self._results.append((med, thr, cyc))
        self._log(phase, thr, cyc, med)
        if not self._plan and phase == "cycle":
            best_cyc = min(self._results)[2]
            self._plan = [("threshold", t, best_cyc) for t in THRESHOLDS[1:]]
        if not self._plan and phase == "threshold":
            # confirm: the sweep's best and the default once more, back to back; keep the better
            # of these two re-measurements (one noisy sample must not displace the default)
            _, bthr, bcyc = min(self._results)
            self._plan = [("confirm", bthr, bcyc), ("confirm", DEFAULT_THRESHOLD, DEFAULT_CYCLE_MS)]
            self._confirm: list[tuple[float, int, float]] = []
        if phase == "confirm":
            self._confirm.append((med, thr, cyc))
        if self._plan:
            self._apply(*self._plan[0][1:])
            return
        med, thr, cyc = min(self._confirm)
        self.best = (thr, cyc)
        self._apply(thr, cyc)
        self._log("chosen", thr, cyc, med)
        self.done = True

    def _log(self, phase: str, thr: int, cyc: float, med: float) -> None:
        self._sample += 1
        if self.log_path:
            with open(self.log_path, "a") as f:
                f.write(f"{self._sample},{phase},{thr},{cycle_text(cyc)},{med:.6f},{self.steps}\n")


def cycle_text(cycle_ms: float) -> str:
    """How logs and tables show a cycle time (negative: auto)."""
    return "auto" if cycle_ms < 0 else f"{cycle_ms:g}"
