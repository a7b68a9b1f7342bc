"""AN EMULATION OF IBM SPECTRUM LSF, FOR hpcring's TESTS ONLY. It is not LSF and is never installed.

LSF is proprietary and cannot be installed here, so hpcring's LSF backend is tested against this
small emulation of LSF's user commands, which places jobs on the dev cluster's nodes
(``hpcring devcluster up``: node1..nodeN in network namespaces). It follows IBM Spectrum LSF 10.1
documentation:

* bsub (https://www.ibm.com/docs/en/spectrum-lsf/10.1.0?topic=reference-bsub): ``bsub < script``
  parses ``#BSUB`` lines from stdin (``bsub script`` would run the script as a command without
  parsing them, unless LSB_BSUB_PARSE_SCRIPT=Y); options on the command line win over the
  script's; prints ``Job <ID> is submitted to queue <QUEUE>.``; an unknown queue is refused with
  ``QUEUE: No such queue. Job not submitted.``. Options: -J -n -R "select[hname!=H && ...] span[ptile=K]" -q -P -W -o -e
  -oo -eo -wa -wt -x -gpu (recorded) and -nnodes (refused: CSM is not emulated).
* -o/-e (bsub.o.1): %J is the job id, %I the array index (0); -o appends, -oo overwrites; with
  LSB_STDOUT_DIRECT unset (the default) the output is spooled and copied to the file when the job
  finishes, followed by LSF's job report; if the file's directory does not exist then, the
  output is not stored (real LSF mails it).
* Environment set for job execution (lsf_config_ref/lsf_envars_job_exec): the submission
  environment, plus LSB_JOBID, LSB_JOBINDEX, LSB_JOBNAME, LSB_QUEUE, LSB_HOSTS (one name per slot),
  LSB_MCPU_HOSTS ("hostA 2 hostB 2"), LSB_DJOB_HOSTFILE (one line per slot), LSB_DJOB_RANKFILE
  (same content: no CSM launch node), LSB_DJOB_NUMPROC, LSB_SUB_HOST, LSB_JOBFILENAME,
  LSB_OUTPUTFILE/LSB_ERRORFILE, LS_SUBCWD. The job runs on the first host, in the submission cwd.
* bjobs (bjobs.o.1, bjobs.noheader.1, LSB_BJOBS_CONSISTENT_EXIT_CODE=N): ``-o "field ..."`` with
  fields jobid stat queue user job_name exit_code exec_host from_host; ``-noheader``; ``-a``;
  finished jobs stay visible; ``Job <ID> is not found`` on stderr, exit 255.
* Job states: PEND, RUN, DONE, EXIT, PSUSP (bstop while pending), USUSP (bstop while running),
  SSUSP, WAIT, ZOMBI and UNKWN are the documented ones; this emulation produces PEND, RUN, DONE,
  EXIT, USUSP and PSUSP.
* bkill (bkill.1): SIGINT and SIGTERM at once, SIGKILL after JOB_TERMINATE_INTERVAL (10 s in LSF;
  here HPCRING_LSF_EMU_KILL_INTERVAL, default 3 s); prints ``Job <ID> is being terminated``; a
  finished job: ``Job has already finished``.
* bstop / bresume (bstop.1, bresume.1): SIGSTOP / SIGCONT to the job; USUSP (PSUSP if pending).
* brequeue (brequeue.1): kills a RUN/USUSP/SSUSP job (-e/-d also EXIT/DONE jobs) and puts it
  back to PEND with the same job id; it runs again from the beginning.
* Run limit (-W [hh:]mm) with -wa SIGNAL / -wt [hh:]mm (bsub.wa.1, bsub.wt.1): the warning signal
  is sent wt before the limit; at the limit SIGINT, SIGTERM, SIGKILL, the job EXITs.
  (HPCRING_LSF_EMU_MINUTE_S, default 60, is the length of one of those minutes: tests shorten it.)
* blaunch (https://www.ibm.com/docs/en/spectrum-lsf/10.1.0?topic=reference-blaunch):
  ``blaunch [-n] [-u host_file | -z host ... | host] [-use-login-shell | -no-shell] command``;
  only inside a job and only on the job's hosts; with no host, one task per slot; stdin is
  /dev/null; every task gets LSF_PM_TASKID, the 1-based task id that LSF's RES sets (Open MPI's
  ess/lsf component and openlava's res read it the same way); blaunch waits for all tasks and exits
  with the first non-zero task status. Several blaunch may run at once in one job, each on its own
  hosts (``blaunch -z HOST`` per host: hpcring run --elastic), and a task's exit ends neither the
  other blaunches' tasks nor the job, as with LSB_DJOB_RTASK_GONE_ACTION=IGNORE_TASKCRASH
  (lsb.applications RTASK_GONE_ACTION; hpcring run --elastic sets it); its KILLJOB_TASKEXIT and
  KILLJOB_TASKDONE are not emulated. SIGINT, SIGTERM, SIGHUP and SIGCONT sent to blaunch alone go
  on to its tasks ("blaunch processing": blaunch registers as the tasks' signal handler); those LSF
  sends the whole job (bkill, the run limit) reach the tasks once, directly, and a signal the job
  script ignores stays ignored. SIGKILL to blaunch leaves its tasks to the job's end (the job's
  process group is killed then).
  A host failure (LSB_DJOB_COMMFAIL_ACTION: by default LSF shuts the whole job down, KILL_TASKS
  ends only the lost host's tasks) is not emulated: the dev cluster's nodes do not fail under it.

* Job arrays (job_array_create, bsub.j.1): ``-J "name[1-16:2,20]%4"`` makes one element job per
  index (indices from 1, at most 1000 elements), at most ``%N`` running at once; an element runs
  with LSB_JOBID the array's id and LSB_JOBINDEX its index, ``%I`` in -o/-e is the index; bjobs,
  bkill take ``ID`` (every element) or ``ID[i]``; bjobs' ``jobindex`` field is the index (0 for a
  job that is not an array element).
* Dependencies (bsub.w.1): ``-w "done(ID) && ended(ID[i])"``: done, ended, exit, started of jobs
  or array elements (an array's ID: all its elements), joined by ``&&``; a job waits PEND until
  the condition holds (one that can no longer hold keeps it pending, as LSF does, here until the
  pending deadline).

Not emulated: the scheduler's policies (fairshare, priorities, preemption), -m, -R
select strings other than hname!=, order/rusage strings, -gpu enforcement, CSM/-nnodes/jsrun, bsub -I/-K, bhist/bacct,
host states other than ok, closed_Full and closed_Adm (no host of the emulation is ever unavail or
unreach), mail.
* Hosts (bhosts.1, badmin.8): ``bhosts [-w] [HOST...]`` prints HOST_NAME STATUS JL/U MAX NJOBS RUN
  SSUSP USUSP RSV per host: ``ok``, ``closed_Full`` (every slot taken) or ``closed_Adm`` (closed by
  ``badmin hclose HOST...`` until ``badmin hopen HOST...``); a closed host takes no new job, so a
  job that needs it pends (until the pending deadline here).

State lives in HPCRING_LSF_EMU_DIR (default /srv/hpcring/.lsf-emulation, shared by all nodes).
Hosts: HPCRING_LSF_EMU_HOSTS (default: the dev cluster's nodes found in /run/netns), each with
HPCRING_LSF_EMU_SLOTS slots (default 4, the dev cluster's CPUs). Queues: HPCRING_LSF_EMU_QUEUES
(default "normal"; the first is the default queue). Job ids come from one counter for the whole
machine (HPCRING_LSF_EMU_ID_FILE, default /srv/hpcring/.lsf-emulation-last-jobid), so ids never
repeat across state dirs. Every wait has a deadline.
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PEND_TIMEOUT_S = float(os.environ.get("HPCRING_LSF_EMU_PEND_TIMEOUT", "600"))
KILL_INTERVAL_S = float(os.environ.get("HPCRING_LSF_EMU_KILL_INTERVAL", "3"))
# Seconds in one minute of -W/-wt (tests only: a run limit with a warning in tens of seconds).
MINUTE_S = float(os.environ.get("HPCRING_LSF_EMU_MINUTE_S", "60"))
FINISHED = ("DONE", "EXIT")


class LsfError(Exception):
    """A refusal, printed as LSF prints it; exit status 255 like LSF's commands."""


