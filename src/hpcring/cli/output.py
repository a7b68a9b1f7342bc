"""Everything the CLI prints. Status goes to stderr so stdout stays the job's output."""
from __future__ import annotations

import sys



def info(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def error(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr, flush=True)


def line(text: str) -> None:
    """One rank-tagged output line. Always on stdout, stderr lines included (their tag says
    `<stderr>`): one stream keeps the ranks' lines in the order they arrived."""
    print(text, file=sys.stdout, flush=True)


def sources(site, job) -> None:
    info(f"site: {site.name} ({site.path}, {site.origin})")
    for key in ("nodes", "tasks_per_node", "gpus_per_node", "cpus_per_task", "time", "partition", "account",
                "qos", "constraint", "exclusive", "name", "job_dir", "timeout"):
        val = getattr(job, "time_slurm" if key == "time" else key)
        info(f"  {key:<15} {str(val):<24} <- {job.sources.get(key, '?')}")
    if getattr(job, "exclude", None):
        info(f"  {'exclude':<15} {','.join(job.exclude):<24} <- {job.sources.get('exclude', '?')}")
    box = getattr(job, "container", None)
    if box is not None:
        src = dict(box.sources)
        info(f"  {'container':<15} {box.runtime + ' ' + box.image:<24} <- {src.get('container.image', '?')}")
        if box.mounts:
            info(f"  {'mounts':<15} {','.join(box.mounts):<24} <- "
                 f"{src.get('container.mounts', 'site ' + site.name)}{' + site ' + site.name if 'container.mounts' in src else ''}")


def status(rec, st, oc, requeues: int = 0) -> None:
    code = oc.exit_code if oc is not None else st.exit_code    # a running job has none
    print(f"job {rec.job_id}  {st.state}" + (f" ({st.raw})" if st.raw and st.raw != st.state else "")
          + (f"  exit {code}" if code is not None else ""))
    print(f"  record {rec.key}  name {rec.name}  scheduler {rec.scheduler}  ranks {rec.ntasks}  "
          f"nodes {st.nodelist or '-'}  requeued {requeues}")
    print(f"  folder {rec.folder}")
    if oc is not None:
        from hpcring.outcome import rank_failure
        for s in oc.failed:
            print(f"  {rank_failure(s)}")
        if oc.missing:
            print(f"  ranks without a result: {', '.join(map(str, oc.missing))}")


def restart_chain(lines) -> None:
    """The attempts of a job restarted after node faults (hpcring.restarts), under its status."""
    if len(lines) > 1 or (lines and lines[0].startswith(("attempt ", "step ", "preflight "))):
        print("  preflight, steps and restarts (--preflight, --spare-nodes, --max-restarts):")
        lines = [f"  {text}" for text in lines]
    for text in lines:
        print(f"  {text}")


def array_status(rec, st, states) -> None:
    """An array: its state, one line per state (``4 COMPLETED, 2 RUNNING``), then each task, its
    state and its --sweep values."""
    print(f"job {rec.job_id}  {st.state}  array of {len(rec.array)} tasks"
          + (f" (at most {rec.array_limit} at once)" if rec.array_limit else "")
          + (f"  exit {st.exit_code}" if st.exit_code is not None else ""))
    print(f"  {st.raw}")
    print(f"  record {rec.key}  name {rec.name}  scheduler {rec.scheduler}  ranks {rec.ntasks} per task")
    for i, task in enumerate(rec.tasks()):
        one = states[task.job_id]
        values = " ".join(f"{k}={v}" for k, v in (rec.sweep[i] if rec.sweep else {}).items())
        print(f"  {task.job_id:<14} {one.state:<10}" + (f" exit {one.exit_code}" if one.exit_code is not None else "")
              + (f"  {values}" if values else ""))


def jobs_table(rows) -> None:
    """``hpcring status`` without a job: one line per job, newest first."""
    import time
    if not rows:
        print("no jobs submitted through hpcring from this account yet")
        return
    print(f"{'JOB':<24} {'STATE':<11} {'RANKS':>5}  {'SUBMITTED':<16} {'NAME':<20} SCRIPT")
    for rec, st, why in rows:
        state = st.state if st is not None else "?"
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(rec.submitted_at))
        print(f"{rec.key:<24} {state:<11} {rec.ntasks:>5}  {when:<16} {rec.name:<20} {rec.script}"
              + (f"  ({why})" if why else "") + (f"  [array: {st.raw}]" if rec.array is not None and st else ""))


def nodes_table(path, site_name: str, pol, rows) -> None:
    """``hpcring nodes list``: the policy, then one line per node the site's history holds."""
    import time
    print(f"node history {path} (site {site_name}): {pol.words()}")
    if not rows:
        print("no node was blamed by a finished job")
        return
    days = f"{pol.days:g}D"
    print(f"{'NODE':<20} {'BLAMES/' + days:>10}  {'TOTAL':>5}  {'LAST (UTC)':<19}  {'JOB':<12} {'EXCLUDED':<8}  LAST REASON")
    for r in rows:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(r.last.time))
        print(f"{r.node:<20} {r.recent:>10}  {r.total:>5}  {when:<19}  {r.last.job:<12} "
              f"{'yes' if r.excluded else 'no':<8}  {r.last.reason}")


def sites_table(rows) -> None:
    print(f"{'NAME':<20} {'ORIGIN':<8} PATH")
    for name, path, origin in rows:
        print(f"{name:<20} {origin:<8} {path}")


def site_detail(site) -> None:
    from hpcring.config.fabric import fabric_env
    c = site.config
    print(f"# {site.path} ({site.origin})")
    print(c.model_dump_json(indent=2, exclude_defaults=False))
    print("# environment derived from the fabric:")
    for k, v in fabric_env(c.fabric).items():
        print(f"{k}={v}")
