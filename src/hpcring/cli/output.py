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


def status(rec, st, oc, requeues: int = 0) -> None:
    print(f"job {rec.job_id}  {st.state}" + (f" ({st.raw})" if st.raw and st.raw != st.state else "")
          + (f"  exit {st.exit_code}" if st.exit_code is not None else ""))
    print(f"  record {rec.key}  name {rec.name}  scheduler {rec.scheduler}  ranks {rec.ntasks}  "
          f"nodes {st.nodelist or '-'}  requeued {requeues}")
    print(f"  folder {rec.folder}")
    if oc is not None:
        for s in oc.failed:
            print(f"  rank {s['rank']} on {s.get('host', '?')}: "
                  + (s.get("error") or f"exit code {s.get('exit_code')}"))
        if oc.missing:
            print(f"  ranks without a result: {', '.join(map(str, oc.missing))}")


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