# ------------------------------------------------------------------------------------ state

def emu_dir() -> Path:
    d = Path(os.environ.get("HPCRING_LSF_EMU_DIR", "/srv/hpcring/.lsf-emulation"))
    (d / "jobs").mkdir(parents=True, exist_ok=True)
    return d


@contextmanager
def locked():
    with open(emu_dir() / "lock", "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def job_dir(job_id: str) -> Path:
    return emu_dir() / "jobs" / str(job_id)


def load(job_id: str) -> dict | None:
    try:
        return json.loads((job_dir(job_id) / "job.json").read_text())
    except (OSError, ValueError):
        return None


def save(job: dict) -> None:
    p = job_dir(job["id"]) / "job.json"
    tmp = p.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(job, indent=1))
    os.replace(tmp, p)


def update(job_id: str, **changes) -> dict:
    with locked():
        job = load(job_id)
        job.update(changes)
        save(job)
        return job


def all_jobs() -> list[dict]:
    out = []
    for d in sorted((emu_dir() / "jobs").iterdir(), key=lambda p: int(p.name) if p.name.isdigit() else 0):
        j = load(d.name)
        if j:
            out.append(j)
    return out


def hosts() -> list[str]:
    if os.environ.get("HPCRING_LSF_EMU_HOSTS"):
        return os.environ["HPCRING_LSF_EMU_HOSTS"].split()
    names = [p.name for p in Path("/run/netns").glob("node*") if p.name[4:].isdigit()]
    return sorted(names, key=lambda n: int(n[4:]))


def slots_per_host() -> int:
    return int(os.environ.get("HPCRING_LSF_EMU_SLOTS", "4"))


def closed_hosts() -> set[str]:
    """Hosts ``badmin hclose`` closed (one name a line in the state dir)."""
    try:
        return set((emu_dir() / "closed-hosts").read_text().split())
    except OSError:
        return set()


def queues() -> list[str]:
    return os.environ.get("HPCRING_LSF_EMU_QUEUES", "normal").split()


def exec_argv(host: str, cwd: str, daemon_pid: int | None = None) -> list[str]:
    """argv running a command on ``host`` (a dev cluster node's namespaces) in directory ``cwd``.

    From inside a node (blaunch in a job script) the other nodes' namespace files are not visible:
    the command first hops into the namespaces of the job's supervisor (``daemon_pid``, which runs
    in the machine's namespaces), as LSF's RES reaches the remote host over the network.
    """
    if str(ROOT / "src") not in sys.path:
        sys.path.insert(0, str(ROOT / "src"))
    from hpcring.devcluster import names, network
    from hpcring.devcluster.cluster import node_exec_argv
    if daemon_pid is None or os.readlink("/proc/self/ns/mnt") == os.readlink(f"/proc/{daemon_pid}/ns/mnt"):
        argv = node_exec_argv(host)
    else:
        argv = ["nsenter", f"--target={daemon_pid}", "--mount", "--net", "--uts", "--"] + \
            network.exec_argv(names.node_index(host))
    return argv[:-1] + [f"--wd={cwd}", "--"]


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[-1].split()[0] != "Z"
    except OSError:
        return False


def _killpg(pgid: int | None, sig: int) -> None:
    if pgid:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass


# ------------------------------------------------------------------------------------ bsub

_VALUE_OPTS = {"-J", "-n", "-R", "-q", "-P", "-W", "-o", "-e", "-oo", "-eo", "-wa", "-wt", "-gpu",
               "-nnodes", "-G", "-cwd", "-w"}
_FLAG_OPTS = {"-x", "-N", "-B", "-r", "-rn"}


def parse_options(argv: list[str], where: str) -> tuple[dict, list[str]]:
    """bsub options -> dict; the rest is the command. Raises LsfError for an unknown option."""
    opts: dict = {}
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in _VALUE_OPTS:
            if i + 1 >= len(argv):
                raise LsfError(f"{a}: option requires an argument ({where})")
            opts[a] = argv[i + 1]
            i += 2
        elif a in _FLAG_OPTS:
            opts[a] = True
            i += 1
        elif a.startswith("-"):
            raise LsfError(f"{a}: Illegal option ({where}). Job not submitted.")
        else:
            return opts, argv[i:]
    return opts, []


def script_directives(text: str) -> list[str]:
    """The words of every #BSUB line before the first command line (shebang and comments skipped)."""
    words: list[str] = []
    for line in text.splitlines():
        s = line.strip()
        if not s:
            continue
        if s.startswith("#BSUB"):
            body = s[len("#BSUB"):].split(" #", 1)[0]
            words.extend(shlex.split(body))
        elif s.startswith("#"):
            continue
        else:
            break
    return words


def _minutes(text: str, what: str) -> int:
    m = re.fullmatch(r"(?:(\d+):)?(\d+)", text.strip())
    if not m:
        raise LsfError(f"{what} {text!r}: Bad format, expected [hour:]minute. Job not submitted.")
    return int(m.group(1) or 0) * 60 + int(m.group(2))


def bsub(argv: list[str]) -> int:
    cli, command = parse_options(argv, "command line")
    if cli.get("-nnodes"):
        raise LsfError("-nnodes: CSM is not enabled on this cluster (not emulated). Job not submitted.")
    if command:  # `bsub script`: a command; #BSUB lines are not parsed (LSB_BSUB_PARSE_SCRIPT unset)
        parse = os.environ.get("LSB_BSUB_PARSE_SCRIPT", "N").upper() == "Y" and Path(command[0]).is_file()
        text = Path(command[0]).read_text() if parse else "#!/bin/sh\n" + shlex.join(command) + "\n"
    else:
        text = sys.stdin.read()
        if not text.strip():
            raise LsfError("No command is specified. Job not submitted.")
    opts, _ = parse_options(script_directives(text), "#BSUB line")
    if opts.get("-nnodes"):
        raise LsfError("-nnodes: CSM is not enabled on this cluster (not emulated). Job not submitted.")
    opts.update(cli)
    queue = opts.get("-q", queues()[0])
    if queue not in queues():
        raise LsfError(f"{queue}: No such queue. Job not submitted.")
    n = int(opts.get("-n", "1"))
    ptile, avoid = None, []
    if "-R" in opts:
        m = re.search(r"span\[ptile=(\d+)\]", opts["-R"])
        ptile = int(m.group(1)) if m else None
        avoid = _avoided_hosts(opts["-R"])
    if ptile is not None and ptile > slots_per_host():
        pass  # LSF accepts it; it pends forever (here: until the pending deadline)
    limit = _minutes(opts["-W"], "-W") if "-W" in opts else None
    warn = _minutes(opts["-wt"], "-wt") if "-wt" in opts else None
    if "-wa" in opts and not hasattr(signal, "SIG" + opts["-wa"].upper().removeprefix("SIG")):
        raise LsfError(f"-wa {opts['-wa']}: Bad signal name. Job not submitted.")
    name, indices, array_limit = _array_name(opts.get("-J") or (shlex.join(command) if command else "script"))
    if "-w" in opts:
        _conditions(opts["-w"])        # refused now if it does not parse
    job_id = _next_job_id()
    for index in indices or [0]:
        _new_job(job_id, index, array_limit, name, opts, text, command, queue, n, ptile, limit, warn, avoid)
    print(f"Job <{job_id}> is submitted to {'default ' if '-q' not in opts else ''}queue <{queue}>.")
    return 0


_ARRAY = re.compile(r"(.*)\[([0-9,:\-]+)\](?:%(\d+))?\Z", re.S)
MAX_JOB_ARRAY_SIZE = 1000


def _array_name(name: str) -> tuple[str, list[int], int | None]:
    """``name[1-16:2,20]%4`` -> (name, indices, 4); a plain name -> (name, [], None)."""
    m = _ARRAY.match(name)
    if not m:
        return name, [], None
    out: list[int] = []
    for part in m.group(2).split(","):
        pm = re.fullmatch(r"(\d+)(?:-(\d+)(?::(\d+))?)?", part)
        if not pm or int(pm.group(1)) < 1 or (pm.group(3) is not None and int(pm.group(3)) < 1):
            raise LsfError(f"{name}: Bad job name. Job not submitted.")
        lo, hi, step = int(pm.group(1)), int(pm.group(2) or pm.group(1)), int(pm.group(3) or 1)
        out.extend(range(lo, hi + 1, step))
    if not out or len(out) > MAX_JOB_ARRAY_SIZE or len(set(out)) != len(out):
        raise LsfError(f"{name}: Bad job name. Job not submitted.")
    return m.group(1), sorted(out), int(m.group(3)) if m.group(3) else None


_CONDITION = re.compile(r"\s*(done|ended|exit|started)\(\s*(\d+(?:\[\d+\])?)\s*\)\s*")


def _conditions(expr: str) -> list[tuple[str, str]]:
    """``done(12) && ended(13[2])`` -> [("done", "12"), ("ended", "13[2]")]."""
    out = []
    for part in expr.split("&&"):
        m = _CONDITION.fullmatch(part)
        if not m:
            raise LsfError(f"{expr}: Syntax error in dependency expression (this emulation: done/ended/exit/"
                           "started of job ids joined by &&). Job not submitted.")
        out.append((m.group(1), m.group(2)))
    return out


def _dependency_met(expr: str | None) -> bool:
    """Every condition of ``-w`` holds now (an array's id: over all its elements)."""
    for word, ref in _conditions(expr) if expr else []:
        jobs = select(ref)
        stats = [j["stat"] for j in jobs]
        met = bool(jobs) and {"done": all(s == "DONE" for s in stats),
                              "ended": all(s in FINISHED for s in stats),
                              "exit": all(s == "EXIT" for s in stats),
                              "started": all(s != "PEND" for s in stats)}[word]
        if not met:
            return False
    return True


def select(ref: str) -> list[dict]:
    """The jobs ``ref`` names: a job, an array element ``ID[i]``, or every element of array ``ID``."""
    job = load(ref)
    if job is not None:
        return [job]
    return [j for j in all_jobs() if j.get("array_id") == ref]


def _avoided_hosts(req: str) -> list[str]:
    """The hosts a ``select[hname!=A && hname!=B]`` section rules out (the only select terms emulated;
    any other select expression is refused rather than silently ignored)."""
    m = re.search(r"select\[([^\]]*)\]", req)
    if not m:
        return []
    out = []
    for term in m.group(1).split("&&"):
        t = re.fullmatch(r"\s*hname\s*!=\s*([A-Za-z0-9._-]+)\s*", term)
        if not t:
            raise LsfError(f"{req}: Bad resource requirement syntax (this emulation only knows select[hname!=HOST "
                           "&& ...]). Job not submitted.")
        out.append(t.group(1))
    return out


def _new_job(job_id, index, array_limit, name, opts, text, command, queue, n, ptile, limit, warn,
             avoid=()) -> None:
    own = f"{job_id}[{index}]" if index else job_id
    with locked():
        d = job_dir(own)
        d.mkdir(parents=True, exist_ok=True)
        (d / "script").write_text(text)
        job = {"id": own, "array_id": job_id if index else None, "index": index, "array_limit": array_limit,
               "depend": opts.get("-w"), "name": f"{name}[{index}]" if index else name,
               "queue": queue, "project": opts.get("-P", "default"), "user": os.environ.get("USER", "root"),
               "n": n, "ptile": ptile, "exclusive": bool(opts.get("-x")), "gpu": opts.get("-gpu"),
               "limit_min": limit, "warn_action": opts.get("-wa"), "warn_min": warn,
               "out": opts.get("-oo") or opts.get("-o"), "out_overwrite": "-oo" in opts,
               "err": opts.get("-eo") or opts.get("-e"), "err_overwrite": "-eo" in opts,
               "cwd": opts.get("-cwd") or os.getcwd(), "sub_host": socket.gethostname(),
               "env": dict(os.environ), "stat": "PEND", "submitted": time.time(), "hosts": [],
               "exit_code": None, "requests": [], "runs": 0, "avoid": list(avoid)}
        save(job)
    _spawn_sbatchd(own)


def _next_job_id() -> str:
    """Job ids are unique on the cluster (as LSF's, below MAX_JOBID): one counter for every
    emulation state dir, so job folders named by id never collide."""
    path = Path(os.environ.get("HPCRING_LSF_EMU_ID_FILE", "/srv/hpcring/.lsf-emulation-last-jobid"))
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        fh.seek(0)
        job_id = str(int(fh.read().strip() or "0") + 1)
        fh.seek(0)
        fh.truncate()
        fh.write(job_id)
    return job_id


def _spawn_sbatchd(job_id: str) -> None:
    log = open(job_dir(job_id) / "sbatchd.log", "ab")
    subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "_sbatchd", job_id],
                     stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
                     close_fds=True)
    log.close()


# ------------------------------------------------------------------------------ placement

def _place(job: dict, busy: dict[str, int], exclusive_hosts: set[str]) -> list[str] | None:
    """One entry per slot, hosts in order; None if the job does not fit now."""
    cap = slots_per_host()
    shut = exclusive_hosts | closed_hosts() | set(job.get("avoid", ()))
    free = {h: (0 if h in shut else cap - busy.get(h, 0)) for h in hosts()}
    if job["exclusive"]:
        free = {h: (cap if busy.get(h, 0) == 0 and h not in shut else 0) for h in free}
    n, ptile = job["n"], job["ptile"]
    slots: list[str] = []
    for h in hosts():
        take = min(free[h], n - len(slots)) if ptile is None else (
            min(ptile, n - len(slots)) if free[h] >= min(ptile, n - len(slots)) else 0)
        slots.extend([h] * take)
        if len(slots) == n:
            return slots
    return None


def _in_use(but: str | None = None) -> tuple[dict[str, int], set[str]]:
    """Slots taken per host and the hosts held exclusively, by running or suspended jobs other
    than ``but`` (call under the lock). A lost job (UNKWN: its sbatchd gone) holds no slots."""
    busy: dict[str, int] = {}
    excl: set[str] = set()
    for other in all_jobs():
        if other["id"] != but and other["stat"] in ("RUN", "USUSP", "SSUSP") and \
                _alive(int(other.get("sbatchd") or 0)):
            for h in other["hosts"]:
                busy[h] = busy.get(h, 0) + 1
            if other["exclusive"]:
                excl.update(other["hosts"])
    return busy, excl


def _try_dispatch(job_id: str) -> dict | None:
    with locked():
        job = load(job_id)
        busy, excl = _in_use(but=job_id)
        if "kill" in job.get("requests", []) or job["stat"] != "PEND":
            return None
        if job.get("array_limit") and sum(1 for o in all_jobs() if o.get("array_id") == job["array_id"]
                                          and o["stat"] in ("RUN", "USUSP", "SSUSP")) >= job["array_limit"]:
            return None
        if not _dependency_met(job.get("depend")):
            return None
        slots = _place(job, busy, excl)
        if slots is None:
            return None
        job.update(stat="RUN", hosts=slots, started=time.time(), runs=job["runs"] + 1, sbatchd=os.getpid())
        save(job)
        return job


def _pending_requests(job_id: str) -> list[str]:
    job = load(job_id)
    return job.get("requests", []) if job else []


# -------------------------------------------------------------------------------- sbatchd

def _subst(path: str, job: dict) -> str:
    return path.replace("%J", job.get("array_id") or job["id"]).replace("%I", str(job.get("index") or 0))


def _job_env(job: dict, hostfile: Path, script: Path) -> dict:
    slots = job["hosts"]
    mcpu = []
    for h in dict.fromkeys(slots):
        mcpu += [h, str(slots.count(h))]
    env = dict(job["env"])
    env.update(LSB_JOBID=job.get("array_id") or job["id"], LSB_JOBINDEX=str(job.get("index") or 0), LSB_JOBNAME=job["name"], LSB_QUEUE=job["queue"],
               LSB_HOSTS=" ".join(slots), LSB_MCPU_HOSTS=" ".join(mcpu), LSB_DJOB_HOSTFILE=str(hostfile),
               LSB_DJOB_RANKFILE=str(hostfile.with_name("rankfile")), LSB_DJOB_NUMPROC=str(len(slots)),
               LSB_SUB_HOST=job["sub_host"], LSB_JOBFILENAME=str(script), LS_SUBCWD=job["cwd"],
               LSB_PROJECT_NAME=job["project"])
    if job["out"]:
        env["LSB_OUTPUTFILE"] = _subst(job["out"], job)
    if job["err"]:
        env["LSB_ERRORFILE"] = _subst(job["err"], job)
    return env


def _interpreter(text: str) -> list[str]:
    first = text.splitlines()[0] if text else ""
    return shlex.split(first[2:]) if first.startswith("#!") else ["/bin/sh"]


def _copy_output(job: dict, spool: Path, target: str | None, overwrite: bool, report: str) -> None:
    if not target:
        return
    path = Path(_subst(target, job))
    if not path.parent.is_dir():  # LSF: "If the specified output_file path is not accessible, the output will not be stored."
        return
    with open(path, "w" if overwrite else "a") as out:
        out.write(spool.read_text(errors="replace") if spool.exists() else "")
        out.write(report)


def _report(job: dict, stat: str, code: int) -> str:
    line = "-" * 60
    how = "Successfully completed." if stat == "DONE" else f"Exited with exit code {code}."
    return (f"\n{line}\nSender: LSF System (hpcring LSF emulation)\n"
            f"Job <{job['id']}> ({job['name']}) was submitted from host <{job['sub_host']}> to queue "
            f"<{job['queue']}>, executed on hosts <{' '.join(job['hosts'])}>.\n{how}\n{line}\n")


def sbatchd(job_id: str) -> int:
    """Per-job supervisor: wait for slots, run the script on the first host, enforce limits."""
    while True:
        deadline = time.time() + PEND_TIMEOUT_S
        job = None
        while job is None:
            if "kill" in _pending_requests(job_id):
                update(job_id, stat="EXIT", exit_code=130, reason="TERM_OWNER: killed while pending",
                       ended=time.time())
                return 0
            job = _try_dispatch(job_id)
            if job is None:
                if time.time() > deadline:
                    update(job_id, stat="EXIT", exit_code=255, ended=time.time(),
                           reason=f"emulation: pending longer than {PEND_TIMEOUT_S:.0f} s")
                    return 0
                time.sleep(0.5)
        requeue = _run(job)
        if not requeue:
            return 0
        update(job_id, stat="PEND", hosts=[], requests=[], exit_code=None, pgid=None)


def _run(job: dict) -> bool:
    """Run one dispatch of the job; True if it was requeued (brequeue)."""
    d = job_dir(job["id"])
    hostfile = d / "hostfile"
    hostfile.write_text("".join(h + "\n" for h in job["hosts"]))
    (d / "rankfile").write_text(hostfile.read_text())
    script = d / "script"
    text = script.read_text()
    env = _job_env(job, hostfile, script)
    cwd = job["cwd"] if Path(job["cwd"]).is_dir() and not job["cwd"].startswith("/tmp") else "/tmp"
    out_spool, err_spool = d / "stdout", d / "stderr"
    with open(out_spool, "wb") as out, open(err_spool if job["err"] else out_spool, "ab") as err:
        proc = subprocess.Popen(exec_argv(job["hosts"][0], cwd) + _interpreter(text) + [str(script)],
                                cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                start_new_session=True)
    update(job["id"], pgid=proc.pid, pid=proc.pid)
    limit_at = job["started"] + job["limit_min"] * MINUTE_S if job["limit_min"] else None
    warn_at = limit_at - (job["warn_min"] or 0) * MINUTE_S if limit_at and job["warn_action"] else None
    kill_at = None
    reason = None
    requeued = False
    while proc.poll() is None:
        now = time.time()
        reqs = _pending_requests(job["id"])
        if ("kill" in reqs or "requeue" in reqs) and kill_at is None:
            requeued = "requeue" in reqs and "kill" not in reqs
            reason = "TERM_REQUEUE_OWNER" if requeued else "TERM_OWNER"
            _killpg(proc.pid, signal.SIGCONT)
            _killpg(proc.pid, signal.SIGINT)
            _killpg(proc.pid, signal.SIGTERM)
            kill_at = now + KILL_INTERVAL_S
        if warn_at and now >= warn_at:
            _killpg(proc.pid, getattr(signal, "SIG" + job["warn_action"].upper().removeprefix("SIG")))
            warn_at = None
        if limit_at and now >= limit_at and kill_at is None:
            reason = "TERM_RUNLIMIT: job killed after reaching LSF run time limit"
            _killpg(proc.pid, signal.SIGCONT)
            _killpg(proc.pid, signal.SIGINT)
            _killpg(proc.pid, signal.SIGTERM)
            kill_at = now + KILL_INTERVAL_S
        if kill_at and now >= kill_at:
            _killpg(proc.pid, signal.SIGKILL)
        time.sleep(0.2)
    # A brequeue that came just before the job's own exit (rank 0 requeues, then exits) still
    # requeues it, as mbatchd would: the loop above may not have polled it yet.
    if kill_at is None:
        reqs = _pending_requests(job["id"])
        if "requeue" in reqs and "kill" not in reqs:
            requeued, reason = True, "TERM_REQUEUE_OWNER"
    # the whole process group goes with the job (blaunch tasks included)
    _killpg(proc.pid, signal.SIGKILL)
    rc = proc.returncode
    code = rc if rc >= 0 else 128 - rc
    if requeued:
        return True
    stat = "DONE" if code == 0 and reason is None else "EXIT"
    report = _report(dict(job), stat, code)
    _copy_output(job, out_spool, job["out"], job["out_overwrite"], report)
    if job["err"]:
        _copy_output(job, err_spool, job["err"], job["err_overwrite"], "")
    update(job["id"], stat=stat, exit_code=code, ended=time.time(), reason=reason, pgid=None)
    return False


# --------------------------------------------------------------------------------- bjobs

_FIELDS = {"jobid": lambda j: j.get("array_id") or j["id"], "id": lambda j: j.get("array_id") or j["id"],
           "jobindex": lambda j: str(j.get("index") or 0), "stat": lambda j: j["stat"],
           "queue": lambda j: j["queue"], "user": lambda j: j["user"], "job_name": lambda j: j["name"],
           "name": lambda j: j["name"], "from_host": lambda j: j["sub_host"],
           "exit_code": lambda j: str(j["exit_code"]) if j["stat"] == "EXIT" and j["exit_code"] else "-",
           "exec_host": lambda j: ":".join(f"{j['hosts'].count(h)}*{h}" for h in dict.fromkeys(j["hosts"]))
           or "-"}


def _effective(job: dict) -> dict:
    """A started job whose supervisor died is lost: LSF shows UNKWN when it cannot reach the host."""
    if job["stat"] in ("RUN", "USUSP", "SSUSP") and job.get("sbatchd") and not _alive(int(job["sbatchd"])):
        time.sleep(0.3)  # the supervisor may be writing the final state right now
        job = load(job["id"])
        if job["stat"] in ("RUN", "USUSP", "SSUSP") and not _alive(int(job["sbatchd"])):
            job = dict(job, stat="UNKWN")
    return job


def bjobs(argv: list[str]) -> int:
    fields = ["jobid", "user", "stat", "queue", "from_host", "exec_host", "job_name"]
    header, show_all, ids = True, False, []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "-o":
            spec = argv[i + 1]
            spec = re.sub(r"delimiter='.*?'", "", spec)
            fields = [f.split(":")[0].lower() for f in spec.split()]
            i += 2
            continue
        if a == "-noheader":
            header = False
        elif a == "-a":
            show_all = True
        elif a == "-w":
            pass
        elif a.startswith("-"):
            raise LsfError(f"{a}: Illegal option")
        else:
            ids.append(a)
        i += 1
    bad = [f for f in fields if f not in _FIELDS]
    if bad:
        raise LsfError(f"{bad[0]}: Illegal field. (supported by this emulation: {', '.join(_FIELDS)})")
    rows, rc = [], 0
    if ids:
        for jid in ids:
            jobs = select(jid)
            if not jobs:
                print(f"Job <{jid}> is not found", file=sys.stderr)
                rc = 255
            rows.extend(_effective(job) for job in jobs)
    else:
        rows = [_effective(j) for j in all_jobs() if show_all or j["stat"] not in FINISHED]
        if not rows:
            print("No unfinished job found", file=sys.stderr)
    if rows and header:
        print(" ".join(f.upper() for f in fields))
    for job in rows:
        print(" ".join(_FIELDS[f](job) for f in fields))
    return rc


# ------------------------------------------------------------------- bkill, bstop, brequeue

def _jobs_arg(argv: list[str], flags: set[str]) -> tuple[set[str], list[str]]:
    seen = {a for a in argv if a in flags}
    ids = [a for a in argv if not a.startswith("-")]
    other = [a for a in argv if a.startswith("-") and a not in flags]
    if other:
        raise LsfError(f"{other[0]}: Illegal option")
    if not ids:
        raise LsfError("Job ID must be specified (this emulation has no 'most recent job' default)")
    return seen, ids


def _request(job_id: str, what: str) -> dict | None:
    with locked():
        job = load(job_id)
        if job is None:
            return None
        job["requests"] = job.get("requests", []) + [what]
        save(job)
        return job


def bkill(argv: list[str]) -> int:
    _, ids = _jobs_arg(argv, set())
    rc = 0
    for jid, job in [(j["id"], j) for ref in ids for j in select(ref)] + [(r, None) for r in ids if not select(r)]:
        if job is None:
            print(f"Job <{jid}>: No matching job found", file=sys.stderr)
            rc = 255
        elif job["stat"] in FINISHED:
            print(f"Job <{jid}>: Job has already finished", file=sys.stderr)
            rc = 255
        else:
            _request(jid, "kill")
            if job["stat"] in ("RUN", "USUSP", "SSUSP"):
                _killpg(job.get("pgid"), signal.SIGCONT)
                _killpg(job.get("pgid"), signal.SIGINT)
                _killpg(job.get("pgid"), signal.SIGTERM)
            print(f"Job <{jid}> is being terminated")
    return rc


def bstop(argv: list[str]) -> int:
    _, ids = _jobs_arg(argv, set())
    for jid in ids:
        with locked():
            job = load(jid)
            if job is None or job["stat"] in FINISHED:
                raise LsfError(f"Job <{jid}>: {'No matching job found' if job is None else 'Job has already finished'}")
            if job["stat"] == "RUN":
                _killpg(job.get("pgid"), signal.SIGSTOP)
                job["stat"] = "USUSP"
            elif job["stat"] == "PEND":
                job["stat"] = "PSUSP"
            save(job)
        print(f"Job <{jid}> is being stopped")
    return 0


def bresume(argv: list[str]) -> int:
    _, ids = _jobs_arg(argv, set())
    for jid in ids:
        with locked():
            job = load(jid)
            if job is None or job["stat"] not in ("USUSP", "PSUSP", "SSUSP"):
                raise LsfError(f"Job <{jid}>: The job is not suspended")
            if job["stat"] in ("USUSP", "SSUSP"):
                _killpg(job.get("pgid"), signal.SIGCONT)
                job["stat"] = "RUN"
            else:
                job["stat"] = "PEND"
            save(job)
        print(f"Job <{jid}> is being resumed")
    return 0


def brequeue(argv: list[str]) -> int:
    flags, ids = _jobs_arg(argv, {"-a", "-d", "-e", "-r", "-H"})
    for jid in ids:
        job = load(jid)
        if job is None:
            raise LsfError(f"Job <{jid}>: No matching job found")
        ok_finished = ({"DONE"} if flags & {"-d", "-a"} else set()) | ({"EXIT"} if flags & {"-e", "-a"} else set())
        if job["stat"] in ("RUN", "USUSP", "SSUSP"):
            _request(jid, "requeue")
        elif job["stat"] in ok_finished:
            update(jid, stat="PEND", hosts=[], requests=[], exit_code=None, reason=None)
            _spawn_sbatchd(jid)
        else:
            raise LsfError(f"Job <{jid}>: Job is not in a requeueable state ({job['stat']})")
        print(f"Job <{jid}> is being requeued")
    return 0


# -------------------------------------------------------------------------------- blaunch

# Signals blaunch passes on to its tasks (it is their signal handler in LSF's blaunch framework);
# SIGKILL and SIGSTOP cannot be caught: the job's process group gets those (bkill, bstop).
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGCONT)


def _job_wide(job_id: str) -> bool:
    """Whether LSF itself is signalling the whole job's process group now (bkill, brequeue, the run
    limit, bstop/bresume), so that blaunch's tasks got the signal directly."""
    job = load(job_id)
    if job is None or job["stat"] != "RUN" or {"kill", "requeue"} & set(job.get("requests") or []):
        return True
    return bool(job.get("limit_min")) and time.time() >= job["started"] + job["limit_min"] * MINUTE_S - 1


def blaunch(argv: list[str]) -> int:
    job_id = os.environ.get("LSB_JOBID")
    if job_id and os.environ.get("LSB_JOBINDEX", "0") not in ("", "0"):
        job_id = f"{job_id}[{os.environ['LSB_JOBINDEX']}]"      # an array element's own record
    job = load(job_id) if job_id else None
    if job is None or job["stat"] not in ("RUN", "USUSP", "SSUSP"):
        raise LsfError("blaunch: not running inside an LSF job (LSB_JOBID unset or the job is not running); "
                       "blaunch cannot be used as a stand-alone command")
    targets: list[str] | None = None
    shell = True
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "-n":
            i += 1
        elif a == "-u":
            targets = [l.split()[0] for l in Path(argv[i + 1]).read_text().splitlines() if l.strip()]
            i += 2
        elif a == "-z":
            targets = argv[i + 1].split()
            i += 2
        elif a == "-no-shell":
            shell = False
            i += 1
        elif a == "-use-login-shell":
            i += 1
        elif a.startswith("-"):
            raise LsfError(f"blaunch: {a}: Illegal option")
        else:
            break
    rest = argv[i:]
    if targets is None and len(rest) > 1 and rest[0] in set(job["hosts"]):  # rsh style: blaunch host command
        targets, rest = [rest[0]], rest[1:]
    if not rest:
        raise LsfError("blaunch: no command given")
    if targets is None:
        targets = list(job["hosts"])  # one remote task per job slot
    outside = [h for h in targets if h not in job["hosts"]]
    if outside:
        raise LsfError(f"blaunch: host {outside[0]} is not part of job <{job_id}>'s allocation "
                       f"({' '.join(dict.fromkeys(job['hosts']))})")
    cmd = ["/bin/sh", "-c", " ".join(rest)] if shell else rest
    procs: list[subprocess.Popen] = []

    def forward(sig, _frame):
        if _job_wide(job_id):
            return                      # LSF is signalling the whole job: the tasks have it already
        for p in procs:
            if p.poll() is None:
                try:
                    p.send_signal(sig)
                except ProcessLookupError:
                    pass
    for sig in FORWARDED:
        if signal.getsignal(sig) == signal.SIG_DFL:     # a signal the job script ignores stays ignored
            signal.signal(sig, forward)
    for task_id, host in enumerate(targets, start=1):
        env = dict(os.environ, LSF_PM_TASKID=str(task_id))
        procs.append(subprocess.Popen(exec_argv(host, os.getcwd(), job.get("sbatchd")) + cmd, env=env, stdin=subprocess.DEVNULL))
    # The tasks end with the job at the latest: the run limit (plus the kill interval) bounds this wait.
    limit = (job["started"] + job["limit_min"] * MINUTE_S + 2 * KILL_INTERVAL_S + 5) if job["limit_min"] else \
        time.time() + PEND_TIMEOUT_S * 6
    codes = []
    for p in procs:
        try:
            p.wait(timeout=max(0.1, limit - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=10)
        codes.append(p.returncode if p.returncode >= 0 else 128 - p.returncode)
    return next((c for c in codes if c), 0)


def bhosts(argv: list[str]) -> int:
    opts = [a for a in argv if a.startswith("-")]
    names = [a for a in argv if not a.startswith("-")]
    if set(opts) - {"-w"}:
        raise LsfError(f"bhosts: illegal option -- {sorted(set(opts) - {'-w'})[0].lstrip('-')}")
    known = hosts()
    bad = [n for n in names if n not in known]
    if bad:
        raise LsfError(f"{bad[0]}: Bad host name, host group name or cluster name")
    cap, shut = slots_per_host(), closed_hosts()
    with locked():
        busy, excl = _in_use()
    print(f"{'HOST_NAME':<20}{'STATUS':<15}{'JL/U':>4}{'MAX':>7}{'NJOBS':>7}{'RUN':>7}{'SSUSP':>7}"
          f"{'USUSP':>7}{'RSV':>7}")
    for h in names or known:
        n = busy.get(h, 0)
        status = "closed_Adm" if h in shut else ("closed_Full" if n >= cap or h in excl else "ok")
        print(f"{h:<20}{status:<15}{'-':>4}{cap:>7}{n:>7}{n:>7}{0:>7}{0:>7}{0:>7}")
    return 0


def badmin(argv: list[str]) -> int:
    if not argv or argv[0] not in ("hclose", "hopen"):
        raise LsfError("badmin: this emulation knows hclose and hopen only")
    what, names = argv[0], [a for a in argv[1:] if not a.startswith("-")]
    known = hosts()
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise LsfError(f"{bad[0]}: Bad host name" if bad else f"badmin {what}: name a host")
    with locked():
        shut = closed_hosts()
        shut = shut | set(names) if what == "hclose" else shut - set(names)
        (emu_dir() / "closed-hosts").write_text("".join(f"{h}\n" for h in sorted(shut)))
    for h in names:
        print(f"{'Close' if what == 'hclose' else 'Open'} <{h}> ...... done")
    return 0


COMMANDS = {"bsub": bsub, "bjobs": bjobs, "bkill": bkill, "bstop": bstop, "bresume": bresume,
            "brequeue": brequeue, "blaunch": blaunch, "bhosts": bhosts, "badmin": badmin}


def main(name: str, argv: list[str]) -> int:
    if name == "_sbatchd":
        return sbatchd(argv[0])
    try:
        return COMMANDS[name](argv)
    except LsfError as exc:
        print(str(exc), file=sys.stderr)
        return 255


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
